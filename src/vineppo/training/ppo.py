"""The PPO update every PPO-family algorithm ends in, and the minibatch driver every update goes through.

Read `ppo_update` top to bottom: the old and the reference log-probs before any step, then `drive`: epochs of shuffled
minibatches over every rank's episodes, each micro-batch packed once (`prepare`) and handed to the policy's clipped
loss and, where there is a critic, to its clipped value loss; one clipped optimiser step per minibatch. Two small
registries shape the policy loss: LOSS_AGGS (how a minibatch's per-token losses are averaged, `--loss-agg`) and
KL_ESTIMATORS (the per-token estimate of the KL to the reference, `--kl-estimator`). RestEM's and DPO+'s losses go
through the same `drive`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from vineppo.core import distributed as dist
from vineppo.models import parallel
from vineppo.training.forward import Critic, Packed, can_share, pack, pad_rows, pad_values, token_logprobs

# ------------------------------------------------------------------------------------ the policy loss

# A KL estimator: per-token estimate of KL(policy || reference) from d = ref_logp - logp on the policy's samples
# (Schulman, "Approximating KL divergence", 2020). k1 is unbiased but can be negative, k2 and k3 are not negative.
KLEstimator = Callable[[torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.exp(d) - d - 1,
}

# A loss aggregation: (a response's length, max_new_tokens) -> (its weight in its minibatch's denominator, the
# weight of each of its tokens). The minibatch's loss is sum(token weight * token loss) / sum(episode weights), so
# token-mean is the mean over the minibatch's tokens and the two seq-mean modes are means over its responses.
LossAgg = Callable[[int, int], tuple[float, float]]


def token_mean(length: int, max_new_tokens: int) -> tuple[float, float]:
    """Every token of the minibatch weighs alike (DAPO; TRL's default `dapo`): long responses weigh more."""
    return float(length), 1.0


def seq_mean_token_mean(length: int, max_new_tokens: int) -> tuple[float, float]:
    """Each response's mean token loss, averaged over responses (GRPO's original): a token of a short response
    weighs more than one of a long response."""
    return 1.0, 1.0 / max(length, 1)


def seq_mean_token_sum_norm(length: int, max_new_tokens: int) -> tuple[float, float]:
    """Each response's summed token loss over the constant max_new_tokens, averaged over responses (Dr. GRPO):
    every token weighs alike, whatever the minibatch's length."""
    return 1.0, 1.0 / max_new_tokens


LOSS_AGGS: dict[str, LossAgg] = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                                 "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


@dataclass
class Surrogate:
    """The policy loss's settings: the ratio clip [1 - clip, 1 + clip_high], the KL penalty's weight and estimator."""

    clip: float = 0.2
    kl_coef: float = 0.0
    clip_high: float | None = None  # None: clip
    kl_estimator: str = "k3"


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
                weights: torch.Tensor, terms: Surrogate) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate plus kl_coef * KL estimate to the reference (none without `ref_logp`), summed over the
    tokens with their `weights` (the response mask times the loss aggregation's token weights): the caller divides
    by the minibatch's denominator. Statistics are counts over the tokens of nonzero weight."""
    high = terms.clip if terms.clip_high is None else terms.clip_high
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - terms.clip, 1 + high) * advantages)
    per_token = -surrogate
    if ref_logp is not None:
        kl = KL_ESTIMATORS[terms.kl_estimator](ref_logp - logp)
        per_token = per_token + terms.kl_coef * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        live, up = (weights != 0).float(), ratio - 1
        above = ((up > high).float() * live).sum()
        stats = {"clipped": float(((-up > terms.clip).float() * live).sum() + above), "clipped_high": float(above)}
        if ref_logp is not None:
            stats["kl"] = float((kl * live).sum())
    return loss, stats


