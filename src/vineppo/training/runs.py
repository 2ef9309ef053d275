"""Run folders: one run per folder, the starting model's fingerprint, and checkpoints that survive kills,
full disks and damaged files.

A run folder holds config.yaml (the resolved settings, rewritten when `--resume --iterations` asks for a
new total), start_model.json (the sha256 of the starting weights), .lock (an advisory lock with the
holder's PID and host, held for the life of the run), metrics.jsonl, checkpoints/ and summary.json.

Checkpoints: checkpoints/iter-000010/{model files, optimizer.pt, critic.pt, state.json}: the model files
are a transformers folder (LoRA runs: peft's adapter files), and --fsdp runs keep the optimiser states
as torch.distributed.checkpoint shards in optimizer/ instead of optimizer.pt. A checkpoint is
written to a temporary folder and renamed into place, then `latest` is replaced atomically, so a kill
mid-write never leaves a broken latest checkpoint. A write that fails (disk full, no permission) removes
the temporary folder and leaves the previous checkpoint as it was. Resume takes the newest checkpoint
that reads back whole and warns about any newer damaged one. With --save-weights-only a checkpoint holds the model
files and state.json alone (`"weights_only": true`): `vineppo eval` and `export` read it, a resume refuses it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file

from vineppo.core import distributed as dist
from vineppo.core.errors import UserError
from vineppo.models import lora, parallel
from vineppo.models.prompts import save_format

try:
    import fcntl
except ImportError:  # POSIX only: on Windows run folders are not locked
    fcntl = None

LOCK = ".lock"
START = "start_model.json"
# What a run writes besides config.yaml: removed when a run that stopped before its first checkpoint restarts.
ARTIFACTS = ("metrics.jsonl", "summary.json", START, "tensorboard", "wandb", "checkpoints")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def reason(e: BaseException) -> str:
    """What a failed write means, in a few words: the disk is full, permission denied, or the error's first line."""
    text = str(e)
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "StorageFull" in text:
        return "the disk is full"
    if code in (errno.EACCES, errno.EPERM) or "Permission denied" in text:
        return "permission denied"
    if code == errno.EROFS:
        return "the file system is read-only"
    if code in (errno.EEXIST, errno.ENOTDIR):
        return "a file is in the way, not a folder"
    if isinstance(e, RuntimeError) and _write_failure(e):
        return "the write failed (is the disk full?)"
    return (text.strip().splitlines() or [type(e).__name__])[0][:200]


def _write_failure(e: BaseException) -> bool:
    """True for the errors a failed write raises (torch.save raises a RuntimeError, safetensors its own)."""
    return isinstance(e, (OSError, SafetensorError)) or (isinstance(e, RuntimeError) and "writ" in str(e).lower())


def make_folder(folder: Path, label: str) -> None:
    """Create an output folder now, so a read-only or file path fails in one line before any work is done."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{label}: cannot write there ({reason(e)})") from None


@contextmanager
def output_folder(folder: Path, label: str) -> Iterator[Path]:
    """make_folder, then remove the folder (and the parents it made) again if the block fails before writing
    anything into them: a failed command leaves no empty folder, not even a fresh `runs/`."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    make_folder(folder, label)
    try:
        yield folder
    except BaseException:
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (innermost first) while they are empty directories."""
    for path in folders:
        if not path.is_dir() or any(path.iterdir()):
            break
        path.rmdir()


# ------------------------------------------------------------------------------------ the lock


@contextmanager
def locked(out: Path, create: bool, enabled: bool = True) -> Iterator[None]:
    """Hold an exclusive advisory lock on the run folder (created first when `create`) while the block runs."""
    if not enabled:
        yield
        return
    made = [p for p in (out, *out.parents) if not p.exists()] if create else []  # innermost first
    if create:
        make_folder(out, f"--out {out}")
    if fcntl is None:
        yield
        return
    try:
        handle = open(out / LOCK, "a+")
    except OSError as e:
        raise UserError(f"{out}: cannot write in this run folder ({reason(e)})") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(f"{out} is in use by {holder}: one run per folder; wait for it to end, or use "
                            f"another --out") from None
        handle.truncate(0)
        handle.write(f"process {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            if made and os.listdir(out) == [LOCK]:  # the run failed before writing anything: leave no folder
                shutil.rmtree(out)
                _remove_empty(made[1:])  # nor the runs/ made for it
            fcntl.flock(handle, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------ run folders


def checkpoints(out: Path) -> list[Path]:
    """The run's checkpoint folders, newest first."""
    return sorted((p for p in (out / "checkpoints").glob("iter-*") if p.is_dir()), reverse=True)


