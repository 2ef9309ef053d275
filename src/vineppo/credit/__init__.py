"""Credit assignment: every advantage estimator is a small function registered by name, with one signature
(`base.py`). Per response: `grpo`, `rloo` (`group.py`); per token from a learned critic: `gae` (`critic.py`); per
step from Monte Carlo continuations, which may train too: `vine` (`vine.py`); per step from the prefixes the
group's responses share: `tempo` (`tempo.py`). Adding an estimator is one registered function in a module here.
"""

from vineppo.credit import critic, group, tempo, vine  # noqa: F401  (each registers its estimators)
from vineppo.credit.base import (ESTIMATORS, NEEDS, Credit, CreditContext, Episode, Estimator, Needs, flat_groups,
                                 get_estimator, groups, known, needs, nonzero_tokens, normalise, per_response, register,
                                 segment_advantages, step_advantages, token_mean_std)
from vineppo.credit.critic import gae
from vineppo.credit.group import REWARD_SCALES, reward_std
from vineppo.credit.vine import (State, States, find_states, leave_one_out, monte_carlo, next_round, settled,
                                 state_offsets, step_credit, trained_continuations, wilson_half_width)

__all__ = ["ESTIMATORS", "NEEDS", "REWARD_SCALES", "Credit", "CreditContext", "Episode", "Estimator", "Needs", "State",
           "States", "find_states", "flat_groups", "nonzero_tokens", "gae", "get_estimator", "groups", "known", "leave_one_out", "monte_carlo", "needs",
           "next_round", "normalise", "per_response", "register", "reward_std", "segment_advantages", "settled",
           "state_offsets", "step_advantages", "step_credit", "token_mean_std", "trained_continuations",
           "wilson_half_width"]
