"""Algorithms' updates: what one iteration does with its graded samples, each a small function registered by name.

    @register("name")
    def update(episodes: list[Episode], ctx: Context) -> dict[str, float]

The trainer samples and grades the iteration's responses, calls the update of the algorithm `--algo` names
(`config.ALGOS[algo].update`), and logs the statistics it returns (already reduced over ranks). The PPO family
(VinePPO, PPO, GRPO, RLOO, and GRPO as TRL runs it and as Dr. GRPO does) is one update, `ppo`: its credit
estimator (vineppo.credit), then the PPO update. RestEM and DPO+ are the paper's two other baselines. A variant
of an existing update is one `config.ALGOS` entry; a new update is one registered function here and its entry
there. The trainer never branches on either.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError
from vineppo.core.grading import Scorer
from vineppo.core.tracking import Meter
from vineppo.credit import (Credit, CreditContext, Episode, get_estimator, groups, needs, nonzero_tokens, normalise,
                            token_mean_std)
from vineppo.engine import RolloutEngine, SamplingParams
from vineppo.engine.balanced import BalancedContinuations
from vineppo.models import lora, parallel
from vineppo.training import guard, runs
from vineppo.training.forward import pack, token_logprobs
from vineppo.training.ppo import Learner, Loss, Net, Rollouts, Schedule, UpdateConfig, chunks, drive, loss_weights, ppo_update


@dataclass
class Models(Learner):
    """A run's models: as updates run them (the Learner: the policy, DDP-wrapped or sharded, its optimiser, the frozen
    reference, the critic), and as checkpoints hold them (`trained`)."""

    trained: runs.Trained | None = None  # the policy and critic unwrapped, with their optimisers


@dataclass(kw_only=True)
class Context:
    """What an algorithm may use: the settings, the models, the sampling engine, the grader, the iteration's
    generators. The trainer's Run is one (it adds what the loop itself reads)."""

    cfg: TrainConfig
    models: Models  # models.reference: the frozen SFT model (the KL and DPO+ reference, RestEM's start; LoRA: the
    # policy with its adapters off), None when the run does not use it (`needs_reference`)
    tokenizer: Any
    engine: RolloutEngine | None = None  # rollout engine over the sampling model (VinePPO's Monte Carlo continuations)
    params: SamplingParams | None = None  # sampling settings of the iteration's responses
    score: Scorer | None = None  # the task's rewards of a batch of completions (Task.score)
    generator: torch.Generator | None = None  # seeded by (seed, iteration, rank): sampling and data selection
    order_generator: torch.Generator | None = None  # seeded by (seed, iteration): minibatch order, equal on all ranks
    status: Callable[[str], None] = lambda text: None  # the progress bar's phase
    sampling: Callable[[], AbstractContextManager] = nullcontext  # around the engine: whole weights, the run's dtype


Update = Callable[[list[Episode], Context], dict[str, float]]
UPDATES: dict[str, Update] = {}


def register(name: str) -> Callable[[Update], Update]:
    """Decorator: add an update to the registry under `name` (what `config.Algo.update` names)."""

    def add(fn: Update) -> Update:
        UPDATES[name] = fn
        return fn

    return add


def get_algorithm(cfg: TrainConfig) -> Update:
    """The update of the algorithm `cfg.algo` names, its estimator checked too (a bad name fails before any model
    loads)."""
    if cfg.algo not in configs.ALGOS:
        raise UserError(f"unknown algorithm {cfg.algo!r}; known: {', '.join(configs.ALGOS)}")
    if cfg.estimator != "none":  # "none": the algorithm assigns no per-token credit
        get_estimator(cfg.estimator)
    return UPDATES[configs.ALGOS[cfg.algo].update]


# ------------------------------------------------------------------------------------ the PPO family


@register("ppo")
def ppo_family(episodes: list[Episode], ctx: Context) -> dict[str, float]:
    """Per-token advantages from the configured credit estimator, then the PPO update (the same for all of them):
    credit -> rollouts -> update -> summary."""
    t0 = time.perf_counter()
    credit, metrics = assign_credit(episodes, ctx)
    data = rollouts(episodes, credit, ctx)
    metrics["time/credit_s"] = time.perf_counter() - t0
    stats, gap = update(data, ctx)
    return metrics | summary(data, stats, gap, ctx)


