"""Credit assignment: every advantage estimator is a small function registered by name, with one signature.

    @register("name", Needs(rollouts=True))
    def estimator(episodes: list[Episode], ctx: CreditContext) -> Credit

An estimator returns one advantage per response token for every episode (and, when it trains a
critic, the value targets). It declares what it needs besides the episodes (`Needs`: a critic, the rollout
engine); the trainer reads the declaration and never branches on a name. Adding a method is adding an entry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vineppo import distributed as dist
from vineppo.config import TrainConfig
from vineppo.engine import Request, SamplingParams
from vineppo.errors import UserError
from vineppo.grading import Scorer, continuation_rewards
from vineppo.tasks import Example

_DEFAULTS = TrainConfig()  # CreditContext's defaults: a run's own settings


@dataclass
class Episode:
    """One sampled response and everything credit assignment needs to know about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str  # decoded response
    reward: float  # the task's reward (built-in tasks: 1.0 correct, 0.0 wrong or truncated)
    group: int  # index of its prompt in the batch: responses to one prompt form a group
    example: Example  # the problem it answers: Monte Carlo continuations are scored against it (Task.score)
    steps: list[tuple[int, int]]  # token ranges [start, end) of the reasoning steps in response_ids
    truncated: bool = False
    logprobs: list[float] | None = None  # the engine's log-probs of response_ids when sampled (see Sample.logprobs)


@dataclass
class Credit:
    """What an estimator gives back: per-token advantages, optional critic targets, and statistics."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None  # value targets per token (critic-based estimators only)
    values: list[torch.Tensor] | None = None  # the critic's values when the episodes were scored
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class CreditContext:
    """The tools an estimator may use (the rollout engine for Monte Carlo, the task grader, the critic) and its
    settings, whose defaults are TrainConfig's (`config.section` reads a run's values by name)."""

    rollouts: Any = None  # the rollout engine (an object; TrainConfig.engine is the backend's name)
    tokenizer: Any = None
    score: Scorer | None = None  # the task's rewards of a batch of completions (Task.score)
    critic: Any = None  # vineppo.ppo.Critic for `gae`
    params: SamplingParams | None = None  # sampling settings for Monte Carlo continuations
    generator: torch.Generator | None = None
    mc_k: int = _DEFAULTS.mc_k  # continuations per state
    mc_max_states: int = _DEFAULTS.mc_max_states  # states estimated per response; later ones take V = the reward
    mc_k_min: int = _DEFAULTS.mc_k_min  # adaptive K: first round per state (0, or >= mc_k: a fixed mc_k per state)
    mc_rule: str = _DEFAULTS.mc_rule  # adaptive K: when a state is settled (`settled`)
    mc_states: str = _DEFAULTS.mc_states  # which step starts are states (`state_offsets`)
    gamma: float = _DEFAULTS.gamma
    gae_lambda: float = _DEFAULTS.gae_lambda  # GAE lambda for critic-based estimators
    scale_rewards: str = _DEFAULTS.scale_rewards  # GRPO: what divides the group-centred reward (REWARD_SCALES)
    progress: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Needs:
    """What an estimator uses besides the episodes; the trainer builds it only for estimators that declare it."""

    critic: bool = False  # a learned value network (CreditContext.critic), trained beside the policy
    rollouts: bool = False  # the rollout engine (CreditContext.rollouts), for Monte Carlo continuations


Estimator = Callable[[list[Episode], CreditContext], Credit]
ESTIMATORS: dict[str, Estimator] = {}
NEEDS: dict[str, Needs] = {"none": Needs()}  # "none": the algorithm assigns no per-token credit (RestEM, DPO+)


def register(name: str, needs: Needs = Needs()) -> Callable[[Estimator], Estimator]:
    """Decorator: add an estimator to the registry under `name`, with what it needs."""

    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[name], NEEDS[name] = fn, needs
        return fn

    return add


def needs(name: str) -> Needs:
    """What the estimator registered as `name` (or "none") needs."""
    if name not in NEEDS:
        raise UserError(f"unknown credit estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return NEEDS[name]


def get_estimator(name: str) -> Estimator:
    """The estimator registered as `name`."""
    if name not in ESTIMATORS:
        raise UserError(f"unknown credit estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


def _per_response(episodes: list[Episode], scores: list[float]) -> list[torch.Tensor]:
    """Every token of a response gets its response's score."""
    return [torch.full((len(ep.response_ids),), float(s)) for ep, s in zip(episodes, scores)]


def groups(episodes: list[Episode]) -> dict[int, list[int]]:
    """Episode indices by prompt (responses to one prompt form a group)."""
    out: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        out.setdefault(ep.group, []).append(i)
    return out


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
    return Credit(_per_response(episodes, scores))


