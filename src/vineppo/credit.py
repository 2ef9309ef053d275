"""Credit assignment: every advantage estimator is a small function registered by name, with one signature.

    @register("name")
    def estimator(episodes: list[Episode], ctx: CreditContext) -> Credit

An estimator returns one advantage per response token for every episode (and, when it trains a
critic, the value targets). Adding a method is adding an entry here; the trainer never branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vineppo.engine import SamplingParams
from vineppo.grading import continuation_reward


@dataclass
class Episode:
    """One sampled response and everything credit assignment needs to know about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str  # decoded response
    reward: float  # 1.0 correct, 0.0 wrong or truncated
    group: int  # index of its prompt in the batch: responses to one prompt form a group
    answer: str  # reference answer, for grading Monte Carlo continuations
    steps: list[tuple[int, int]]  # token ranges [start, end) of the reasoning steps in response_ids
    truncated: bool = False


@dataclass
class Credit:
    """What an estimator gives back: per-token advantages, optional critic targets, and statistics."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None  # value targets per token (critic-based estimators only)
    values: list[torch.Tensor] | None = None  # the critic's values when the episodes were scored
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class CreditContext:
    """The tools an estimator may use: the engine (Monte Carlo), the task grader, the critic, settings."""

    engine: Any = None
    tokenizer: Any = None
    grade: Callable[[str, str], float] | None = None
    critic: Any = None  # vineppo.ppo.Critic for `gae`
    params: SamplingParams | None = None  # sampling settings for Monte Carlo continuations
    generator: torch.Generator | None = None
    mc_k: int = 9  # continuations per state
    mc_max_states: int = 25  # states estimated per response; later states take V = the response's reward
    gamma: float = 1.0
    lam: float = 1.0  # GAE lambda for critic-based estimators
    progress: Callable[[int], None] | None = None


Estimator = Callable[[list[Episode], CreditContext], Credit]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: add an estimator to the registry under `name`."""

    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn

    return add


def get_estimator(name: str) -> Estimator:
    """The estimator registered as `name`."""
    from vineppo.errors import UserError

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


@register("grpo")
def grpo(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """GRPO: (r - mean of its group) / std of its group, the same for every token of a response."""
    scores = [0.0] * len(episodes)
    for members in groups(episodes).values():
        r = torch.tensor([episodes[i].reward for i in members])
        std = r.std() if len(members) > 1 else torch.tensor(0.0)
        for i, a in zip(members, (r - r.mean()) / (std + 1e-6)):
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


@register("vine")
def vine(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """VinePPO: V(s_t) = mean reward of K continuations from each step boundary; A_t = r_t + V(s_{t+1}) - V(s_t).

    A state is a position in the response: steps that start at the same token (empty steps) share one state,
    estimated once. A continuation from response offset b may add max_new_tokens - b tokens, the room the
    response itself had left, and is graded by the same rule (cut off: 0). The response's end is no state to
    sample from: a step starting there (an empty last step), like a state past the cap, takes V = the reward.
    """
    # A state is a token prefix: the prompt is shared by all responses to it, and responses often share their
    # first steps, so each distinct prefix is estimated once (its first holder runs it) and its value shared.
    sequences, boundaries, budgets, owners, positions = [], [], [], [], []
    first: dict[tuple, tuple[int, int]] = {}  # state key -> (episode, response offset) of the one that runs it
    keys: list[dict[int, tuple]] = []  # per episode: response offset -> state key
    for i, ep in enumerate(episodes):
        own = sorted({s for s, _ in ep.steps if s < len(ep.response_ids)})[: ctx.mc_max_states]
        keys.append({s: (tuple(ep.prompt_ids), tuple(ep.response_ids[:s])) for s in own})
        pos = [s for s in own if first.setdefault(keys[i][s], (i, s)) == (i, s)]
        positions.append(pos)
        if pos:
            sequences.append(ep.prompt_ids + ep.response_ids)
            boundaries.append([len(ep.prompt_ids) + s for s in pos])
            budgets.append([ctx.params.max_new_tokens - s for s in pos])
            owners.append(i)
    rollouts = ctx.engine.continuations(sequences, boundaries, ctx.mc_k, ctx.params, ctx.generator, ctx.progress,
                                        budgets=budgets)
    value_of: dict[tuple, float] = {}
    n_cont = n_tokens = 0
    for i, per_state in zip(owners, rollouts):
        ep = episodes[i]
        for start, samples in zip(positions[i], per_state):
            prefix = ep.response_ids[:start]
            wins = [continuation_reward(ctx.grade, ctx.tokenizer, prefix, s, ep.answer) for s in samples]
            value_of[keys[i][start]] = sum(wins) / len(wins)
            n_cont += len(samples)
            n_tokens += sum(len(s.token_ids) for s in samples)
    value_at = [{s: value_of[key] for s, key in k.items()} for k in keys]  # response offset -> V
    advantages, all_values = [], []
    for ep, at in zip(episodes, value_at):
        vals = [at.get(s, ep.reward) for s, _ in ep.steps]
        adv = torch.zeros(len(ep.response_ids))
        for (s, e), a in zip(ep.steps, step_advantages(vals, ep.reward, ctx.gamma)):
            adv[s:e] = a
        advantages.append(adv)
        all_values.extend(vals)
    v = torch.tensor(all_values) if all_values else torch.zeros(1)
    stats = {"mc/states": float(sum(len(b) for b in boundaries)), "mc/states_shared": float(sum(map(len, keys))),
             "mc/continuations": float(n_cont),
             "mc/tokens": float(n_tokens), "value/mean": float(v.mean()), "value/std": float(v.std()) if len(v) > 1 else 0.0}
    return Credit(advantages, stats=stats)


@register("gae")
def critic_gae(episodes: list[Episode], ctx: CreditContext) -> Credit:
    """PPO: a learned critic scores every response token; advantages by GAE(gamma, lambda)."""
    values = ctx.critic.values([ep.prompt_ids for ep in episodes], [ep.response_ids for ep in episodes])
    advantages, returns = [], []
    for ep, v in zip(episodes, values):
        rewards = torch.zeros_like(v)
        rewards[-1] = ep.reward
        adv = gae(v, rewards, ctx.gamma, ctx.lam)
        advantages.append(adv)
        returns.append(adv + v)
    flat = torch.cat(values)
    return Credit(advantages, returns=returns, values=values,
                  stats={"value/mean": float(flat.mean()), "value/std": float(flat.std()) if len(flat) > 1 else 0.0})