def loss_weights(data: "Rollouts", loss_agg: str, max_new_tokens: int,
                 mask_truncated: bool) -> tuple[list[float], list[float]]:
    """Per episode: its weight in its minibatch's loss denominator and the weight of each of its tokens
    (`--loss-agg`); with `mask_truncated`, truncated episodes weigh 0 in both (left out of the loss)."""
    agg = LOSS_AGGS[loss_agg]
    truncated = data.truncated or [False] * len(data.responses)
    lengths = [data.policy_tokens(i) for i in range(len(data.responses))]
    pairs = [(0.0, 0.0) if mask_truncated and cut else agg(n, max_new_tokens) for n, cut in zip(lengths, truncated)]
    return [w for w, _ in pairs], [t for _, t in pairs]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, n_tokens: float) -> torch.Tensor:
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), summed over masked tokens / n_tokens."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (err * mask).sum() / n_tokens


@dataclass
class UpdateConfig:
    """The knobs of one PPO update (a view of TrainConfig)."""

    epochs: int
    minibatch: int  # episodes per optimiser step, over all ranks
    micro_batch: int  # episodes per forward/backward on one rank
    clip: float
    kl_coef: float
    temperature: float
    grad_clip: float
    value_clip: float
    dtype: str = "float32"  # float32 | bfloat16 (autocast; see vineppo.models.parallel)
    micro_batch_tokens: int = 0  # > 0: micro-batches cut by padded tokens instead of `micro_batch` episodes
    clip_high: float | None = None  # upper ratio clip (None: clip)
    kl_estimator: str = "k3"  # KL_ESTIMATORS
    loss_agg: str = "token-mean"  # LOSS_AGGS
    max_new_tokens: int = 1024  # the length cap: Dr. GRPO's constant normaliser
    mask_truncated: bool = False  # truncated episodes are left out of the loss

    def surrogate(self) -> Surrogate:
        """The policy loss's settings."""
        return Surrogate(self.clip, self.kl_coef, self.clip_high, self.kl_estimator)


@dataclass
class Rollouts:
    """One update's episodes (this rank's share), as lists indexed alike."""

    prompts: list[list[int]]
    responses: list[list[int]]
    advantages: list[torch.Tensor]  # per response token
    pad_id: int
    returns: list[torch.Tensor] | None = None  # critic targets per token (PPO)
    old_values: list[torch.Tensor] | None = None  # the critic's values when the episodes were scored (PPO)
    old_logprobs: list[torch.Tensor] | None = None  # the sampler's log-probs of the responses (None: recomputed)
    ids: list[int] | None = None  # the episodes' global indices 0..N-1 over all ranks (None: this rank holds all)
    truncated: list[bool] | None = None  # cut at the length cap (None: none); --mask-truncated leaves them out
    masks: list[list[int] | None] | None = None  # per response, 0 on tokens a tool or environment inserted (None: none)

    def mask(self, i: int) -> list[int] | None:
        """Response i's policy-token mask (None: every token the policy's)."""
        return self.masks[i] if self.masks is not None else None

    def policy_tokens(self, i: int) -> int:
        """How many of response i's tokens the policy wrote (what the loss counts)."""
        mask = self.mask(i)
        return len(self.responses[i]) if mask is None else int(sum(mask))


@dataclass
class Learner:
    """What an update trains: the policy and its optimiser, the frozen KL reference, an optional critic."""

    policy: nn.Module
    reference: nn.Module | None  # None: no KL term (a run at --kl-coef 0 builds no reference)
    optimizer: torch.optim.Optimizer
    critic: Critic | None = None
    critic_optimizer: torch.optim.Optimizer | None = None


@dataclass
class MicroBatch:
    """One micro-batch as both losses read it, packed once: its episodes and their old and reference log-probs."""

    idx: list[int]  # this rank's episodes in it
    packed: Packed  # prompts and responses, advantages and returns on the response columns
    old: torch.Tensor  # [B, R] log-probs before the update
    ref: torch.Tensor | None  # [B, R] the reference's (None: no KL)
    weights: torch.Tensor  # [B, R] each token's weight in the policy loss: the mask times the loss aggregation's


