"""What every credit estimator shares: the episodes it reads, the credit it returns, the context it may use, the
registry, and the arithmetic of per-step advantages.

    @register("name", Needs(rollouts=True))
    def estimator(episodes: list[Episode], ctx: CreditContext) -> Credit

An estimator returns one advantage per response token for every episode (and, when it trains a critic, the value
targets; when it trains on further samples, those episodes). It declares what it needs besides the episodes
(`Needs`: a critic, the rollout engine); the trainer reads the declaration and never branches on a name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError
from vineppo.core.grading import Scorer
from vineppo.engine import SamplingParams
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
    entropies: list[float] | None = None  # the sampler's entropy at each token, when asked for (--mc-states entropy:M)
    dialogue: Any = None  # a dialogue's turns (vineppo.agents.Turns: its policy-token mask, what resumes it); None: one turn

    @property
    def mask(self) -> list[int] | None:
        """1 on the policy's tokens, 0 on those a tool or the environment inserted (None: every token the policy's)."""
        return self.dialogue.mask if self.dialogue is not None else None


@dataclass
class Credit:
    """What an estimator gives back: per-token advantages, optional critic targets, and statistics."""

    advantages: list[torch.Tensor]  # one per episode, then one per `extra` episode
    returns: list[torch.Tensor] | None = None  # value targets per token (critic-based estimators only)
    values: list[torch.Tensor] | None = None  # the critic's values when the episodes were scored
    stats: dict[str, float] = field(default_factory=dict)
    extra: list[Episode] = field(default_factory=list)  # further samples the update trains on (tree rollouts)


@dataclass
class CreditContext:
    """The tools an estimator may use (the rollout engine for Monte Carlo, the task grader, the critic) and its
    settings, whose defaults are TrainConfig's (`config.section` reads a run's values by name)."""

    rollouts: Any = None  # the rollout engine (an object; TrainConfig.engine is the backend's name)
    tokenizer: Any = None
    score: Scorer | None = None  # the task's rewards of a batch of completions (Task.score)
    critic: Any = None  # vineppo.training.ppo.Critic for `gae`
    params: SamplingParams | None = None  # sampling settings for Monte Carlo continuations
    generator: torch.Generator | None = None
    mc_k: int = _DEFAULTS.mc_k  # continuations per state
    mc_max_states: int = _DEFAULTS.mc_max_states  # states estimated per response; later ones take V = the reward
    mc_k_min: int = _DEFAULTS.mc_k_min  # adaptive K: first round per state (0, or >= mc_k: a fixed mc_k per state)
    mc_rule: str = _DEFAULTS.mc_rule  # adaptive K: when a state is settled (`settled`)
    mc_states: str = _DEFAULTS.mc_states  # which step starts are states (`state_offsets`)
    mc_train_fraction: float = _DEFAULTS.mc_train_fraction  # share of each state's continuations that train too
    gamma: float = _DEFAULTS.gamma
    gae_lambda: float = _DEFAULTS.gae_lambda  # GAE lambda for critic-based estimators
    scale_rewards: str = _DEFAULTS.scale_rewards  # GRPO: what divides the group-centred reward (REWARD_SCALES)
    progress: Callable[[int, int], None] | None = None  # the continuations' engine.api.Progress


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


def per_response(episodes: list[Episode], scores: list[float]) -> list[torch.Tensor]:
    """Every token of a response gets its response's score."""
    return [torch.full((len(ep.response_ids),), float(s)) for ep, s in zip(episodes, scores)]


def groups(episodes: list[Episode]) -> dict[int, list[int]]:
    """Episode indices by prompt (responses to one prompt form a group)."""
    out: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        out.setdefault(ep.group, []).append(i)
    return out




def flat_groups(episodes: list[Episode]) -> tuple[int, int]:
    """(groups whose responses all got the same reward, groups): a flat group gives GRPO and RLOO no signal at all."""
    rewards = [{episodes[i].reward for i in members} for members in groups(episodes).values()]
    return sum(len(r) == 1 for r in rewards), len(rewards)


def nonzero_tokens(advantages: list[torch.Tensor], episodes: list[Episode],
                   normalised: list[torch.Tensor] | None = None) -> tuple[int, int, int]:
    """(the policy's tokens whose advantage is not 0, those whose advantage was 0 and is not in `normalised`, the
    policy's tokens) of `episodes` and their advantages."""
    nonzero = shifted = total = 0
    for k, (a, ep) in enumerate(zip(advantages, episodes)):
        policy = torch.ones(len(a), dtype=torch.bool) if ep.mask is None else torch.tensor(ep.mask, dtype=torch.bool)
        nonzero += int(((a != 0) & policy).sum())
        if normalised is not None:
            shifted += int(((a == 0) & (normalised[k] != 0) & policy).sum())
        total += int(policy.sum())
    return nonzero, shifted, total


def step_advantages(values: list[float], reward: float, gamma: float = 1.0) -> list[float]:
    """A_t = r_t + gamma V(s_{t+1}) - V(s_t) per step, with V(s_T) = 0 and the reward on the last step."""
    nxt = values[1:] + [0.0]
    rewards = [0.0] * (len(values) - 1) + [reward]
    return [r + gamma * v1 - v0 for r, v0, v1 in zip(rewards, values, nxt)]


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


# ------------------------------------------------------------------------------------ normalisation


def token_mean_std(values: list[torch.Tensor], nonzero: bool = False) -> tuple[float, float]:
    """Mean and (population) standard deviation of all elements over every rank (`nonzero`: of those not 0)."""
    flat = torch.cat(values).double() if values else torch.zeros(0, dtype=torch.float64)
    if nonzero:
        flat = flat[flat != 0]
    n, s, ss = dist.all_sum([float(flat.numel()), float(flat.sum()), float((flat**2).sum())])
    mean = s / max(n, 1)
    return mean, math.sqrt(max(ss / max(n, 1) - mean**2, 0.0))


def normalise(advantages: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """The advantages over every rank's tokens as `--advantage-norm` says: `whiten` (shift to mean 0, scale to std 1;
    the paper's), `scale` (divided by the std of the non-zero ones, no shift: an advantage that is 0 by construction,
    a step whose value did not change or a group of equal rewards, stays 0), `none` (as they are)."""
    if mode == "whiten":
        mean, std = token_mean_std(advantages)
        return [((a - mean) / (std + 1e-8)).float() for a in advantages]
    if mode == "scale":
        _, std = token_mean_std(advantages, nonzero=True)
        return [(a / std).float() if std > 1e-6 else a.float() for a in advantages]  # one value: nothing to scale by
    if mode == "none":
        return advantages
    raise ValueError(f"unknown advantage normalisation {mode!r}; known: whiten, scale, none")