def assign_credit(episodes: list[Episode], ctx: Context) -> tuple[Credit, dict[str, float]]:
    """The estimator `--algo` names, with what it needs (the rollout engine for Monte Carlo, balanced over ranks; the
    critic), its advantages normalised as `--advantage-norm` says; the credit and its statistics over all ranks."""
    cfg = ctx.cfg
    ctx.status("credit assignment")
    mc_engine = BalancedContinuations(ctx.engine)
    critic = parallel.unwrap(ctx.models.critic) if ctx.models.critic is not None else None
    credit_ctx = configs.section(CreditContext, cfg, rollouts=mc_engine if needs(cfg.estimator).rollouts else None,
                                 tokenizer=ctx.tokenizer, score=ctx.score, critic=critic, params=ctx.params,
                                 generator=ctx.generator, progress=Meter("credit assignment", None, ctx.status,
                                                                         unit="continuations"))
    with ctx.sampling():
        credit = get_estimator(cfg.estimator)(episodes, credit_ctx)
    metrics = dict(zip(("advantage/mean", "advantage/std"), token_mean_std(credit.advantages)))
    metrics.update(_reduce_stats(credit.stats))
    if mc_engine.states_run:
        metrics["mc/states_run"] = dist.all_sum([float(mc_engine.states_run)])[0]
    if metrics.get("mc/states"):  # VinePPO: the states whose continuations' rewards differ
        metrics["signal/mixed_states"] = metrics["mc/mixed_states"] / metrics["mc/states"]
    normalised = normalise(credit.advantages, cfg.advantage_norm)
    nonzero, shifted, tokens = dist.all_sum([float(n) for n in nonzero_tokens(credit.advantages, episodes +
                                                                              credit.extra, normalised)])
    metrics["signal/nonzero_tokens"] = nonzero / max(tokens, 1.0)  # before normalisation: the estimator's own zeros
    metrics["signal/shifted_zeros"] = shifted / max(tokens, 1.0)  # zeros the normalisation moved (whitening's shift)
    credit.advantages = normalised
    return credit, metrics


def rollouts(episodes: list[Episode], credit: Credit, ctx: Context) -> Rollouts:
    """What the update trains on: the episodes and the estimator's further samples (tree rollouts), with their
    advantages, the critic's targets, the sampler's log-probs where they are the policy's, and the dialogues' masks."""
    trained = episodes + credit.extra
    old = [torch.tensor(ep.logprobs) for ep in trained] if sampler_logprobs(ctx, trained) else None
    masks = [ep.mask for ep in trained] if any(ep.mask is not None for ep in trained) else None
    return Rollouts(prompts=[ep.prompt_ids for ep in trained], responses=[ep.response_ids for ep in trained],
                    advantages=credit.advantages, pad_id=ctx.tokenizer.pad_token_id, returns=credit.returns,
                    old_values=credit.values, old_logprobs=old,
                    ids=_global_ids(episodes, ctx.cfg.samples_per_prompt, len(credit.extra)),
                    truncated=[ep.truncated for ep in trained], masks=masks)


def update(data: Rollouts, ctx: Context) -> tuple[dict[str, float], float]:
    """The numerics check, then `ppo_update` with the models in training mode (the engine's memory freed first);
    its statistics summed over ranks, and the largest gap between the sampler's log-probs and the policy's."""
    ctx.status("updating")
    free_engine(ctx)
    update_cfg = configs.section(UpdateConfig, ctx.cfg)
    nets = [net for net in (ctx.models.policy, ctx.models.critic) if net is not None]
    for net in nets:  # gradient checkpointing acts in training mode only
        net.train()
    checks = guard.check(ctx.models, data, update_cfg)
    stats = ppo_update(ctx.models, data, update_cfg, ctx.order_generator)
    for net in nets:
        net.eval()
    gap = max(dist.all_gather_objects(stats.pop("logprob_gap")))
    stats = dict(zip(stats, dist.all_sum(list(stats.values())))) | {f"guard/{k}": v for k, v in checks.items()}
    return stats, gap