def ppo_update(nets: Learner, data: Rollouts, cfg: UpdateConfig, generator: torch.Generator) -> dict[str, float]:
    """`cfg.epochs` passes of clipped-PPO minibatch steps (`drive`) over this rank's episodes, the critic stepped
    beside the policy on the same micro-batches (`ppo_losses`); returns summed statistics.

    Old log-probs come from `data.old_logprobs` when the sampler gave them (the same weights and temperature: one
    forward pass fewer); `logprob_gap` then reports their largest difference from the trainer's own, measured
    before the first step.
    """
    steps, prepare, totals = ppo_losses(nets, data, cfg)
    weights, _ = loss_weights(data, cfg.loss_agg, cfg.max_new_tokens, cfg.mask_truncated)
    # Minibatches are drawn over the global episode ids, so their make-up does not depend on the rank count.
    ids = list(range(len(data.prompts))) if data.ids is None else data.ids
    schedule = Schedule(epochs=cfg.epochs, minibatch=cfg.minibatch, grad_clip=cfg.grad_clip, generator=generator,
                        split=lambda mb: micro_batches(mb, data.prompts, cfg.micro_batch, data.responses,
                                                       cfg.micro_batch_tokens), prepare=prepare)
    return drive(steps, schedule, ids, weights, totals)


def ppo_losses(nets: Learner, data: Rollouts, cfg: UpdateConfig) -> tuple[list[Net], Callable, dict[str, float]]:
    """The policy's clipped loss and the critic's value loss as Nets for `drive`, the `prepare` that packs each
    micro-batch once for both (with the log-probs before the update and the reference's), and the statistics'
    totals they add to. Each loss reads only the micro-batch it is handed."""
    device = next(nets.policy.parameters()).device
    share = can_share(nets.policy)
    old_logp, ref_logp = _before_update(nets, data, cfg, device, share and (nets.reference is None or
                                                                           can_share(nets.reference)))
    totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "entropy": 0.0, "tokens": 0.0, "value_loss": 0.0,
              "grad_norm": 0.0, "steps": 0.0, "logprob_gap": 0.0, "clipped_high": 0.0, "loss_weight": 0.0}
    if nets.reference is None:
        del totals["kl"]
    weights, token_w = loss_weights(data, cfg.loss_agg, cfg.max_new_tokens, cfg.mask_truncated)
    terms = cfg.surrogate()

    def prepare(idx: list[int]) -> MicroBatch:
        b = pack([data.prompts[i] for i in idx], [data.responses[i] for i in idx], data.pad_id,
                 [data.advantages[i] for i in idx], [data.returns[i] for i in idx] if data.returns else None, share,
                 [data.mask(i) for i in idx]).to(device)
        ref = pad_rows([ref_logp[i] for i in idx], b.mask.shape, device) if ref_logp is not None else None
        w = b.mask * torch.tensor([token_w[i] for i in idx] or [0.0], device=device)[:, None]
        return MicroBatch(idx, b, pad_rows([old_logp[i] for i in idx], b.mask.shape, device), ref, w)

    def policy_step(mb: MicroBatch, n_tok: float) -> tuple[torch.Tensor, dict[str, float]]:
        b = mb.packed
        with parallel.autocast(device, cfg.dtype):
            logp, entropy = token_logprobs(nets.policy, b, cfg.temperature)
        summed, stats = policy_loss(logp, mb.old, mb.ref, b.advantages, mb.weights, terms)
        loss = summed / max(n_tok, 1.0)  # 0 / 1 when --mask-truncated left every episode of the minibatch out
        if data.old_logprobs is not None and totals["steps"] == 0 and b.mask.any():  # still the sampler's weights
            totals["logprob_gap"] = max(totals["logprob_gap"], float(((logp.detach() - mb.old).abs() * b.mask).max()))
        return loss, {"loss": float(loss.detach()) * n_tok, **stats, "loss_weight": sum(weights[i] for i in mb.idx),
                      "entropy": float((entropy.detach() * b.mask).sum()), "tokens": float(b.mask.sum())}

    def critic_step(mb: MicroBatch, n_tok: float) -> tuple[torch.Tensor, dict[str, float]]:
        b = mb.packed
        with parallel.autocast(device, cfg.dtype):
            v = nets.critic(b)
        old_v = pad_values([data.old_values[i] for i in mb.idx], b.mask, device)
        loss = value_loss(v, old_v, b.returns, b.mask, cfg.value_clip, n_tok)
        return loss, {"value_loss": float(loss.detach()) * n_tok}

    steps = [Net(nets.policy, nets.optimizer, policy_step)]
    if nets.critic is not None:  # the value loss is a mean over the minibatch's tokens, whatever --loss-agg
        steps.append(Net(nets.critic, nets.critic_optimizer, critic_step, [float(len(r)) for r in data.responses]))
    return steps, prepare, totals


