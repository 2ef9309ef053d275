"""Peak memory per rank of one training iteration, and update tokens/s, for a real-size model.

    python benchmarks/memory.py [--json] [--configs default,bf16,...] [--episodes 8] [--prompt 64]
        [--response 128] [--micro-batch 4] [--layers 30] [--out results/memory/raw.json]

Model: a randomly initialised Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP
1536, vocabulary 49152, tied embeddings: 134.5M parameters), saved once to a temporary folder. Every
configuration runs in fresh processes (one rank; `fsdp2`: two ranks under torchrun, gloo on CPU) that build
the models exactly as `vineppo train` does (`train.build_models`: policy, reference, LoRA, sharding,
optimiser), then do one iteration's memory-relevant work:
- sampling: the engine generates 16 tokens for 8 prompts inside `parallel.sampling` (FSDP: weights gathered);
- update: `ppo_update` on --episodes random episodes of --prompt + --response tokens (one epoch, one
  optimiser step, micro-batches of --micro-batch episodes over all ranks' shares).

Memory is the resident set of each rank above its size before any model existed (on CUDA: the allocator's
bytes), in bytes per parameter of the 134.5M-parameter model: `setup` after set-up; `static` after the
update's optimiser step (weights, reference, gradients, AdamW state); the high-water marks (VmHWM, reset
through /proc/self/clear_refs) during sampling and during the update; `gathered` = sampling peak - setup.
Tokens/s: all tokens of the episodes (prompt + response) over the wall-clock time of `ppo_update` (both
no-grad scoring passes, forward and backward, the step).

Projection to a 7B model (P = 7e9 parameters, Llama-7B shape: hidden 4096, 32 layers):
    memory per GPU = static_bpp * P  +  gathered_bpp * P  +  activations * (4096 * 32) / (576 * 30)
static_bpp: the measured static bytes per parameter (for FSDP on N GPUs: the 2-rank figure * 2 / N, since
weights, gradients and AdamW state are split over the ranks); gathered_bpp: what sampling adds per parameter
(FSDP's whole-weights copy; ~0 for replicated models); activations: the measured update peak above static,
scaled by hidden size * layers (the activation stack grows with both; the logits part does not, so this
over-estimates a little). Replicated configurations (everything but FSDP) need the same per GPU on 8 GPUs.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig, validate
from vineppo.engine import Engine, SamplingParams
from vineppo.models import parallel
from vineppo.models.causal_lm import load_model, train_tokenizer
from vineppo.training.ppo import Learner, Rollouts, UpdateConfig, ppo_update
from vineppo.training.run import build_models, policy_dtype

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
CONFIGS = {  # name -> (TrainConfig fields, ranks)
    "default": ({}, 1),
    "kl0": ({"kl_coef": 0.0}, 1),  # no KL penalty: no reference model is built
    "bf16": ({"dtype": "bfloat16"}, 1),
    "checkpointing": ({"gradient_checkpointing": True}, 1),
    "lora16": ({"lora_r": 16, "lora_alpha": 32.0}, 1),
    "lora16-bf16-ckpt": ({"lora_r": 16, "lora_alpha": 32.0, "dtype": "bfloat16", "gradient_checkpointing": True}, 1),
    "fsdp2": ({"fsdp": True}, 2),
}
P_7B, SCALE_7B = 7.0e9, (4096 * 32) / (576 * 30)


def build_model(folder: Path, layers: int) -> int:
    """Save the random SmolLM2-135M-shaped Llama (and a small tokenizer) in `folder`; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOL, "num_hidden_layers": layers}))
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer(["0123456789 + - * / = abc def"], vocab_size=300).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _status(key: str) -> int:
    """A VmRSS / VmHWM figure of this process in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc keeps it, so the resident set would never shrink)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the resident set then over-states `static`
        pass


class Meter:
    """Resident memory (CPU: VmRSS / VmHWM) or allocated memory (CUDA) above a baseline, with resettable peaks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = self.now()

    def now(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        _trim()
        return _status("VmRSS")

    def reset(self) -> None:
        _trim()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS

    def peak(self) -> int:
        return (torch.cuda.max_memory_allocated() if self.cuda else _status("VmHWM")) - self.base


def one(name: str, folder: str, args: argparse.Namespace) -> dict:
    """Run configuration `name` on this rank; its measurements."""
    torch.set_num_threads(args.threads)
    device = dist.init("auto")
    meter = Meter(device)
    fields, _ = CONFIGS[name]
    cfg = validate(TrainConfig(**fields, model=folder, epochs=1, minibatch=args.episodes, micro_batch=args.micro_batch,
                               lr=1e-6))
    policy, tokenizer = load_model(folder, device=str(device), dtype=policy_dtype(cfg), verbose=False)
    n_params = sum(p.numel() for p in policy.parameters())
    models = build_models(cfg, policy, device)
    policy = models.trained.policy
    for model in (policy, models.reference):  # transformers maps weight files lazily: page every weight in now
        plain = isinstance(model, torch.nn.Module) and not parallel.sharded(model)  # (shards are copies already)
        for t in model.state_dict().values() if plain else []:
            float(t.sum())
    setup = meter.now() - meter.base
    meter.reset()
    g = torch.Generator().manual_seed(0)
    with parallel.sampling(device, cfg.dtype, policy):
        prompts = [torch.randint(300, 49152, (args.prompt,), generator=g).tolist() for _ in range(8)]
        Engine(policy, tokenizer).generate(prompts, 1, SamplingParams(1.0, 1.0, 16), torch.Generator(device=device))
    sampling = meter.peak()
    mine = list(range(args.episodes))[dist.rank()::dist.world()]
    prompts = [torch.randint(300, 49152, (args.prompt,), generator=g).tolist() for _ in range(args.episodes)]
    responses = [torch.randint(300, 49152, (args.response,), generator=g).tolist() for _ in range(args.episodes)]
    advantages = [torch.randn(args.response, generator=g) for _ in range(args.episodes)]
    update_cfg = UpdateConfig(1, args.episodes, args.micro_batch, cfg.clip, cfg.kl_coef, cfg.temperature,
                              cfg.grad_clip, cfg.value_clip, cfg.dtype)
    policy.train()
    meter.reset()
    start = time.perf_counter()
    data = Rollouts([prompts[i] for i in mine], [responses[i] for i in mine], [advantages[i] for i in mine],
                    tokenizer.pad_token_id, ids=mine)
    ppo_update(Learner(models.policy, models.reference, models.trained.optimizer), data, update_cfg, torch.Generator())
    seconds = time.perf_counter() - start
    update = meter.peak()
    static = meter.now() - meter.base  # after the step: weights, reference, gradients, AdamW state
    return {"config": name, "rank": dist.rank(), "ranks": dist.world(), "device": str(device), "params": n_params,
            "setup_bytes": setup, "static_bytes": static, "sampling_peak_bytes": sampling, "update_peak_bytes": update,
            "update_s": seconds, "update_tokens": args.episodes * (args.prompt + args.response),
            "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k in ("dtype", "fsdp", "lora_r",
                                                                                    "gradient_checkpointing")}}


