"""Supervised fine-tuning (`vineppo sft`) on a task's reference solutions (the starting point of RL).

Each example is a prompt and its reference response in the chosen prompt format (vineppo.models.prompts: plain
`Problem: ... Solution:` + " " + solution + EOS, or the chat template's user and assistant turns with the
end-of-turn token, or few-shot); the loss is the mean cross-entropy over the response tokens only. The
format is recorded in the output folder (`vineppo.json`), so `eval` and `train` reuse it. AdamW (or, with
`--optimizer muon`, Muon on the weight matrices and AdamW on the rest), linear warmup then cosine decay,
gradient clipping at 1.0, batches of similar length. The final model is written
atomically (temp folder, then rename), so a killed run never leaves half a model.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vineppo.core import config as configs
from vineppo.core.distributed import pick_device
from vineppo.core.errors import UserError
from vineppo.core.tracking import console
from vineppo.models.causal_lm import context_length, load_model, tiny_model
from vineppo.models.prompts import Prompter, check_format, save_format
from vineppo.tasks import get_task
from vineppo.training.runs import make_folder

# Defaults for the tiny model (trained from scratch) and for a pretrained model (fine-tuned).
TINY_DEFAULTS = dict(lr=3e-3, epochs=2.0, batch_size=32, warmup=0.03, optimizer="muon")  # 1,250 steps on arith
PRETRAINED_DEFAULTS = dict(lr=1e-5, epochs=3.0, batch_size=64, warmup=0.03, optimizer="adamw")
# arith's default SFT model ships with the package (made by the `vineppo sft` command in its README.md), so the
# main job needs no SFT first; `--model auto` on arith with its default data starts from it.
SHIPPED = Path(__file__).parents[1] / "assets" / "sft-arith"
OPTIMIZERS = ("muon", "adamw")
# Flag rules, checked before any model or data loads.
RULES = dict(lr=configs.POSITIVE, epochs=configs.POSITIVE, batch_size=configs.AT_LEAST_1, max_steps=configs.AT_LEAST_1,
             warmup=(lambda v: 0 <= v < 1, "must be >= 0 and < 1"), hidden=configs.AT_LEAST_1, layers=configs.AT_LEAST_1,
             optimizer=(lambda v: v in OPTIMIZERS, f"must be one of {', '.join(OPTIMIZERS)}"))


def default_sft_dir(task: str, data: str | None = None) -> Path:
    """Where `vineppo sft` writes the default SFT model for `task` (and `data`): runs/sft-<task>[-<data>]."""
    suffix = "-" + re.sub(r"[^\w.=-]+", "_", data) if data else ""
    return Path("runs") / f"sft-{task}{suffix}"


def default_model(task: str, data: str | None = None, train_missing: bool = False) -> Path:
    """The model `--model auto` means: the shipped SFT model for arith's default data, else default_sft_dir (trained
    with the defaults first when `train_missing` and it is not there yet)."""
    if task == "arith" and data is None and is_saved_model(SHIPPED):
        return SHIPPED
    return ensure_sft_model(task, data=data) if train_missing else default_sft_dir(task, data)


def is_saved_model(path: str | Path) -> bool:
    """True when `path` holds a complete saved model (config and weights)."""
    p = Path(path)
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin")))


def ensure_sft_model(task: str, out: str | Path | None = None, data: str | None = None, **hyperparams) -> Path:
    """The SFT model folder for `task`, training it with the defaults first if it does not exist yet."""
    out = Path(out) if out is not None else default_sft_dir(task, data)
    if is_saved_model(out):
        return out
    return run_sft(SFTConfig(task, out=out, data=data, **hyperparams))


def tokenize_examples(prompter: Prompter, examples, max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per example; examples longer than max_len are dropped."""
    data = []
    for ex in examples:
        p = prompter.prompt(ex)
        ids = p + prompter.target(ex)
        if len(ids) <= max_len:
            data.append((ids, len(p)))
    return data


