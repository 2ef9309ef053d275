"""VinePPO: the value of every step from K Monte Carlo continuations, and (tree rollouts) those continuations trained.

Read `vine` top to bottom: find the states (`find_states`), value them by Monte Carlo (`monte_carlo`), turn the
values into per-segment advantages (`step_credit`), and, with `--mc-train-fraction`, make the continuations
episodes of their own (`trained_continuations`). TEMPO (vineppo.credit.tempo) values the same states from the
group's own responses instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vineppo import agents
from vineppo.core.grading import continuation_rewards
from vineppo.credit.base import Credit, CreditContext, Episode, Needs, known, register, segment_advantages
from vineppo.engine import Request, Sample

StateKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # (example id, prompt ids, response ids before the state)


@dataclass
class State:
    """A prefix whose value is estimated: prompt + response[:offset] of `episode`, the first episode that holds it
    (its continuations are drawn from that one's tokens). Equal prefixes of other episodes are the same state."""

    episode: int
    offset: int  # response tokens before the state
    samples: list[Sample] = field(default_factory=list)  # its continuations, in draw order
    rewards: list[float | None] = field(default_factory=list)  # their rewards (None: the reward function gave none)

    def value(self, fallback: float) -> float:
        """The mean reward of its continuations that have one, else `fallback`."""
        w = known(self.rewards)
        return sum(w) / len(w) if w else fallback


@dataclass
class States:
    """The states of a batch: each episode's segment starts and the distinct prefixes among its estimated ones."""

    cuts: list[list[int]]  # per episode, the response offsets where its segments start (`state_offsets`)
    keys: list[dict[int, StateKey]]  # per episode, offset -> state, for its estimated offsets (at most the cap)
    unique: dict[StateKey, State]  # each distinct state once, in the order first held


def state_offsets(steps: list[tuple[int, int]], n_tokens: int, mode: str,
                  entropies: list[float] | None = None) -> list[int]:
    """Response offsets whose values are estimated (`--mc-states`): all | every:N | tokens:N | budget:B | entropy:M
    (`entropies`: the sampler's per-token entropies, which entropy:M reads)."""
    starts = sorted({s for s, _ in steps if s < n_tokens})
    kind, _, arg = mode.partition(":")
    if kind == "all" or not starts:
        return starts
    n = int(arg)
    if kind == "every":
        return starts[::n]
    if kind == "entropy":
        return entropy_starts(starts, n, entropies)
    if kind == "budget":
        # B states, each the step start nearest the point that would cut the response into B equal segments
        chosen = [starts[0]]
        for b in range(1, n):
            later = [s for s in starts if s > chosen[-1]]
            if later:
                chosen.append(min(later, key=lambda s: abs(s - starts[0] - b * (n_tokens - starts[0]) / n)))
        return sorted(set(chosen))
    # tokens:N: a step start at least N tokens after the previous state; where no step starts for 2N tokens
    # (a long step), a state every N tokens inside it, so no segment grows without bound
    chosen = [starts[0]]
    for s in starts[1:] + [n_tokens]:
        while s - chosen[-1] >= 2 * n:
            chosen.append(chosen[-1] + n)
        if s - chosen[-1] >= n and s < n_tokens:
            chosen.append(s)
    return chosen


def entropy_starts(starts: list[int], m: int, entropies: list[float] | None) -> list[int]:
    """The first step start (the prompt's state: every response's baseline) and the `m` later step starts where the
    sampling policy was least sure of its next token (highest entropy; the earlier on ties), in order: branch where
    a continuation can go another way, not where the next step is all but decided."""
    if entropies is None:
        raise ValueError("--mc-states entropy:M needs the sampler's per-token entropies (the native engine's "
                         "SamplingParams(entropy=True))")
    later = sorted(starts[1:], key=lambda s: (-entropies[s], s))[:m]
    return [starts[0]] + sorted(later)


def find_states(episodes: list[Episode], mode: str, cap: int) -> States:
    """Each episode's segment starts (`mode`: --mc-states) and, of the first `cap`, the distinct prefixes.

    A state is a token prefix of one example: the prompt is shared by all responses to it, and responses often share
    their first steps, so each distinct prefix is one State (its first holder's) whose value every holder reads. The
    example is part of the state: an environment's hidden state (a row's secret) is not in the tokens."""
    cuts, keys, unique = [], [], {}
    for i, ep in enumerate(episodes):
        cuts.append(state_offsets(ep.steps, len(ep.response_ids), mode, ep.entropies))
        keys.append({s: (ep.example.id, tuple(ep.prompt_ids), tuple(ep.response_ids[:s])) for s in cuts[-1][:cap]})
        for s, key in keys[-1].items():
            unique.setdefault(key, State(i, s))
    return States(cuts, keys, unique)


def monte_carlo(episodes: list[Episode], states: list[State], ctx: CreditContext) -> None:
    """Draw each state's continuations (K, or adaptive rounds) in one engine job, and score them into the states.

    A continuation from response offset b may add max_new_tokens - b tokens, the room the response itself had
    left, and is scored by the same rule (cut off: 0), as the whole decoded prefix + continuation."""
    owned: dict[int, list[State]] = {}  # one engine sequence per episode that holds states, its states in order
    for st in states:
        owned.setdefault(st.episode, []).append(st)
    owners = list(owned)

    def scored(q: int, j: int, samples: list[Sample]) -> list[float | None]:  # new samples scored, once each
        st = owned[owners[q]][j]
        ep = episodes[st.episode]
        st.rewards += continuation_rewards(ctx.score, ctx.tokenizer, ep.response_ids[:st.offset],
                                           samples[len(st.rewards):], ep.example)
        return st.rewards

    adaptive = 0 < ctx.mc_k_min < ctx.mc_k
    more = (lambda q, j, samples: next_round(known(scored(q, j, samples)), ctx.mc_k, ctx.mc_k_min, ctx.mc_rule)) \
        if adaptive else None
    eps = [episodes[i] for i in owners]
    dialogues = any(ep.dialogue is not None for ep in eps)  # a dialogue resumes from its record at a turn
    records = [ep.dialogue.record if ep.dialogue is not None else None for ep in eps] if dialogues else None
    out = ctx.rollouts.continuations(Request(
        [ep.prompt_ids + ep.response_ids for ep in eps],
        [[len(ep.prompt_ids) + st.offset for st in owned[i]] for ep, i in zip(eps, owners)],
        ctx.mc_k_min if adaptive else ctx.mc_k, ctx.params, ctx.generator, ctx.progress,
        [[room(ep, st.offset, ctx.params.max_new_tokens) for st in owned[i]] for ep, i in zip(eps, owners)], more,
        records))
    for q, per_state in enumerate(out):
        for j, samples in enumerate(per_state):
            scored(q, j, samples)
            owned[owners[q]][j].samples = samples


def room(ep: Episode, offset: int, max_new_tokens: int) -> int:
    """New tokens a continuation from response offset `offset` may add: what the response had left (a dialogue's
    turns each have max_new_tokens of their own: its engine keeps the dialogue's total)."""
    return max_new_tokens if ep.dialogue is not None else max_new_tokens - offset


def step_credit(episodes: list[Episode], states: States, value: dict[StateKey, float],
                gamma: float) -> tuple[list[torch.Tensor], list[float]]:
    """Per-token advantages A = r + V(s_next) - V(s) per segment, the tokens between two states sharing one, and
    every state value used; a segment start past the cap (no state) takes V = the episode's reward."""
    advantages, used = [], []
    for ep, key, cut in zip(episodes, states.keys, states.cuts):
        vals = [value[key[s]] if s in key else ep.reward for s in cut]
        advantages.append(segment_advantages(len(ep.response_ids), cut, vals, ep.reward, gamma))
        used.extend(vals)
    return advantages, used


def leave_one_out(rewards: list[float | None], i: int) -> float | None:
    """rewards[i] minus the mean of the other rewards that exist; None when either is missing."""
    others = known(rewards[:i] + rewards[i + 1:])
    return None if rewards[i] is None or not others else rewards[i] - sum(others) / len(others)


def trained_continuations(episodes: list[Episode], states: list[State],
                          fraction: float) -> tuple[list[Episode], list[torch.Tensor]]:
    """The first round(fraction x n) continuations of each state as episodes (tree rollouts): the state's prefix is
    their prompt, and every token gets the continuation's leave-one-out advantage against all its siblings, an
    unbiased baseline. A continuation without a reward, or without a sibling that has one, trains not."""
    extra, advantages = [], []
    for st in states:
        ep = episodes[st.episode]
        for i, s in enumerate(st.samples[: round(fraction * len(st.samples))]):
            a = leave_one_out(st.rewards, i)
            if a is None:
                continue
            extra.append(Episode(ep.prompt_ids + ep.response_ids[:st.offset], list(s.token_ids), s.text,
                                 st.rewards[i], ep.group, ep.example, [(0, len(s.token_ids))],
                                 s.finish_reason != "stop", list(s.logprobs), dialogue=s.dialogue))
            advantages.append(torch.full((len(s.token_ids),), float(a)))
    return extra, advantages


@register("vine", Needs(rollouts=True))
def vine(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """VinePPO: V(s) = mean reward of K continuations from each state; A = r + V(s_next) - V(s) per segment.

    The states are the step starts (or the subset `ctx.mc_states` picks), at most mc_max_states per response;
    the tokens between two states share one advantage. Steps that start at the same token (empty steps) share
    one state, and so do equal prefixes of different responses: each is estimated once. States past the cap take
    V = the reward. With ctx.mc_k_min < mc_k, continuations come in rounds and a state stops once `settled`
    (ctx.mc_rule). With ctx.mc_train_fraction > 0 the continuations train too (`trained_continuations`).
    """
    states = find_states(episodes, ctx.mc_states, ctx.mc_max_states)
    unique = list(states.unique.values())
    monte_carlo(episodes, unique, ctx)
    value = {key: st.value(fallback=episodes[st.episode].reward) for key, st in states.unique.items()}
    advantages, used = step_credit(episodes, states, value, ctx.gamma)
    extra, extra_adv = trained_continuations(episodes, unique, ctx.mc_train_fraction)
    v = torch.tensor(used) if used else torch.zeros(1)
    stats = {"mc/states": float(len(unique)), "mc/states_shared": float(sum(map(len, states.keys))),
             "mc/mixed_states": float(sum(len(set(known(st.rewards))) > 1 for st in unique)),  # values not decided
             "mc/continuations": float(sum(len(st.samples) for st in unique)),
             "mc/tokens": float(sum(len(s.token_ids) for st in unique for s in st.samples)),
             "value/mean": float(v.mean()), "value/std": float(v.std()) if len(v) > 1 else 0.0}
    stats.update(agents.counts((s for st in unique for s in st.samples), "mc/"))  # dialogues: their turns, calls
    if ctx.mc_train_fraction > 0:
        stats.update({"mc/trained": float(len(extra)), "mc/trained_tokens": float(sum(len(e.response_ids)
                                                                                       for e in extra))})
    return Credit(advantages + extra_adv, stats=stats, extra=extra)


# ------------------------------------------------------------------------------------ adaptive K


def settled(wins: list[float], rule: str, k_min: int) -> bool:
    """True when a state's outcomes so far fix its value: `agree` (all k_min+ equal) or `ci:W` (Wilson half-width <= W)."""
    if len(wins) < k_min:
        return False
    if rule == "agree":
        return min(wins) == max(wins)
    return wilson_half_width(sum(wins) / len(wins), len(wins)) <= float(rule.split(":", 1)[1])


def wilson_half_width(p: float, n: int, z: float = 1.96) -> float:
    """Half the width of the 95% Wilson interval of a Bernoulli mean p from n outcomes (finite at p = 0 or 1)."""
    return z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)


def next_round(wins: list[float], k_max: int, k_min: int, rule: str) -> int:
    """Continuations to add to a state: 0 once settled or at k_max; else the rest at once (agree) or k_min more (ci)."""
    n = len(wins)
    if n >= k_max or settled(wins, rule, k_min):
        return 0
    if n < k_min:
        return k_min - n
    # Outcomes that disagree can never all agree again: under `agree` a state that is not settled needs all of K.
    return k_max - n if rule == "agree" else min(k_min, k_max - n)
