"""Step values from the prefixes a group's own responses share: per-step credit with no extra rollouts.

The responses to a prompt form a prefix tree at their step boundaries (the states VinePPO would estimate). A
state that two or more responses pass through has a value without any continuation: the mean reward of those
responses (after TEMPO, Tran, Yao and Yu, arXiv 2509.18314, whose tree is over tokens; docs/algorithms.md says
where this differs).

The rule for the rest: only shared states cut a response into segments. The tokens from one shared state to the
next get V(next) - V(this); the tokens after a response's last shared state get r - V(last shared state): the
response's own reward against the deepest prefix it shares. The prompt is shared by the whole group, so a
response that shares nothing else gets r - (its group's mean reward), Dr. GRPO's advantage; one that shares its
first steps with others gets credit per shared step. A value includes the response's own reward, as GRPO's mean
does.
"""

from __future__ import annotations

import torch

from vineppo.credit.base import Credit, CreditContext, Episode, register, segment_advantages
from vineppo.credit.vine import StateKey, find_states


def shared_values(episodes: list[Episode], keys: list[dict[int, StateKey]]) -> dict[StateKey, float]:
    """The value of every state that two or more episodes hold: the mean reward of the episodes through it."""
    through: dict[StateKey, list[float]] = {}
    for ep, held in zip(episodes, keys):
        for key in held.values():
            through.setdefault(key, []).append(ep.reward)
    return {key: sum(r) / len(r) for key, r in through.items() if len(r) > 1}


@register("tempo")
def tempo(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """Per-segment advantages between the shared states of the group's prefix tree (the module's rule); no rollouts.

    The states are the step starts `ctx.mc_states` picks, all of them (no cap: they cost nothing). Statistics:
    the share of states with a shared value (`tempo/shared`) and the mean number of shared states per response."""
    states = find_states(episodes, ctx.mc_states, cap=10**9)
    value = shared_values(episodes, states.keys)
    advantages, depth = [], []
    for ep, held in zip(episodes, states.keys):
        offsets = [s for s, key in held.items() if key in value]
        advantages.append(segment_advantages(len(ep.response_ids), offsets, [value[held[s]] for s in offsets],
                                             ep.reward, ctx.gamma) if offsets else torch.zeros(len(ep.response_ids)))
        depth.append(len(offsets))
    n_states = sum(map(len, states.keys))
    used = [value[key] for held in states.keys for key in held.values() if key in value]
    v = torch.tensor(used) if used else torch.zeros(1)
    return Credit(advantages, stats={"tempo/shared": sum(depth) / max(n_states, 1),
                                     "tempo/shared_per_response": sum(depth) / max(len(episodes), 1),
                                     "value/mean": float(v.mean()), "value/std": float(v.std()) if len(v) > 1 else 0.0})


def implied_values(episodes: list[Episode], offsets: list[int]) -> list[tuple[float | None, bool]]:
    """What TEMPO's advantages take as the value of episodes[i] at response offset offsets[i] (`vineppo analyze-values`):
    the value of the deepest shared state at or before it (None when it shares none), and whether the state itself
    is shared."""
    states = find_states(episodes, "all", cap=10**9)
    value = shared_values(episodes, states.keys)
    out = []
    for held, at in zip(states.keys, offsets):
        below = [s for s, key in held.items() if key in value and s <= at]
        out.append((value[held[max(below)]] if below else None, at in held and held[at] in value))
    return out