def length_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of indices with similar lengths (sort within chunks of 50 batches)."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    chunk = batch_size * 50
    batches = []
    for s in range(0, len(idx), chunk):
        part = sorted(idx[s:s + chunk], key=lambda i: lengths[i])
        batches += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(items: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 on prompt and padding)."""
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(items):
        t = torch.tensor(ids)
        input_ids[i, :len(ids)] = t
        labels[i, n_prompt:len(ids)] = t[n_prompt:]
        mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def lr_at(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_optimizers(net: torch.nn.Module, name: str, lr: float) -> list[torch.optim.Optimizer]:
    """AdamW on every parameter ('adamw'), or Muon on the weight matrices and AdamW on the rest ('muon')."""
    if name == "adamw":
        decay = [p for p in net.parameters() if p.ndim >= 2]
        no_decay = [p for p in net.parameters() if p.ndim < 2]
        return [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))]
    matrices = [p for p in net.parameters() if p.ndim == 2]
    others = [p for p in net.parameters() if p.ndim != 2]
    return [Muon(matrices, lr=lr, weight_decay=0.1), torch.optim.AdamW(others, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)]


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) for 2-D weights: Nesterov momentum, orthogonalised by 5 Newton-Schulz steps, the
    step scaled to AdamW's size (0.2 sqrt(max(rows, columns)), torch.optim.Muon's `match_rms_adamw`), so one
    learning rate serves both optimisers. torch.optim.Muon runs Newton-Schulz in bfloat16, which a CPU without
    bf16 matrix units runs ~40x slower than float32 (3.4x slower SFT steps on the 2-core machine); this one
    runs it in float32 on CPU, bfloat16 on GPU."""

    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = newton_schulz(p.grad.lerp(buf, group["momentum"]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximate orthogonalisation U V^T of g = U S V^T (Muon's quintic iteration, coefficients 3.4445, -4.775,
    2.0315): singular values land in about [0.5, 1.5], which trains as well as exact ones."""
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.T if tall else x


def temp_dir(out: Path) -> Path:
    """A fresh temp folder next to `out`, where a run writes until it is complete."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed run (SIGKILL cannot be caught)
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_folder(tmp, f"--out {out}")
    return tmp


def _alive(pid: int) -> bool:
    """True when process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def save_atomic(model, tokenizer, tmp: Path, out: Path) -> None:
    """Save model + tokenizer into the temp folder `tmp`, then swap it into place as `out`."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class SFTConfig:
    """The settings of one `vineppo sft` run; None takes the tiny or pretrained default (TINY_DEFAULTS, ...)."""

    task: str = "arith"  # task registry name
    model: str = "tiny"  # hub id, folder, .gguf file, or 'tiny' (build the small CPU model from scratch)
    out: str | Path | None = None  # output folder (None: runs/sft-<task>)
    data: str | None = None  # data file for tasks that read one
    epochs: float | None = None  # passes over the data
    lr: float | None = None  # peak learning rate (warmup then cosine decay to 10%)
    optimizer: str | None = None  # muon (Muon on the weight matrices, AdamW on the rest) or adamw
    batch_size: int | None = None  # examples per step
    max_steps: int | None = None  # stop after this many steps (overrides epochs)
    warmup: float | None = None  # warmup fraction of the steps
    seed: int = 0  # initialisation, tokenizer data and batch order
    device: str | None = None  # cpu, cuda or cuda:N (None: cuda if available)
    bf16: bool | None = None  # bfloat16 autocast (None: on for CUDA GPUs that support it)
    arch: str = "llama"  # tiny model architecture: llama, qwen2 or gpt2
    hidden: int | None = None  # tiny model width
    layers: int | None = None  # tiny model depth
    grad_checkpointing: bool = False  # recompute activations in the backward pass (large models)
    log_every: int = 10  # steps between rows of metrics.jsonl
    progress: bool = True  # a progress bar on a terminal, progress lines otherwise
    prompt_format: str | None = None  # plain, chat, fewshot:N or auto (recorded in the output folder)
    prompt_column: str | None = None  # task custom: the prompt's column (None: prompt, else messages)
    completion_column: str | None = None  # task custom: the reference completion's column, the SFT target


def run_sft(cfg: SFTConfig) -> Path:
    """Fine-tune `cfg.model` (hub id, folder, or 'tiny' = build from scratch) on the task's train split; returns the output folder."""
    task_name, model, data, seed = cfg.task, cfg.model, cfg.data, cfg.seed
    lr, epochs, batch_size, max_steps, warmup = cfg.lr, cfg.epochs, cfg.batch_size, cfg.max_steps, cfg.warmup
    hidden, layers, prompt_format = cfg.hidden, cfg.layers, cfg.prompt_format
    configs.check_flags(dict(lr=lr, epochs=epochs, batch_size=batch_size, max_steps=max_steps, warmup=warmup,
                             hidden=hidden, layers=layers, optimizer=cfg.optimizer), RULES)
    task = get_task(task_name, cfg)
    out = Path(cfg.out) if cfg.out is not None else default_sft_dir(task_name, data)
    dev = pick_device(cfg.device)
    check_format(prompt_format or "auto")  # a bad flag or file fails before a model loads
    examples = task.load("train", data, seed)
    if not examples:
        raise UserError(f"task {task_name!r}: the training set is empty")
    if not any(ex.solution for ex in examples):
        raise UserError(f"task {task_name!r}: the training examples have no reference completions to train on "
                        f"(task custom: name their column with --completion-column)")
    torch.manual_seed(seed)
    if model == "tiny":
        net, tokenizer = tiny_model(task, seed=seed, arch=cfg.arch, data=data, hidden=hidden, layers=layers)
        net.to(dev)
        defaults = TINY_DEFAULTS
    else:
        net, tokenizer = load_model(model, device=str(dev), dtype=torch.float32)
        defaults = PRETRAINED_DEFAULTS
    hp = {k: v if v is not None else defaults[k] for k, v in
          dict(lr=lr, epochs=epochs, batch_size=batch_size, warmup=warmup, optimizer=cfg.optimizer).items()}
    use_bf16 = (dev.type == "cuda" and torch.cuda.is_bf16_supported()) if cfg.bf16 is None else cfg.bf16

    prompter = Prompter(task, tokenizer, prompt_format, model=None if model == "tiny" else model, data=data, seed=seed)
    items = tokenize_examples(prompter, examples, context_length(net))
    if not items:
        raise UserError(f"task {task_name!r}: every training example is longer than the model's context")
    if len(items) < len(examples):  # never a silent skip: say how many did not fit
        print(f"sft: {len(examples) - len(items)} of {len(examples)} examples are longer than the model's context "
              f"({context_length(net)} tokens) and are left out", file=sys.stderr)
    per_epoch = math.ceil(len(items) / hp["batch_size"])
    total = max_steps if max_steps is not None else math.ceil(per_epoch * hp["epochs"])
    if total < 1:
        raise UserError("--max-steps must be at least 1")
    warm = max(1, int(hp["warmup"] * total))

    if cfg.grad_checkpointing:
        net.gradient_checkpointing_enable()
    net.train()
    opts = make_optimizers(net, hp["optimizer"], hp["lr"])
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, total, warm)) for opt in opts]

    config = dict(task=task_name, model=model, data=data, seed=seed, steps=total, examples=len(items),
                  device=str(dev), bf16=use_bf16, arch=cfg.arch if model == "tiny" else None,
                  prompt_format=prompter.format, **hp)
    t0 = time.time()
    tmp = temp_dir(out)
    try:
        _fit(Loop(net, opts, scheds, items, hp["batch_size"], total, tokenizer.pad_token_id, dev, use_bf16), cfg, tmp)
        config["time_s"] = round(time.time() - t0, 1)
        (tmp / "sft_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_format(tmp, prompter.format)
        save_atomic(net, tokenizer, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass
class Loop:
    """What the SFT loop works on."""

    net: torch.nn.Module
    opts: list[torch.optim.Optimizer]  # one per parameter group (Muon's matrices, AdamW's rest)
    scheds: list[torch.optim.lr_scheduler.LambdaLR]  # the same schedule for each optimiser
    items: list[tuple[list[int], int]]  # (token ids, prompt length) per example
    batch_size: int
    total: int  # optimiser steps
    pad_id: int
    device: torch.device
    bf16: bool  # bfloat16 autocast


def _fit(loop: Loop, cfg: SFTConfig, tmp: Path) -> None:
    """The training loop; metrics go to tmp/metrics.jsonl as it runs."""
    net, items, total, dev = loop.net, loop.items, loop.total, loop.device
    progress, log_every = cfg.progress, cfg.log_every
    rng, lengths = random.Random(cfg.seed), [len(ids) for ids, _ in items]
    batches: list[list[int]] = []
    t0, tokens, loss_sum, loss_n = time.time(), 0, 0.0, 0
    bar = _progress(progress)
    lines = progress and not console.is_terminal  # rich draws nothing into a file or pipe: print lines there instead
    line_every = max(1, total // 20)
    with bar, open(tmp / "metrics.jsonl", "w") as log:
        job = bar.add_task("sft", total=total, loss=float("nan"), tps=0.0)
        for step in range(total):
            if not batches:
                batches = length_batches(lengths, loop.batch_size, rng)
            batch = {k: v.to(dev) for k, v in collate([items[i] for i in batches.pop()], loop.pad_id).items()}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=loop.bf16):
                loss = net(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            for opt, sched in zip(loop.opts, loop.scheds):
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            tokens += int(batch["attention_mask"].sum())
            step_loss = loss.item()
            loss_sum, loss_n = loss_sum + step_loss, loss_n + 1
            if (step + 1) % log_every == 0 or step + 1 == total:
                elapsed = time.time() - t0
                row = dict(step=step + 1, loss=round(loss_sum / loss_n, 5), lr=loop.scheds[0].get_last_lr()[0],
                           tokens_per_s=round(tokens / elapsed, 1), elapsed_s=round(elapsed, 1))
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.update(job, loss=row["loss"], tps=row["tokens_per_s"])
                loss_sum, loss_n = 0.0, 0
            if lines and ((step + 1) % line_every == 0 or step + 1 == total):
                _print_line(step + 1, total, step_loss, tokens, time.time() - t0)
            bar.update(job, advance=1)
    net.eval()


def _print_line(step: int, total: int, loss: float, tokens: int, elapsed: float) -> None:
    """One plain progress line (5% of the steps apart) for output that is not a terminal."""
    left = elapsed * (total - step) / step
    print(f"sft: step {step}/{total} ({100 * step // total}%)  loss {loss:.4f}  {tokens / elapsed:,.0f} tok/s  "
          f"{elapsed:.0f}s elapsed, ~{left:.0f}s left", file=sys.stderr, flush=True)


def _progress(enabled: bool) -> Progress:
    """The terminal progress bar of the SFT loop."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:.0f} tok/s"),
                    TimeElapsedColumn(), TimeRemainingColumn(), disable=not enabled)
