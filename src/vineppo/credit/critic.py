"""PPO's credit: a learned critic scores every response token, advantages by GAE."""

from __future__ import annotations

import torch

from vineppo.credit.base import Credit, CreditContext, Episode, Needs, register


def gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation over one sequence; the value after the last position is 0."""
    adv = torch.zeros_like(values)
    last = 0.0
    for t in reversed(range(len(values))):
        nxt = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * nxt - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv



@register("gae", Needs(critic=True))
def critic_gae(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """PPO: a learned critic scores every response token; advantages by GAE(gamma, lambda)."""
    values = ctx.critic.values([ep.prompt_ids for ep in episodes], [ep.response_ids for ep in episodes])
    advantages, returns = [], []
    for ep, v in zip(episodes, values):
        rewards = torch.zeros_like(v)
        rewards[-1] = ep.reward
        adv = gae(v, rewards, ctx.gamma, ctx.gae_lambda)
        advantages.append(adv)
        returns.append(adv + v)
    flat = torch.cat(values)
    return Credit(advantages, returns=returns, values=values,
                  stats={"value/mean": float(flat.mean()), "value/std": float(flat.std()) if len(flat) > 1 else 0.0})
