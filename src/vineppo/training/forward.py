"""The models' forward passes over packed episodes, as every update and the numerics check read them: episodes
packed so that responses start at one column (`pack`), per-token log-probs and entropies (`token_logprobs`; each
distinct prompt encoded once, and past LOGITS_BYTES of logits the LM head in chunks), and the critic's values."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from vineppo.core import distributed as dist
from vineppo.models.causal_lm import cache_keyword, load_model, pretrained

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


def pad_rows(rows: list[torch.Tensor], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Per-episode token rows in a zero [B, R] tensor, cut at R."""
    out = torch.zeros(shape, device=device)
    for j, r in enumerate(rows):
        out[j, : len(r)] = r[: shape[1]]
    return out


def pad_values(values: list[torch.Tensor], mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Per-episode values in a zero tensor shaped like `mask`, cut at its width."""
    out = torch.zeros(mask.shape, device=device)
    for j, v in enumerate(values):  # one value per response token, inserted ones too (the mask may have holes)
        out[j, : len(v)] = v.to(device)[: mask.shape[1]]
    return out