def summary(data: Rollouts, stats: dict[str, float], gap: float, ctx: Context) -> dict[str, float]:
    """The update's metrics: the advantages the loss weighs, trained episodes and tokens, loss, clipping, entropy,
    gradient norm, KL and value loss where they exist, the log-prob gap where the sampler's log-probs were used."""
    metrics = loss_advantages(data, configs.section(UpdateConfig, ctx.cfg))
    metrics["train/trained_episodes"], metrics["train/trained_tokens"] = dist.all_sum(  # the policy's tokens
        [float(len(data.responses)), float(sum(data.policy_tokens(i) for i in range(len(data.responses))))])
    metrics.update({k: v for k, v in stats.items() if k.startswith("guard/")})
    tok = max(stats["tokens"], 1.0)
    metrics.update({"loss": stats["loss"] / max(stats["loss_weight"], 1.0), "clip_fraction": stats["clipped"] / tok,
                    "clip_fraction/high": stats["clipped_high"] / tok, "entropy": stats["entropy"] / tok,
                    "grad_norm": stats["grad_norm"] / max(stats["steps"], 1)})
    if "kl" in stats:  # no reference, no KL (--kl-coef 0)
        metrics["kl"] = stats["kl"] / tok
    if ctx.models.critic is not None:
        metrics["value_loss"] = stats["value_loss"] / tok
    if data.old_logprobs is not None:
        metrics["logprob_gap"] = gap
    return metrics


def loss_advantages(data: Rollouts, cfg: UpdateConfig) -> dict[str, float]:
    """The advantages as the policy loss weighs them at ratio 1 (--loss-agg, --mask-truncated), over all ranks:
    their weighted mean and mean magnitude (sum of token weight x advantage over the sum of episode weights, the
    batch taken as one minibatch), and the share of episodes left out of the loss."""
    weights, token_w = loss_weights(data, cfg.loss_agg, cfg.max_new_tokens, cfg.mask_truncated)
    adv = [a if data.mask(i) is None else a * torch.tensor(data.mask(i), dtype=a.dtype)  # the policy's tokens
           for i, a in enumerate(data.advantages)]
    total, signed, size, out, n = dist.all_sum([
        sum(weights), sum(w * float(a.sum()) for a, w in zip(adv, token_w)),
        sum(w * float(a.abs().sum()) for a, w in zip(adv, token_w)),
        float(sum(w == 0 for w in weights)), float(len(weights))])
    return {"advantage/loss_mean": signed / max(total, 1e-12), "advantage/loss_abs": size / max(total, 1e-12),
            "advantage/left_out": out / max(n, 1.0)}


def needs_reference(cfg: TrainConfig) -> bool:
    """True when a run uses the frozen SFT model: for its samples (--sample-from sft), a KL penalty, or an update
    outside the PPO family (RestEM restarts from it, DPO+ scores against it). Without it none is built."""
    return cfg.sample_from == "sft" or cfg.kl_coef > 0 or configs.ALGOS[cfg.algo].update != "ppo"


def sampler_logprobs(ctx: Context, episodes: list[Episode]) -> bool:
    """True when the episodes' sampling log-probs are the update's old log-probs: the native engine sampled them
    from the policy itself at the update's temperature, in float32 (bf16 autocast would make them differ)."""
    return (ctx.engine is not None and ctx.engine.logprobs_are_the_policys and ctx.cfg.dtype == "float32"
            and ctx.cfg.sample_from == "policy"
            and all(ep.logprobs is not None and len(ep.logprobs) == len(ep.response_ids) for ep in episodes))


def free_engine(ctx: Context) -> None:
    """Before an update: the engine frees what it holds that the update needs (vLLM on GPU: its KV cache)."""
    if ctx.engine is not None:  # unit tests run updates without one
        ctx.engine.sleep()


def _global_ids(episodes: list[Episode], per_prompt: int, extra: int = 0) -> list[int]:
    """Each episode's index in the iteration's whole batch over all ranks (its prompt's batch index x samples + j),
    then this rank's `extra` further episodes numbered after every rank's episodes, rank by rank."""
    ids = [ep.group * per_prompt + j % per_prompt for j, ep in enumerate(episodes)]
    if not extra and not dist.active():
        return ids
    first = max(dist.all_gather_objects(max(ids, default=-1))) + 1
    start = first + sum(dist.all_gather_objects(extra)[: dist.rank()])
    return ids + list(range(start, start + extra))


def _reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """Counts (mc/*) are summed over ranks; other statistics are averaged (names a rank lacks count 0)."""
    keys = sorted({k for part in dist.all_gather_objects(sorted(stats)) for k in part})
    summed = dist.all_sum([stats.get(k, 0.0) for k in keys])
    return {k: v if k.startswith("mc/") else v / dist.world() for k, v in zip(keys, summed)}


# ------------------------------------------------------------------------------------ shared by RestEM and DPO+


