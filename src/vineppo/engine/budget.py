"""How many tokens of keys/values the native engine may hold at once (``token_budget``): fixed on a CPU, read off
the free memory on a GPU, as vLLM's ``gpu_memory_utilization`` does.

On CUDA the budget is UTILISATION of the memory free after the weights, less what the caller reserves (the
update's optimiser state, which is allocated after the first sampling), divided by the bytes one token's
keys/values take in every layer, and by HEADROOM: the ring layout (``ring.py``) gives every row the job's
longest prefix plus max_new_tokens columns, not its own length, and a step's logits and sampling need room too.
"""

from __future__ import annotations

import torch

from vineppo.engine.batch import layers_kv

CPU_BUDGET = 65536  # rows x tokens in one decode batch on a CPU
UTILISATION = 0.9  # the share of the free GPU memory (less the reserve) the engine's keys/values may take
HEADROOM = 2  # free memory per token of budget, in units of one token's keys/values


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token takes in all of ``model``'s layers (measured on a one-token forward)."""
    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return sum(t.numel() * t.element_size() for kv in layers_kv(cache) for t in kv)


def auto_token_budget(model: torch.nn.Module, reserve_bytes: int = 0) -> tuple[int, str]:
    """The default token budget for ``model``'s device, and one line saying where it came from."""
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return CPU_BUDGET, f"token budget {CPU_BUDGET:,} (the CPU default)"
    free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    per_token = kv_bytes_per_token(model)
    usable = max(0.0, UTILISATION * free - reserve_bytes)
    budget = max(1, int(usable / (per_token * HEADROOM)))
    return budget, (f"token budget {budget:,} tokens ({UTILISATION:.0%} of {free / 2**30:.1f} GiB free on "
                    f"{torch.cuda.get_device_name(dev)}, less {reserve_bytes / 2**30:.1f} GiB for the update, at "
                    f"{per_token / 2**10:.0f} KiB of keys/values per token x {HEADROOM}; --token-budget overrides)")


def update_reserve(model: torch.nn.Module) -> int:
    """Bytes an update leaves held for ``model``'s trainable weights between updates: gradients and AdamW's two
    moments (allocated by the first update, so not yet missing from the free memory before it)."""
    return sum(3 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