def summarise(rows: list[dict]) -> dict:
    """Per configuration: the largest rank's figures in bytes per parameter, tokens/s and the 7B projections."""
    out = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        n, ranks = rs[0]["params"], rs[0]["ranks"]
        static = max(r["static_bytes"] for r in rs) / n
        sampling = max(r["sampling_peak_bytes"] for r in rs) / n
        update = max(r["update_peak_bytes"] for r in rs) / n
        gathered = max(max(r["sampling_peak_bytes"] - r["setup_bytes"] for r in rs) / n, 0.0)
        acts = max(update - static, 0.0) * n * SCALE_7B
        gb = lambda bpp, shards: (bpp * ranks / shards) * P_7B  # noqa: E731 - sharded state splits over the GPUs
        sharded = CONFIGS[name][0].get("fsdp", False)
        one_gpu = None if sharded else (static * P_7B + gathered * P_7B + acts) / 1e9
        eight = ((gb(static, 8) if sharded else static * P_7B) + gathered * P_7B + acts) / 1e9
        setup = max(r["setup_bytes"] for r in rs) / n
        out[name] = {"ranks": ranks, "setup_bytes_per_param": round(setup, 2),
                     "static_bytes_per_param": round(static, 2),
                     "sampling_peak_bytes_per_param": round(sampling, 2),
                     "gathered_bytes_per_param": round(gathered, 2),
                     "update_peak_bytes_per_param": round(update, 2),
                     "update_tokens_per_s": round(rs[0]["update_tokens"] / max(r["update_s"] for r in rs), 1),
                     "projected_7b_gb_one_gpu": None if one_gpu is None else round(one_gpu, 1),
                     "projected_7b_gb_per_gpu_of_8": round(eight, 1)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30, help="fewer layers for a quick check of the script")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the raw rows and the summary to this JSON file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration on this rank
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        row = one(args.one, args.model, args)
        Path(f"{args.result}.{row['rank']}").write_text(json.dumps(row))
        dist.shutdown()
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "model", args.layers)
        for name in args.configs.split(","):
            ranks = CONFIGS[name][1]
            launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                        if ranks > 1 else [sys.executable])
            result = Path(tmp) / name
            child = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--json",)]
            subprocess.run([*launcher, __file__, *child, "--one", name, "--model", str(Path(tmp) / "model"),
                            "--result", str(result)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows += [json.loads(Path(f"{result}.{r}").read_text()) for r in range(ranks)]
            print(f"{name}: done", file=sys.stderr)
    report = {"model": {**SMOL, "num_hidden_layers": args.layers, "params": rows[0]["params"]},
              "workload": {k: getattr(args, k) for k in ("episodes", "prompt", "response", "micro_batch")},
              "device": rows[0].get("device", "cpu"), "summary": summarise(rows), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        for name, s in report["summary"].items():
            print(name, json.dumps(s))


if __name__ == "__main__":
    main()
