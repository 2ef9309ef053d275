"""The PPO update shared by every algorithm: clipped policy loss, a KL penalty to the reference, optional critic.

Two small registries shape the policy loss: LOSS_AGGS (how a minibatch's per-token losses are averaged,
`--loss-agg`) and KL_ESTIMATORS (the per-token estimate of the KL to the reference, `--kl-estimator`)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from vineppo.core import distributed as dist
from vineppo.models import parallel
from vineppo.models.causal_lm import cache_keyword, load_model, pretrained
from vineppo.training.minibatch import Net, Schedule, aligned, drive

# Above this many bytes of float32 logits (rows x response tokens x vocabulary), log-probs are computed from the
# decoder's hidden states in chunks of positions, each chunk's logits recomputed in the backward pass: a 0.5B
# model's 151,936-entry vocabulary would otherwise take 0.6 MB per token, several copies over.
LOGITS_BYTES = 2**30


@dataclass
class Prompts:
    """A batch's distinct prompts, left-padded, and which one each row continues: each is encoded once and its
    keys and values are shared by every response to it (a group's 8 responses: about half the update's tokens)."""

    input_ids: torch.Tensor  # [U, P]
    attention_mask: torch.Tensor  # [U, P]
    rows: torch.Tensor  # [B] the prompt of each row

    def to(self, device: torch.device) -> Prompts:
        """These prompts on `device`."""
        return Prompts(self.input_ids.to(device), self.attention_mask.to(device), self.rows.to(device))


@dataclass
class Packed:
    """Episodes packed so that every response starts at one column P (the longest prompt): prompts left-padded,
    responses right-padded. Per-token tensors cover the R response columns only: column t is response token t,
    predicted by the logits at position P - 1 + t, so the model is scored on those positions alone."""

    input_ids: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]
    position_ids: torch.Tensor  # [B, P+R] positions counted from each row's first real token
    mask: torch.Tensor  # [B, R] 1 on response tokens
    advantages: torch.Tensor  # [B, R]
    returns: torch.Tensor  # [B, R] (zeros without a critic)
    prompts: Prompts | None = None  # set: token_logprobs encodes each distinct prompt once

    def to(self, device: torch.device) -> Packed:
        """This batch with every tensor on `device`."""
        return Packed(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.mask,
                                              self.advantages, self.returns)),
                     self.prompts.to(device) if self.prompts is not None else None)

    def scored(self) -> torch.Tensor:
        """The positions whose outputs predict the response columns: P-1 .. P+R-2."""
        R, L = self.mask.shape[1], self.input_ids.shape[1]
        return torch.arange(L - R - 1, L - 1, device=self.input_ids.device)


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
         advantages: list[torch.Tensor] | None = None, returns: list[torch.Tensor] | None = None,
         share: bool = False, masks: list[list[int] | None] | None = None) -> Packed:
    """Pack prompt+response sequences, responses aligned at one column, per-response-token values placed on them;
    `share`: also the distinct prompts (Prompts), for models that can take them as a KV cache (`can_share`);
    `masks`: per response, 1 on the policy's tokens and 0 on those a tool or environment inserted (None: all 1),
    so inserted tokens have no loss, no KL and no log-prob check.

    No episodes give one masked-out row: a rank with nothing to do in a micro-batch still runs the forward
    and backward passes that sharded (FSDP) and replicated (DDP) models need every rank to take part in."""
    if not prompts:
        empty = pack([[pad_id]], [[pad_id]], pad_id)
        empty.mask.zero_()
        return empty
    B, P, R = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask, adv, ret = (torch.zeros((B, R)) for _ in range(3))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p): P + len(r)] = torch.tensor(p + r)
        attn[i, P - len(p): P + len(r)] = 1
        mask[i, : len(r)] = 1 if masks is None or masks[i] is None else torch.tensor(masks[i], dtype=mask.dtype)
        if advantages is not None:
            adv[i, : len(r)] = advantages[i]
        if returns is not None:
            ret[i, : len(r)] = returns[i]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    if not share:
        return Packed(ids, attn, positions, mask, adv, ret)
    distinct: dict[tuple[int, ...], int] = {}
    rows = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts])
    width = max(map(len, distinct))
    p_ids, p_attn = torch.full((len(distinct), width), pad_id, dtype=torch.long), torch.zeros((len(distinct), width),
                                                                                             dtype=torch.long)
    for u, p in enumerate(distinct):
        p_ids[u, width - len(p):], p_attn[u, width - len(p):] = torch.tensor(p), 1
    return Packed(ids, attn, positions, mask, adv, ret, Prompts(p_ids, p_attn, rows))


def can_share(model: nn.Module) -> bool:
    """True when `model` can score a Packed with shared prompts: one process (DDP and FSDP see one forward per
    backward) and no activation checkpointing (transformers drops the KV cache of a checkpointed layer)."""
    return not dist.active() and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def token_logprobs(model: nn.Module, batch: Packed, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each response token under softmax(logits / T), and the entropy of that distribution: [B, R].

    The LM head runs only on the scored positions (`logits_to_keep`): with a 50k vocabulary, logits for the
    prompt would be the largest tensor of the update. Past LOGITS_BYTES of logits, in chunks (`chunked_logprobs`)."""
    targets = batch.input_ids[:, -batch.mask.shape[1]:]
    if _chunks(model, batch) > 1:
        return chunked_logprobs(model, batch, targets, temperature)
    if batch.prompts is not None:
        logits = _shared_prompt_logits(model, batch)
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       logits_to_keep=batch.scored(), use_cache=False).logits
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_logprobs(model: nn.Module, batch: Packed, targets: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs from the decoder's hidden states, the LM head applied to a chunk of positions at a time and
    recomputed in the backward pass (activation checkpointing), so no [B, R, V] tensor of logits exists."""
    hidden = _response_hidden(model, batch)
    head = pretrained(model).get_output_embeddings()
    R = hidden.shape[1]
    size = -(-R // _chunks(model, batch))
    parts = [checkpoint(_head_logprobs, head, hidden[:, a:a + size], targets[:, a:a + size], temperature,
                        use_reentrant=False) for a in range(0, R, size)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def _head_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / temperature
    lse = logits.logsumexp(-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():  # the entropy is reported, not trained on
        entropy = lse - ((logits - lse.unsqueeze(-1)).exp() * logits).sum(-1)
    return logp, entropy


def _chunks(model: nn.Module, batch: Packed) -> int:
    """How many chunks of positions the log-probs of `batch` take (1: the model's own forward, in one piece).

    Chunks need the decoder and the head called apart: one process (DDP and FSDP hook the whole model's forward)
    and a model whose logits are exactly head(last hidden state) (no soft-capping or scaling), checked once."""
    B, R = batch.mask.shape
    head = pretrained(model).get_output_embeddings()
    n = -(-B * R * head.weight.shape[0] * 4 // LOGITS_BYTES)
    if n <= 1 or dist.active():
        return 1
    return n if _plain_head(model, batch.input_ids.device) else 1


def _plain_head(model: nn.Module, device: torch.device) -> bool:
    """True when `model`'s logits are its output embeddings applied to its decoder's last hidden state (memoised)."""
    inner = pretrained(model)
    if getattr(inner, "_vineppo_plain_head", None) is None:
        ids = torch.arange(2, 10, device=device).view(1, -1)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            again = inner.get_output_embeddings()(inner.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state)
        inner._vineppo_plain_head = bool(torch.equal(logits, again))
    return inner._vineppo_plain_head


def _response_hidden(model: nn.Module, batch: Packed) -> torch.Tensor:
    """The decoder's last hidden states at the positions that predict the response tokens: [B, R, hidden]."""
    decoder = pretrained(model).get_decoder()
    if batch.prompts is None:
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                      use_cache=False)
        return out.last_hidden_state[:, batch.scored()]
    return _shared_prompt_states(decoder, batch)


def _shared_prompt_logits(model: nn.Module, batch: Packed) -> torch.Tensor:
    """The logits of token_logprobs in two passes: the distinct prompts, then every response on its prompt's keys
    and values (indexed per row, so gradients flow back to the shared prompt pass), exactly as one pass would."""
    R = batch.mask.shape[1]
    shared, head, body_kw = _shared_prompt_pass(model, batch, logits_to_keep=1)
    body = model(**body_kw, logits_to_keep=torch.arange(R - 1, device=shared.device))
    return torch.cat([head.logits[batch.prompts.rows, -1:], body.logits], 1)


def _shared_prompt_states(decoder: nn.Module, batch: Packed) -> torch.Tensor:
    """_shared_prompt_logits' two passes through the decoder alone: the hidden states instead of the logits."""
    shared, head, body_kw = _shared_prompt_pass(decoder, batch)
    body = decoder(**body_kw)
    return torch.cat([head.last_hidden_state[batch.prompts.rows, -1:], body.last_hidden_state[:, :-1]], 1)


def _shared_prompt_pass(model: nn.Module, batch: Packed, **kwargs) -> tuple[torch.Tensor, object, dict]:
    """The distinct prompts' pass (its output, `kwargs` passed on), and the keyword arguments of the responses'
    pass over each row's prompt keys and values; the first item is the responses' attention mask."""
    sp, R = batch.prompts, batch.mask.shape[1]
    config, kw = pretrained(model).config, cache_keyword(model)
    cache = DynamicCache(config=config)
    head = model(input_ids=sp.input_ids, attention_mask=sp.attention_mask, use_cache=True, **{kw: cache},
                 position_ids=(sp.attention_mask.cumsum(-1) - 1).clamp(min=0), **kwargs)
    shared = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        shared.update(layer.keys[sp.rows], layer.values[sp.rows], i)
    # the responses' own attention, not the loss mask: a dialogue's inserted tokens are attended to, not trained
    attention = torch.cat([sp.attention_mask[sp.rows], batch.attention_mask[:, -R:]], 1)
    positions = sp.attention_mask.sum(1)[sp.rows, None] + torch.arange(R, device=attention.device)
    body_kw = dict(input_ids=batch.input_ids[:, -R:], attention_mask=attention, position_ids=positions, use_cache=True,
                   **{kw: shared})
    return attention, head, body_kw


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


class Critic(nn.Module):
    """A value model: the SFT model's transformer body with a scalar head on every position."""

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_model(cls, lm: nn.Module) -> "Critic":
        """A critic whose body is a copy of the causal LM `lm` without its LM head."""
        body = copy.deepcopy(lm.base_model)
        return cls(body, body.config.hidden_size).to(next(lm.parameters()).device)

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device) -> "Critic":
        """A critic whose body is the causal LM at `path` (folder, .gguf file or hub id) without its LM head."""
        return cls.from_model(load_model(path, device=str(device), verbose=False)[0])

    def forward(self, batch: Packed) -> torch.Tensor:
        """V(prefix) before every response token: [B, R]."""
        hidden = self.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).last_hidden_state
        return self.head(hidden[:, batch.scored()].float()).squeeze(-1).float()  # float32 under autocast too

    @torch.no_grad()
    def values(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0,
               micro_batch: int = 16) -> list[torch.Tensor]:
        """Per-response-token values (the value of the state before each token), one tensor per response."""
        out = []
        for i in range(0, len(prompts), micro_batch):
            p, r = prompts[i:i + micro_batch], responses[i:i + micro_batch]
            batch = pack(p, r, pad_id)
            v = self(batch.to(self.head.weight.device)).cpu()
            out += [v[j][batch.mask[j].bool()] for j in range(len(p))]
        return out




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


