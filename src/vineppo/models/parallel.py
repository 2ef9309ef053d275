"""Models on more than one rank, and the memory knobs: FSDP2 sharding (`--fsdp`), DDP replication,
bf16 autocast (`--dtype bfloat16`) and gradient checkpointing (`--gradient-checkpointing`).

`wrap` returns the module the update trains through: the model itself in one process; under torchrun,
`fully_shard` per decoder layer and at the root (`--fsdp`), or a DDP wrapper around it. Either way the
gradients are *summed* over ranks (FSDP's divide factor 1, a summing DDP hook), since every rank's loss
is already divided by the global token count: N ranks take the step one rank would.

Sharded parameters exist only in pieces, so sampling (a different number of forward passes on every rank)
runs inside `gathered`, which all-gathers every layer once and keeps it whole until the block ends.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from vineppo.core import distributed as dist
from vineppo.core.errors import UserError
from vineppo.models.causal_lm import pretrained

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # --dtype: the autocast compute dtype (None: plain float32)


def wrap(model: nn.Module, device: torch.device, fsdp: bool, checkpointing: bool = False) -> nn.Module:
    """The module to run the update through: `model` sharded (FSDP2, in place), replicated (DDP) or as it is."""
    if checkpointing:
        _checkpoint_activations(pretrained(model))
    if not dist.active():
        return model
    if fsdp:
        mesh = init_device_mesh(device.type, (dist.world(),))  # explicit: on a CUDA machine the default is CUDA
        blocks = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
        layers = [m for m in model.modules() if type(m).__name__ in blocks]
        if not layers:
            raise UserError(f"--fsdp: cannot find the decoder layers of {type(pretrained(model)).__name__}")
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum the gradients, do not average them
                m.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)
        return model
    if not any(p.requires_grad for p in model.parameters()):
        return model  # a frozen replica needs no gradient synchronisation
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _checkpoint_activations(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (transformers' own switch, both spellings)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _sum_hook(group, bucket):  # unannotated: DDP refuses the string annotations of `from __future__ import annotations`
    """DDP's all-reduce without its division by the number of ranks."""
    fut = tdist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place, so an FSDP model is itself)."""
    return model.module if isinstance(model, DDP) else model


def sharded(model: nn.Module | None) -> bool:
    """True for a model sharded by `wrap(..., fsdp=True)`."""
    return isinstance(model, FSDPModule)


@contextmanager
def no_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Accumulate gradients locally unless `sync` (the last micro-batch): DDP all-reduces once per step.

    FSDP reduce-scatters after every backward and accumulates sharded gradients (the same sum, without
    holding whole gradients), so only DDP is affected."""
    with model.no_sync() if isinstance(model, DDP) and not sync else nullcontext():
        yield


@contextmanager
def gathered(*models: nn.Module | None) -> Iterator[None]:
    """Whole parameters of sharded models inside the block (for sampling: one all-gather, then no collective).

    Costs one full copy of each model's parameters on every rank for the block's duration."""
    mods = [m for model in models if sharded(model) for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


@contextmanager
def sampling(device: torch.device, dtype: str, *models: nn.Module | None) -> Iterator[None]:
    """Sampling and scoring outside the update: sharded models gathered whole, computing in the run's dtype."""
    with gathered(*models), autocast(device, dtype):
        yield


def autocast(device: torch.device, dtype: str) -> torch.autocast | nullcontext:
    """bf16 autocast for `--dtype bfloat16` (weights and optimiser state stay float32), else nothing."""
    low = DTYPES[dtype]
    return torch.autocast(device.type, dtype=low) if low is not None else nullcontext()


def pick_dtype(dtype: str, device: torch.device) -> str:
    """`--dtype auto`: bfloat16 on a GPU that has it, float32 elsewhere (on the CPUs measured bf16 autocast was no
    faster: docs/models-and-gpus.md); any other value as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


def round_weights(model: nn.Module, dtype: str) -> nn.Module:
    """Trainable float32 weights rounded to values `dtype` represents exactly, so autocast computes with them.

    A checkpoint stored in float16 has about 8% of its weights exactly halfway between two bf16 values.
    Autocast rounds such a tie to the even neighbour; the first optimiser step moves the float32 weight off
    the tie by ~lr, and every one of them then rounds a whole bf16 spacing (~25x the step) towards the
    gradient: a coherent jump that took the SmolLM2 preset's first update to a KL of ~1,500 on a CPU."""
    low = DTYPES[dtype]
    if low is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.dtype == torch.float32:
                    p.copy_(p.to(low))
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients' global norm (over all shards) to max_norm; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0 (on CPU; empty on other ranks) of a sharded or plain model."""
    if not sharded(model):
        return unwrap(model).state_dict() if dist.is_main() else {}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load a whole state dict (every rank holds it) into a sharded or plain model; (missing, unexpected) keys."""
    if not sharded(model):
        return unwrap(model).load_state_dict(state, strict=False)
    keys = set(get_model_state_dict(model).keys())
    missing, unexpected = sorted(keys - set(state)), sorted(set(state) - keys)
    set_model_state_dict(model, {k: v for k, v in state.items() if k in keys},
                         options=StateDictOptions(full_state_dict=True, strict=False))
    return missing, unexpected


def save_sharded(folder, models: dict[str, tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Every rank writes its shard of the optimisers' states into `folder` (torch.distributed.checkpoint)."""
    dcp.save({name: get_optimizer_state_dict(m, opt) for name, (m, opt) in models.items()}, checkpoint_id=str(folder))


def load_sharded(folder, models: dict[str, tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Read optimiser states written by `save_sharded` (on any number of ranks) into these models' optimisers."""
    states = {name: get_optimizer_state_dict(m, opt) for name, (m, opt) in models.items()}
    dcp.load(states, checkpoint_id=str(folder))
    for name, (m, opt) in models.items():
        set_optimizer_state_dict(m, opt, states[name])