@register("rloo")
def rloo(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """RLOO: r minus the mean reward of the other responses to the same prompt."""
    scores = [0.0] * len(episodes)
    for members in groups(episodes).values():
        total, n = sum(episodes[i].reward for i in members), len(members)
        for i in members:
            scores[i] = episodes[i].reward - (total - episodes[i].reward) / (n - 1) if n > 1 else 0.0
    return Credit(_per_response(episodes, scores))


def step_advantages(values: list[float], reward: float, gamma: float = 1.0) -> list[float]:
    """A_t = r_t + gamma V(s_{t+1}) - V(s_t) per step, with V(s_T) = 0 and the reward on the last step."""
    nxt = values[1:] + [0.0]
    rewards = [0.0] * (len(values) - 1) + [reward]
    return [r + gamma * v1 - v0 for r, v0, v1 in zip(rewards, values, nxt)]


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


# ------------------------------------------------------------------------------------ VinePPO


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


def state_offsets(steps: list[tuple[int, int]], n_tokens: int, mode: str) -> list[int]:
    """Response offsets whose values are estimated (`--mc-states`): all | every:N | tokens:N | budget:B."""
    starts = sorted({s for s, _ in steps if s < n_tokens})
    kind, _, arg = mode.partition(":")
    if kind == "all" or not starts:
        return starts
    n = int(arg)
    if kind == "every":
        return starts[::n]
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


def known(rewards: list[float | None]) -> list[float]:
    """The rewards that are numbers (a custom reward function may give None: no reward)."""
    return [r for r in rewards if r is not None]


def segment_advantages(n_tokens: int, offsets: list[int], values: list[float], reward: float,
                       gamma: float = 1.0) -> torch.Tensor:
    """Per-token advantages: the tokens from one estimated state to the next share that segment's advantage."""
    adv = torch.zeros(n_tokens)
    ends = offsets[1:] + [n_tokens]
    for s, e, a in zip(offsets, ends, step_advantages(values, reward, gamma)):
        adv[s:e] = a
    return adv


@register("vine", Needs(rollouts=True))
def vine(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """VinePPO: V(s) = mean reward of K continuations from each state; A = r + V(s_next) - V(s) per segment.

    The states are the step starts (or the subset `ctx.mc_states` picks), at most mc_max_states per response;
    the tokens between two states share one advantage. A state is a position in the response: steps that start
    at the same token (empty steps) share one state, estimated once. A continuation from response offset b may
    add max_new_tokens - b tokens, the room the response itself had left, and is graded by the same rule (cut
    off: 0). States past the cap take V = the reward. With ctx.mc_k_min < mc_k, continuations come in rounds
    and a state stops once `settled` (ctx.mc_rule); its unused continuations are never drawn.
    """
    # A state is a token prefix: the prompt is shared by all responses to it, and responses often share their
    # first steps, so each distinct prefix is estimated once (its first holder runs it) and its value shared.
    sequences, boundaries, budgets, owners, positions = [], [], [], [], []
    first: dict[tuple, tuple[int, int]] = {}  # state key -> (episode, response offset) of the one that runs it
    keys: list[dict[int, tuple]] = []  # per episode: response offset -> state key
    cuts: list[list[int]] = []  # per episode: the offsets where its segments start
    for i, ep in enumerate(episodes):
        cuts.append(state_offsets(ep.steps, len(ep.response_ids), ctx.mc_states))
        own = cuts[i][: ctx.mc_max_states]
        keys.append({s: (tuple(ep.prompt_ids), tuple(ep.response_ids[:s])) for s in own})
        pos = [s for s in own if first.setdefault(keys[i][s], (i, s)) == (i, s)]
        positions.append(pos)
        if pos:
            sequences.append(ep.prompt_ids + ep.response_ids)
            boundaries.append([len(ep.prompt_ids) + s for s in pos])
            budgets.append([ctx.params.max_new_tokens - s for s in pos])
            owners.append(i)
    wins: dict[tuple[int, int], list[float]] = {}  # (sequence, state) -> rewards of its continuations, graded once

    def graded(q: int, j: int, samples: list) -> list[float]:
        ep, done = episodes[owners[q]], wins.setdefault((q, j), [])
        prefix = ep.response_ids[: positions[owners[q]][j]]
        done += continuation_rewards(ctx.score, ctx.tokenizer, prefix, samples[len(done):], ep.example)
        return done

    adaptive = 0 < ctx.mc_k_min < ctx.mc_k
    more = (lambda q, j, samples: next_round(known(graded(q, j, samples)), ctx.mc_k, ctx.mc_k_min, ctx.mc_rule)) \
        if adaptive else None
    rollouts = ctx.rollouts.continuations(Request(sequences, boundaries, ctx.mc_k_min if adaptive else ctx.mc_k,
                                                  ctx.params, ctx.generator, ctx.progress, budgets, more))
    value_of: dict[tuple, float] = {}
    n_cont = n_tokens = 0
    for q, (i, per_state) in enumerate(zip(owners, rollouts)):
        for j, (start, samples) in enumerate(zip(positions[i], per_state)):
            w = known(graded(q, j, samples))  # a continuation without a reward tells nothing of the state's value
            value_of[keys[i][start]] = sum(w) / len(w) if w else episodes[i].reward
            n_cont += len(samples)
            n_tokens += sum(len(s.token_ids) for s in samples)
    advantages, all_values = [], []
    for ep, key, cut in zip(episodes, keys, cuts):
        vals = [value_of[key[s]] if s in key else ep.reward for s in cut]
        advantages.append(segment_advantages(len(ep.response_ids), cut, vals, ep.reward, ctx.gamma))
        all_values.extend(vals)
    v = torch.tensor(all_values) if all_values else torch.zeros(1)
    stats = {"mc/states": float(sum(len(b) for b in boundaries)), "mc/states_shared": float(sum(map(len, keys))),
             "mc/continuations": float(n_cont), "mc/tokens": float(n_tokens),
             "value/mean": float(v.mean()), "value/std": float(v.std()) if len(v) > 1 else 0.0}
    return Credit(advantages, stats=stats)


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