def ppo_update(nets: Learner, data: Rollouts, cfg: UpdateConfig, generator: torch.Generator) -> dict[str, float]:
    """`cfg.epochs` passes of clipped-PPO minibatch steps (vineppo.training.minibatch) over this rank's episodes, the critic
    stepped beside the policy; returns summed statistics.

    Old log-probs come from `data.old_logprobs` when the sampler gave them (the same weights and temperature: one
    forward pass fewer); `logprob_gap` then reports their largest difference from the trainer's own, measured
    before the first step.
    """
    policy, critic = nets.policy, nets.critic
    prompts, responses, advantages, returns = data.prompts, data.responses, data.advantages, data.returns
    device = next(policy.parameters()).device
    share = can_share(policy)
    old_logp, ref_logp = _before_update(nets, data, cfg, device, share and (nets.reference is None or
                                                                           can_share(nets.reference)))
    totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "entropy": 0.0, "tokens": 0.0, "value_loss": 0.0,
              "grad_norm": 0.0, "steps": 0.0, "logprob_gap": 0.0, "clipped_high": 0.0, "loss_weight": 0.0}
    if nets.reference is None:
        del totals["kl"]
    weights, token_w = loss_weights(data, cfg.loss_agg, cfg.max_new_tokens, cfg.mask_truncated)
    terms = cfg.surrogate()
    packed: dict[str, Packed] = {}  # the micro-batch the policy's loss packed, which the critic's loss reuses

    def policy_step(idx: list[int], n_tok: float) -> tuple[torch.Tensor, dict[str, float]]:
        b = pack([prompts[i] for i in idx], [responses[i] for i in idx], data.pad_id,
                 [advantages[i] for i in idx], [returns[i] for i in idx] if returns else None, share,
                 [data.mask(i) for i in idx]).to(device)
        packed["batch"] = b
        old = pad_rows([old_logp[i] for i in idx], b.mask.shape, device)
        ref = pad_rows([ref_logp[i] for i in idx], b.mask.shape, device) if ref_logp is not None else None
        with parallel.autocast(device, cfg.dtype):
            logp, entropy = token_logprobs(policy, b, cfg.temperature)
        w = b.mask * torch.tensor([token_w[i] for i in idx] or [0.0], device=device)[:, None]
        summed, stats = policy_loss(logp, old, ref, b.advantages, w, terms)
        loss = summed / max(n_tok, 1.0)  # 0 / 1 when --mask-truncated left every episode of the minibatch out
        if data.old_logprobs is not None and totals["steps"] == 0 and b.mask.any():  # still the sampler's weights
            totals["logprob_gap"] = max(totals["logprob_gap"], float(((logp.detach() - old).abs() * b.mask).max()))
        return loss, {"loss": float(loss.detach()) * n_tok, **stats, "loss_weight": sum(weights[i] for i in idx),
                      "entropy": float((entropy.detach() * b.mask).sum()), "tokens": float(b.mask.sum())}

    def critic_step(idx: list[int], n_tok: float) -> tuple[torch.Tensor, dict[str, float]]:
        b = packed["batch"]
        with parallel.autocast(device, cfg.dtype):
            v = critic(b)
        old_v = _pad_values([data.old_values[i] for i in idx], b.mask, device)
        loss = value_loss(v, old_v, b.returns, b.mask, cfg.value_clip, n_tok)
        return loss, {"value_loss": float(loss.detach()) * n_tok}

    steps = [Net(policy, nets.optimizer, policy_step)]
    if critic is not None:  # the value loss is a mean over the minibatch's tokens, whatever --loss-agg
        steps.append(Net(critic, nets.critic_optimizer, critic_step, [float(len(r)) for r in responses]))
    # Minibatches are drawn over the global episode ids, so their make-up does not depend on the rank count.
    ids = list(range(len(prompts))) if data.ids is None else data.ids
    schedule = Schedule(epochs=cfg.epochs, minibatch=cfg.minibatch, grad_clip=cfg.grad_clip, generator=generator,
                        split=lambda mb: micro_batches(mb, prompts, cfg.micro_batch, responses, cfg.micro_batch_tokens))
    return drive(steps, schedule, ids, weights, totals)


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


def pad_rows(rows: list[torch.Tensor], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Per-episode token rows in a zero [B, R] tensor, cut at R."""
    out = torch.zeros(shape, device=device)
    for j, r in enumerate(rows):
        out[j, : len(r)] = r[: shape[1]]
    return out


def _pad_values(values: list[torch.Tensor], mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.zeros(mask.shape, device=device)
    for j, v in enumerate(values):  # one value per response token, inserted ones too (the mask may have holes)
        out[j, : len(v)] = v.to(device)[: mask.shape[1]]
    return out