def sequence_logprobs(model: Any, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the responses at temperature 1 (plain likelihood), and their mask: [B, R] each.

    No prompts give one masked-out row (every rank must join each forward of a sharded model)."""
    device = _device(ctx)
    b = pack(prompts, responses, pad_id).to(device)
    with parallel.autocast(device, ctx.cfg.dtype):
        logp, _ = token_logprobs(model, b, 1.0)
    return logp, b.mask


def _device(ctx: Context) -> torch.device:
    return next(ctx.models.policy.parameters()).device


def minibatch_steps(ctx: Context, ids: list[int], weights: list[float], loss_fn: Loss) -> dict[str, float]:
    """`epochs` passes of AdamW steps on the policy over this rank's items (global `ids`, their `weights`: the
    minibatch's weight over ranks divides `loss_fn`'s loss), micro-batches in order (vineppo.training.minibatch)."""
    cfg = ctx.cfg
    free_engine(ctx)
    ctx.models.policy.train()
    schedule = Schedule(epochs=cfg.epochs, minibatch=cfg.minibatch, grad_clip=cfg.grad_clip,
                        generator=ctx.order_generator, split=lambda mb: chunks(mb, cfg.micro_batch))
    totals = drive([Net(ctx.models.policy, ctx.models.optimizer, loss_fn)], schedule, ids, weights)
    ctx.models.policy.eval()
    return totals


# ------------------------------------------------------------------------------------ RestEM


def keep_correct(episodes: list[Episode], cap: int) -> list[int]:
    """Indices of the correct episodes, at most `cap` per question (the first sampled), in order."""
    count: dict[tuple[int, ...], int] = {}
    kept = []
    for i, ep in enumerate(episodes):
        key = tuple(ep.prompt_ids)  # per question, even when a prompt was drawn twice in the iteration
        if ep.reward > 0 and count.get(key, 0) < cap:
            count[key] = count.get(key, 0) + 1
            kept.append(i)
    return kept


def restart_from_sft(ctx: Context) -> None:
    """Put the SFT weights (the frozen reference's) back into the policy and forget the optimiser's moments.

    LoRA: the adapters are initialised afresh (the base weights never moved). Under --dtype bfloat16 the
    reference is held in bf16, so a full fine-tuning restart takes the bf16-rounded SFT weights."""
    if lora.active(ctx.models.policy):
        lora.reset_adapters(ctx.models.policy, ctx.cfg.seed)
    else:
        with torch.no_grad():
            for p, q in zip(parallel.unwrap(ctx.models.policy).parameters(), ctx.models.reference.parameters(), strict=True):
                p.copy_(q)
    ctx.models.optimizer.state.clear()


@register("restem")
def restem(episodes: list[Episode], ctx: Context) -> dict[str, float]:
    """RestEM (expert iteration; Singh et al. 2023): keep the round's correct samples, restart from the SFT model,
    and fine-tune on them with plain likelihood (mean over their tokens) for `epochs` passes at `lr`."""
    cfg = ctx.cfg
    ctx.status("fine-tuning from the SFT model")
    kept = keep_correct(episodes, cfg.restem_keep)
    ids = _global_ids(episodes, cfg.samples_per_prompt)
    pad = ctx.tokenizer.pad_token_id
    restart_from_sft(ctx)

    def nll(idx: list[int], total: float) -> tuple[torch.Tensor, dict[str, float]]:
        eps = [episodes[kept[i]] for i in idx]
        logp, mask = sequence_logprobs(ctx.models.policy, [e.prompt_ids for e in eps], [e.response_ids for e in eps], pad,
                                       ctx)
        loss = -(logp * mask).sum() / total
        return loss, {"loss": float(loss.detach()) * total, "tokens": float(mask.sum())}

    totals = minibatch_steps(ctx, [ids[i] for i in kept], [float(len(episodes[i].response_ids)) for i in kept], nll)
    questions = len({tuple(episodes[i].prompt_ids) for i in kept})
    n_kept, n_questions, loss, tokens, norm, steps = dist.all_sum(
        [float(len(kept)), float(questions), totals.get("loss", 0.0), totals.get("tokens", 0.0),
         totals["grad_norm"], totals["steps"]])
    return {"restem/kept": n_kept, "restem/questions": n_questions, "loss": loss / max(tokens, 1.0),
            "grad_norm": norm / max(steps, 1.0)}


# ------------------------------------------------------------------------------------ DPO+ (DPO-Positive)


def dpo_positive_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor, beta: float, lam: float) -> torch.Tensor:
    """Per-pair DPO-Positive loss from sequence log-probs (summed over response tokens).

    Pal et al. 2024, "Smaug: Fixing Failure Modes of Preference Optimisation with DPO-Positive"
    (arXiv 2402.13228), Eq. 3: the penalty sits inside the sigmoid and is scaled by beta with the rest,
        -log sigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected) - lam * max(0, ref_chosen - chosen)));
    with lam = 0, or while the chosen response is at least as likely as under the reference, it is DPO.
    """
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    penalty = (ref_chosen - chosen).clamp(min=0)
    return -F.logsigmoid(beta * (margin - lam * penalty))


def preference_pairs(episodes: list[Episode], per_prompt: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """Up to `per_prompt` (correct, incorrect) episode-index pairs per prompt, drawn without replacement from all
    such pairs of its responses (truncated responses count as incorrect); prompts with no such pair give none."""
    pairs = []
    for members in groups(episodes).values():
        every = [(c, r) for c in members if episodes[c].reward > 0 for r in members if episodes[r].reward <= 0]
        picked = torch.randperm(len(every), generator=generator, device=generator.device)[:per_prompt]
        pairs += [every[k] for k in sorted(picked.tolist())]
    return pairs


@register("dpo-positive")
def dpo_positive(episodes: list[Episode], ctx: Context) -> dict[str, float]:
    """DPO+ (DPO-Positive): pairs of a correct and an incorrect response to one prompt, the DPO-Positive loss
    (mean over pairs) against the frozen SFT reference, `epochs` passes; the policy continues from round to round.
    `minibatch` and `micro_batch` count pairs (two sequences each)."""
    cfg = ctx.cfg
    ctx.status("scoring pairs")
    pairs = preference_pairs(episodes, cfg.dpo_pairs, ctx.generator)
    pad = ctx.tokenizer.pad_token_id
    used = sorted({i for pair in pairs for i in pair})
    ref = {}
    with torch.no_grad():  # the reference's sequence log-probs, once per iteration
        for part in chunks(used, cfg.micro_batch):
            logp, mask = sequence_logprobs(ctx.models.reference, [episodes[i].prompt_ids for i in part],
                                           [episodes[i].response_ids for i in part], pad, ctx)
            ref.update(zip(part, (logp * mask).sum(-1)))

    def loss_fn(idx: list[int], total: float) -> tuple[torch.Tensor, dict[str, float]]:
        rows = [pairs[i] for i in idx]
        both = [c for c, _ in rows] + [r for _, r in rows]
        logp, mask = sequence_logprobs(ctx.models.policy, [episodes[i].prompt_ids for i in both],
                                       [episodes[i].response_ids for i in both], pad, ctx)
        seq = (logp * mask).sum(-1)
        if not rows:  # an empty micro-batch (this rank has run out): a zero loss, for the collectives
            return seq.sum() * 0.0, {}
        n = len(rows)
        chosen, rejected = seq[:n], seq[n:]
        ref_c = torch.stack([ref[c] for c, _ in rows])
        ref_r = torch.stack([ref[r] for _, r in rows])
        losses = dpo_positive_loss(chosen, rejected, ref_c, ref_r, cfg.dpo_beta, cfg.dpo_lambda)
        with torch.no_grad():
            margin = (chosen - ref_c) - (rejected - ref_r)
            stats = {"loss": float(losses.sum()), "pairs": float(n), "margin": float(margin.sum()),
                     "accuracy": float((margin > 0).float().sum()), "chosen": float((chosen - ref_c).sum()),
                     "penalty": float((ref_c - chosen).clamp(min=0).sum())}
        return losses.sum() / total, stats

    ctx.status("updating")
    ids = _global_ids(episodes, cfg.samples_per_prompt)
    pair_ids = [ids[c] * cfg.samples_per_prompt + ids[r] % cfg.samples_per_prompt for c, r in pairs]
    totals = minibatch_steps(ctx, pair_ids, [1.0] * len(pairs), loss_fn)
    keys = ("loss", "pairs", "margin", "accuracy", "chosen", "penalty")
    summed = dict(zip(keys, dist.all_sum([totals.get(k, 0.0) for k in keys])))
    seen = max(summed["pairs"], 1.0)  # pair evaluations over all epochs
    n_pairs, norm, steps = dist.all_sum([float(len(pairs)), totals["grad_norm"], totals["steps"]])
    return {"dpo/pairs": n_pairs, "loss": summed["loss"] / seen, "dpo/margin": summed["margin"] / seen,
            "dpo/accuracy": summed["accuracy"] / seen, "dpo/chosen_logratio": summed["chosen"] / seen,
            "dpo/penalty": summed["penalty"] / seen, "grad_norm": norm / max(steps, 1.0)}
