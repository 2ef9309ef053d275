"""Data parallelism with PyTorch's own launcher: `torchrun --nproc-per-node N -m vineppo train ...`.

Without torchrun every function here is the identity, so single-process code pays nothing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as tdist

from vineppo.core.errors import UserError

_joined = None  # the group init() joined: shutdown() ends only that one (vLLM in this process makes its own)


def pick_device(device: str | None = None) -> torch.device:
    """The requested device, or cuda when available, else cpu."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None


def init(device: str = "auto") -> torch.device:
    """Join the process group when launched by torchrun (gloo on CPU, NCCL on GPU); return this rank's device."""
    dev = pick_device(device)  # the one place where "auto" and bad names are resolved
    launched = "RANK" in os.environ
    if dev.type == "cuda":  # under torchrun, one GPU per rank
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if launched else dev.index or 0)
    if launched and not tdist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        global _joined
        _joined = tdist.group.WORLD
    return dev


def active() -> bool:
    """True inside a process group of more than one rank."""
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def world() -> int:
    """Number of ranks (1 without torchrun)."""
    return tdist.get_world_size() if active() else 1


def rank() -> int:
    """This process's rank (0 without torchrun)."""
    return tdist.get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0 writes checkpoints, logs and progress."""
    return rank() == 0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum of a list of numbers over all ranks (float64)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    tdist.all_reduce(t)
    return t.cpu().tolist()


def all_gather_objects(obj: object) -> list:
    """Every rank's `obj`, in rank order (a one-element list without torchrun)."""
    if not active():
        return [obj]
    out: list = [None] * world()
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank."""
    if active():
        tdist.barrier()


def shutdown() -> None:
    """Leave the process group init() joined; a group someone else made (vLLM's, in this process) is theirs to end.

    Call barrier() first on a normal exit: a rank that tears gloo down while a peer's worker threads still hold work
    can abort that peer."""
    global _joined
    if _joined is not None and tdist.is_available() and tdist.is_initialized() and tdist.group.WORLD is _joined:
        tdist.destroy_process_group()
    _joined = None
