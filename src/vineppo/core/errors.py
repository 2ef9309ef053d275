"""The one exception type the command line turns into a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a model): the message says what and where."""


class RewardError(UserError):
    """A user's reward function failed (raised, returned something that is not a reward, ran past its time limit)."""