def _before_update(nets: Learner, data: Rollouts, cfg: UpdateConfig, device: torch.device,
                   share: bool) -> tuple[dict, dict | None]:
    """Per-episode log-probs under the policy before the update (unless the sampler gave them) and the reference
    (None without one)."""
    given = data.old_logprobs is not None
    old_logp = {i: lp.to(device) for i, lp in enumerate(data.old_logprobs)} if given else {}
    ref_logp = {} if nets.reference is not None else None
    if given and ref_logp is None:
        return old_logp, None
    with torch.no_grad(), parallel.autocast(device, cfg.dtype):
        for idx in micro_batches(list(range(len(data.prompts))), data.prompts, cfg.micro_batch, data.responses,
                                 cfg.micro_batch_tokens):
            b = pack([data.prompts[i] for i in idx], [data.responses[i] for i in idx], data.pad_id,
                     share=share, masks=[data.mask(i) for i in idx]).to(device)
            if not given:
                old, _ = token_logprobs(nets.policy, b, cfg.temperature)
                old_logp.update((i, old[j]) for j, i in enumerate(idx))
            if ref_logp is not None:
                ref, _ = token_logprobs(nets.reference, b, cfg.temperature)
                ref_logp.update((i, ref[j]) for j, i in enumerate(idx))
    return old_logp, ref_logp


def micro_batches(indices: list[int], prompts: list[list[int]], size: int, responses: list[list[int]] | None = None,
                  tokens: int = 0) -> list[list[int]]:
    """`indices` ordered by prompt length, then prompt, cut into micro-batches of `size`, `aligned` over ranks; with
    `tokens` (and `responses`), ordered by response length within a prompt too and cut where rows x (longest
    prompt + longest response) would pass `tokens`: on a GPU, few large passes of little padding.

    The order means less padding, and a prompt's responses share micro-batches (its prompt is encoded once);
    a minibatch's gradient is the sum over its micro-batches, whatever their make-up."""
    if not tokens:
        ordered = sorted(indices, key=lambda i: (len(prompts[i]), prompts[i]))
        return aligned([ordered[i:i + size] for i in range(0, len(ordered), max(1, size))])
    ordered = sorted(indices, key=lambda i: (len(prompts[i]), prompts[i], len(responses[i])))
    batches, cur, P, R = [], [], 0, 0
    for i in ordered:
        p, r = max(P, len(prompts[i])), max(R, len(responses[i]))
        if cur and (len(cur) + 1) * (p + r) > tokens:
            batches.append(cur)
            cur, p, r = [], len(prompts[i]), len(responses[i])
        cur.append(i)
        P, R = p, r
    return aligned(batches + ([cur] if cur else []))


# ------------------------------------------------------------------------------------ the minibatch driver