def latest(out: Path) -> Path | None:
    """The checkpoint `latest` names (the newest one written), or None."""
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def start_fresh(out: Path) -> None:
    """Check `out` can take a new run; a run that stopped before its first checkpoint is started over."""
    if not (out / "config.yaml").exists():
        return
    if checkpoints(out) or (out / "summary.json").exists():
        raise UserError(f"--out {out} already holds a run; use --resume {out} to continue it, or another --out")
    print(f"note: {out} holds a run that stopped before its first checkpoint (nothing to keep); starting it over",
          file=sys.stderr)
    for name in ARTIFACTS:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def resume_point(out: Path, iterations: int) -> list[Path]:
    """The checkpoints a resume may start from, newest first (a warning for each damaged one), checked against
    the requested total of iterations."""
    every = checkpoints(out)
    if not every:
        raise UserError(f"--resume {out}: no checkpoint (the run stopped before its first one): nothing is lost by "
                        f"starting over; run the same `vineppo train` command with --out {out} to restart it in "
                        f"this folder, or remove the folder")
    found = []
    for ckpt in every:
        why = damage(ckpt)
        if why is None:
            found.append(ckpt)
        else:
            print(f"warning: checkpoint {ckpt} is damaged ({why}); trying an older one", file=sys.stderr)
    if not found:
        raise UserError(f"--resume {out}: every checkpoint is damaged (see the warnings); remove the folder to "
                        f"start over")
    state = json.loads((found[0] / "state.json").read_text())
    if state.get("weights_only"):
        raise UserError(f"--resume {out}: checkpoint {found[0].name} holds the weights alone (the run was saved with "
                        f"--save-weights-only true), so its optimiser cannot go on; `vineppo eval --model "
                        f"{found[0]}` and `vineppo export` read it, a new run can start from it")
    if iterations < state["iteration"]:
        raise UserError(f"--iterations {iterations}: the run in {out} has already done {state['iteration']} "
                        f"iterations ({found[0].name}); ask for at least {state['iteration']}")
    return found


