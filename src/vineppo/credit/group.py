"""Per-response credit from the group of responses to one prompt: GRPO and RLOO."""

from __future__ import annotations

import math
from typing import Callable

import torch

from vineppo.core import distributed as dist
from vineppo.credit.base import Credit, CreditContext, Episode, groups, per_response, register

# --scale-rewards: what divides GRPO's group-centred reward, from (the group's rewards, the batch's reward std).
RewardScale = Callable[[torch.Tensor, float], torch.Tensor | float]
REWARD_SCALES: dict[str, RewardScale] = {
    "group": lambda r, batch_std: (r.std() if len(r) > 1 else torch.tensor(0.0)) + 1e-6,  # the group's std
    "batch": lambda r, batch_std: batch_std + 1e-6,  # the std of every reward of the batch (PPO-Lite; TRL "batch")
    "none": lambda r, batch_std: 1.0,  # Dr. GRPO: the centred reward as it is
}


def reward_std(episodes: list[Episode]) -> float:
    """The sample standard deviation of the rewards of every episode over all ranks (0 for fewer than two)."""
    n, s, ss = dist.all_sum([float(len(episodes)), sum(ep.reward for ep in episodes),
                             sum(ep.reward ** 2 for ep in episodes)])
    return math.sqrt(max(ss - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0


@register("grpo")
def grpo(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """GRPO: (r - mean of its group) / the scale `ctx.scale_rewards` names (its group's std by default), the same
    for every token of a response."""
    scale = REWARD_SCALES[ctx.scale_rewards]
    batch_std = reward_std(episodes)
    scores = [0.0] * len(episodes)
    for members in groups(episodes).values():
        r = torch.tensor([episodes[i].reward for i in members])
        for i, a in zip(members, (r - r.mean()) / scale(r, batch_std)):
            scores[i] = float(a)
    return Credit(per_response(episodes, scores))


@register("rloo")
def rloo(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """RLOO: r minus the mean reward of the other responses to the same prompt."""
    scores = [0.0] * len(episodes)
    for members in groups(episodes).values():
        total, n = sum(episodes[i].reward for i in members), len(members)
        for i in members:
            scores[i] = episodes[i].reward - (total - episodes[i].reward) / (n - 1) if n > 1 else 0.0
    return Credit(per_response(episodes, scores))