# A loss: (a micro-batch as Schedule.prepare made it, the minibatch's weight over ranks) -> (the loss divided by that
# weight, statistics to sum).
Loss = Callable[[Any, float], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Net:
    """A module the driver trains: its optimiser, and its loss on a micro-batch."""

    module: nn.Module  # as updates run it (parallel.wrap)
    optimizer: torch.optim.Optimizer
    loss: Loss
    weights: list[float] | None = None  # this net's item weights (None: the driver's), e.g. tokens for a critic


@dataclass(kw_only=True)
class Schedule:
    """How the driver walks the items."""

    epochs: int  # passes over the items
    minibatch: int  # items per optimiser step, over all ranks
    grad_clip: float  # the largest global gradient norm of each module
    generator: torch.Generator  # the minibatch order: seeded alike on every rank
    split: Callable[[list[int]], list[list[int]]]  # a minibatch's local items -> micro-batches, `aligned` over ranks
    prepare: Callable[[list[int]], Any] = field(default=lambda idx: idx)  # a micro-batch's items -> what every loss reads


def drive(nets: list[Net], schedule: Schedule, ids: list[int], weights: list[float],
          totals: dict[str, float] | None = None) -> dict[str, float]:
    """Optimiser steps over this rank's items (global `ids`, their `weights`); the losses' statistics summed into
    `totals` (returned), with `steps` and the first net's `grad_norm`. A non-finite first-net gradient raises.

    Each minibatch is a slice of one permutation of every rank's item ids, each rank working on its own members; a
    loss is divided by the minibatch's weight (e.g. tokens) over all ranks and gradients are summed across ranks (by
    the DDP or FSDP wrapper of `parallel.wrap`), so N processes take the step one would. Every rank runs the same
    number of micro-batches (empty ones where it has run out), as those wrappers need."""
    everyone = sorted(g for part in dist.all_gather_objects(ids) for g in part)
    local = {g: i for i, g in enumerate(ids)}
    totals = {"steps": 0.0, "grad_norm": 0.0} if totals is None else totals
    for _ in range(schedule.epochs):
        order = [everyone[k] for k in torch.randperm(len(everyone), generator=schedule.generator).tolist()]
        for start in range(0, len(order), schedule.minibatch):
            mb = [local[g] for g in order[start:start + schedule.minibatch] if g in local]
            own = [weights if net.weights is None else net.weights for net in nets]
            denominators = dist.all_sum([sum(w[i] for i in mb) for w in own])
            for net in nets:
                net.optimizer.zero_grad(set_to_none=True)
            micro = schedule.split(mb)
            for k, idx in enumerate(micro):
                batch = schedule.prepare(idx)  # once for every net's loss
                for net, denominator in zip(nets, denominators):
                    with parallel.no_sync(net.module, sync=k == len(micro) - 1):  # DDP: all-reduce on the last
                        loss, stats = net.loss(batch, denominator)
                        loss.backward()
                    for key, v in stats.items():
                        totals[key] = totals.get(key, 0.0) + v
            _step(nets, schedule.grad_clip, totals)
    return totals


def _step(nets: list[Net], grad_clip: float, totals: dict[str, float]) -> None:
    """Clip every net's gradient and step its optimiser; the first net's norm is summed into totals (and checked)."""
    for j, net in enumerate(nets):
        norm = parallel.clip_grad_norm(net.module, grad_clip)
        if j == 0:
            if not math.isfinite(norm):  # a NaN/inf loss shows here, identically on every rank
                raise FloatingPointError(f"the loss or its gradient is not finite (grad norm {norm}); "
                                         "the optimiser step was skipped")
            totals["grad_norm"] += norm
        net.optimizer.step()
    totals["steps"] += 1


def aligned(batches: list[list[int]]) -> list[list[int]]:
    """Pad with empty micro-batches to the most any rank has: every rank must join every forward and backward."""
    most = max(dist.all_gather_objects(len(batches)))
    return batches + [[] for _ in range(most - len(batches))]


def chunks(items: list[int], size: int) -> list[list[int]]:
    """`items` cut into micro-batches of `size`, in order, `aligned` over ranks."""
    return aligned([items[m:m + size] for m in range(0, len(items), max(1, size))])
