"""The one exception type the command line turns into a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a model): the message says what and where."""


class RewardError(UserError):
    """A user's reward function failed (raised, returned something that is not a reward, ran past its time limit)."""


class RolloutFault(RewardError):
    """An environment failed during a rollout (its message names the row); `finished` holds, per prompt, the samples
    that finished before it, so a caller can keep them (`vineppo eval` writes them)."""

    def __init__(self, message: str, finished: list | None = None):
        super().__init__(message)
        self.finished = finished or []
        self.rows: list[dict] = []  # the per-problem rows an evaluation made of `finished` (vineppo.training.evaluation)