def damage(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint folder without loading it (a missing or truncated file), or None."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
            return "state.json has no iteration"
        weights = sorted(ckpt.glob("*.safetensors"))
        if not weights:
            return "no model weights"
        for f in weights:
            size = f.stat().st_size
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if 8 + n > size:
                    return f"{f.name} is truncated"
                header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if size != 8 + n + end:
                return f"{f.name} is truncated"
        if state.get("weights_only"):
            return None  # no optimiser state to check
        sharded = ckpt / "optimizer"
        if sharded.is_dir() and not (sharded / ".metadata").is_file():
            return "optimizer/ has no .metadata (its write was cut)"
        for f in ([] if sharded.is_dir() else [ckpt / "optimizer.pt"]) + sorted(ckpt.glob("critic.pt")):
            if not zipfile.is_zipfile(f):  # torch.save writes a zip; a cut one has no central directory
                return f"{f.name} is missing or truncated"
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return reason(e)
    return None


# ------------------------------------------------------------------------------------ the starting model


def weights_digest(model: str) -> str | None:
    """sha256 over the weight files of a model folder, a .gguf file, or a hub id's cached snapshot; None when not on
    disk."""
    path = Path(model).expanduser()
    if not path.exists():
        try:

            path = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not a hub id, or not in the cache: nothing on disk to hash
            return None
    files = [path] if path.is_file() else sorted({f for pattern in WEIGHTS for f in path.glob(pattern)})
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def record_start_model(out: Path, model: str) -> None:
    """Write which weights the run starts from (their sha256), for resume to compare against."""
    write_atomic(out / START, json.dumps({"model": model, "sha256": weights_digest(model)}, indent=2) + "\n")


def check_start_model(out: Path, model: str) -> None:
    """Refuse, in one line, to resume from weights other than the ones the run started from."""
    path = out / START
    if not path.is_file():  # a run from before this record existed: nothing to compare with
        return
    saved = json.loads(path.read_text()).get("sha256")
    now = weights_digest(model)
    if saved and now and saved != now:
        raise UserError(f"--resume {out}: the starting model {model} is not the one this run started from (weights "
                        f"sha256 {saved[:12]}... then, {now[:12]}... now), so the KL reference would differ; put "
                        f"back the original weights, or start a new run")


# ------------------------------------------------------------------------------------ writing


def write_atomic(path: Path, text: str) -> None:
    """Write a small file through a temporary one, so a reader never sees half of it; one line on failure."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {reason(e)}") from None


@dataclass
class Trained:
    """What a checkpoint holds besides the run's state: the models being trained and their optimisers."""

    policy: Any  # a transformers model, a LoRA (peft) model, or either sharded by parallel.wrap
    optimizer: torch.optim.Optimizer
    critic: Any = None
    critic_opt: torch.optim.Optimizer | None = None
    fsdp: bool = False  # optimiser states as torch.distributed.checkpoint shards, readable on any number of ranks

    def optimizers(self) -> dict[str, tuple]:
        return {"policy": (self.policy, self.optimizer)} | ({"critic": (self.critic, self.critic_opt)}
                                                             if self.critic is not None else {})


@dataclass(frozen=True)
class Keep:
    """What a run keeps of its checkpoints (--keep-checkpoints, --save-weights-only)."""

    last: int = 2  # the newest checkpoints left on disk
    weights_only: bool = False  # the model files alone: no optimiser state (nor critic), so no resume from them


def save_checkpoint(out: Path, trained: Trained, tokenizer, state: dict, keep: Keep,
                    record: tuple[str, str] | None = None) -> None:
    """Write checkpoint iter-<state['iteration']> atomically, point `latest` at it, keep the newest `keep.last` (with
    the optimiser state unless `keep.weights_only`); `record` (prompt format, dtype) goes in it
    (vineppo.models.prompts), so it evaluates and trains in the format it learned, and evaluates in the dtype it
    trained in.

    Rank 0 writes; with --fsdp every rank first gathers the whole weights to rank 0 and writes its own
    optimiser shard."""
    weights_only = keep.weights_only
    if weights_only:
        trained = Trained(trained.policy, trained.optimizer, fsdp=False)  # nothing of the optimisers is written
        state = {**state, "weights_only": True}
    main, sharded = dist.is_main(), parallel.sharded(trained.policy)
    weights = parallel.full_state(trained.policy) if sharded else None
    critic = parallel.full_state(trained.critic) if sharded and trained.critic is not None else None
    root = out / "checkpoints"
    name = f"iter-{state['iteration']:06d}"
    tmp = root / f".{name}.tmp"
    previous = latest(out)
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if trained.fsdp:
            dist.barrier()  # the folder exists
            parallel.save_sharded(tmp / "optimizer", trained.optimizers())
        if not main:
            dist.barrier()
            return
        parallel.unwrap(trained.policy).save_pretrained(tmp, safe_serialization=True,
                                                        **({"state_dict": weights} if sharded else {}))
        tokenizer.save_pretrained(tmp)
        if record:
            save_format(tmp, *record)
        if not trained.fsdp and not weights_only:
            torch.save(trained.optimizer.state_dict(), tmp / "optimizer.pt")
        if trained.critic is not None:
            saved = {"critic": critic if sharded else parallel.unwrap(trained.critic).state_dict()}
            torch.save(saved if trained.fsdp else saved | {"optimizer": trained.critic_opt.state_dict()},
                       tmp / "critic.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
        shutil.rmtree(root / name, ignore_errors=True)  # a damaged one a resume fell back from
        os.replace(tmp, root / name)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
    except Exception as e:
        if not _write_failure(e) or not main:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the previous checkpoint {previous} is intact" if previous else "there was no checkpoint yet"
        raise UserError(f"cannot save checkpoint {name} in {root}: {reason(e)}; nothing was lost: {kept} and the "
                        f"temporary folder was removed; free space and resume with --resume {out}") from None
    for old in checkpoints(out)[max(keep.last, 1):]:
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(found: list[Path], trained: Trained, device) -> dict:
    """Load the first of `found` (from `resume_point`) that reads back whole into the models; returns its state."""
    for ckpt in found:
        try:
            return _load(ckpt, trained, device)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read a file means this checkpoint is damaged
            print(f"warning: checkpoint {ckpt} is damaged ({reason(e)}); trying an older one", file=sys.stderr)
    raise UserError(f"--resume {found[0].parent.parent}: no checkpoint could be read (see the warnings); remove the "
                    f"folder to start over")


def _load(ckpt: Path, trained: Trained, device) -> dict:
    sharded = parallel.sharded(trained.policy)
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(f, device="cpu" if sharded else str(device)))
    if lora.active(trained.policy):
        missing, unexpected = lora.load_adapters(trained.policy, weights)
    else:
        missing, unexpected = parallel.load_full_state(trained.policy, weights)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # tied embeddings are not saved twice
        raise UserError(f"{ckpt}: checkpoint does not match the model ({len(missing)} missing, {len(unexpected)} extra)")
    parallel.unwrap(trained.policy).tie_weights()
    if (ckpt / "optimizer").is_dir():  # a --fsdp run's shards, on this or any other number of ranks
        parallel.load_sharded(ckpt / "optimizer", trained.optimizers())
    else:
        trained.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device))
    if trained.critic is not None:
        saved = torch.load(ckpt / "critic.pt", map_location="cpu" if sharded else device)
        parallel.load_full_state(trained.critic, saved["critic"])
        if "optimizer" in saved:
            trained.critic_opt.load_state_dict(saved["optimizer"])
    return json.loads((ckpt / "state.json").read_text())
