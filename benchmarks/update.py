"""Benchmark of the PPO update against its limit, and of a GRPO iteration against TRL's GRPOTrainer.

    python benchmarks/update.py --model DIR [--json] [--threads N] [--repeats 3] [--trl-script PATH]
    python benchmarks/update.py --shape qwen2.5-0.5b --device cuda [--micro-batch-tokens N] [--json]

With ``--shape``: one PPO update on random weights of a named shape on ``--device``, its seconds, model FLOPs
utilisation and peak memory (``benchmarks/shapes.py`` says how); the rest of this docstring is the CPU benchmark.

Workload: one GRPO iteration of the `arith-tiny` preset on the model (an SFT model of `arith`), with the
preset's settings as `vineppo train --algo grpo` resolves them: 16 prompts x 8 responses sampled by the engine
(T 0.6, top-p 0.9, at most 160 new tokens, the preset's token budget of 131,072), GRPO advantages, then the
update: 2 epochs of minibatch 64 in micro-batches of 32, k3 KL 1e-4 to the reference, AdamW lr 3e-5.
``--prompts`` and ``--max-new-tokens`` shrink it (a smoke run).

Reports (medians over --repeats, each repeat on the same sampled responses)
- update: completion tokens x epochs / seconds of the update (credit + reference log-probs + the epochs'
  forward, backward and optimiser steps; the old log-probs are the engine's sampling ones);
- limit: bare forward + backward passes of the same model over the update's own micro-batches (the same
  minibatch order and grouping, the same packing: each distinct prompt encoded once per micro-batch), loss =
  sum of the scored tokens' log-probs, no optimiser; tokens counted the same way;
- unshared_limit: the same passes with every prompt encoded once per response (the packing before prompt
  sharing), for reference;
- fraction_of_limit = update / limit;
- iteration: completion tokens / (sampling + update) seconds, the figure TRL's script prints;
- trl: when `trl` is importable (or --trl-python names a venv's python that has it), the peer script
  `trl_grpo.py` of ../shared/peers is run on the same model, once before each of our repeats (alternating),
  and the median of its completion tokens/s reported beside ours (vineppo_over_trl);
- the spread: every repeat's fraction of the limit, iteration tokens/s and ratio to its TRL run (``*_runs``), the
  range a second run should land in.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import shapes
import torch

from vineppo.core import config as configs
from vineppo.engine import Engine, SamplingParams
from vineppo.models.causal_lm import load_model, seeded_generator
from vineppo.models.prompts import Prompter
from vineppo.tasks import get_task
from vineppo.training import algorithms, ppo
from vineppo.training.forward import can_share, pack, token_logprobs
from vineppo.training.run import build_models
from vineppo.training.trainer import graded_episodes

PEER = Path(__file__).resolve().parents[2] / "shared" / "peers" / "trl_grpo.py"


def setup(model_dir: str, seed: int = 0, **smaller):
    """The model, its frozen reference, the optimiser, the prompter and the engine, as `vineppo train --algo grpo`
    builds them with the arith-tiny preset; `smaller`: settings that shrink the workload (prompts_per_iter, ...)."""
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "grpo", "model": model_dir, "seed": seed,
                                                              **smaller}, source="arith-tiny")
    task = get_task("arith")
    policy, tok = load_model(model_dir, device="cpu", verbose=False)
    models = build_models(cfg, policy, torch.device("cpu"))  # the set-up `vineppo train` makes
    prompter = Prompter(task, tok, cfg.prompt_format, model=model_dir)
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(task.stop))
    ctx = algorithms.Context(cfg=cfg, models=models, tokenizer=tok, engine=Engine(models.trained.policy, tok,
                             cfg.token_budget), params=params, score=task.score)
    return cfg, task, prompter, ctx


def sample(cfg, task, prompter, ctx, seed: int) -> tuple[list, float]:
    """One iteration's episodes (16 prompts x 8) and the seconds sampling took."""
    train = task.load("train", None, 0)
    examples = train[seed * cfg.prompts_per_iter:(seed + 1) * cfg.prompts_per_iter]
    ids = prompter.encode(examples)
    t0 = time.perf_counter()
    outputs = ctx.engine.generate(ids, cfg.samples_per_prompt, ctx.params, seeded_generator(ctx.models.policy, seed))
    took = time.perf_counter() - t0
    episodes = graded_episodes(task, ctx.tokenizer, [(g, ex, p, s) for g, (ex, p, samples)
                                                     in enumerate(zip(examples, ids, outputs)) for s in samples])
    return episodes, took


def time_update(episodes, ctx) -> float:
    """Seconds of the registered GRPO update on `episodes`."""
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    algorithms.ppo_family(episodes, dataclasses.replace(ctx, generator=gen, order_generator=gen))
    return time.perf_counter() - t0


def time_limit(episodes, ctx, share: bool) -> float:
    """Seconds of bare forward+backward passes over the update's own micro-batches (the same minibatch order,
    grouping and packing; `share`: prompts encoded once per micro-batch, as the update does on one process)."""
    cfg, policy = ctx.cfg, ctx.models.policy
    prompts, responses = [ep.prompt_ids for ep in episodes], [ep.response_ids for ep in episodes]
    gen = torch.Generator().manual_seed(0)  # time_update's order generator
    policy.train()
    t0 = time.perf_counter()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(episodes), generator=gen).tolist()
        for start in range(0, len(order), cfg.minibatch):
            for idx in ppo.micro_batches(order[start:start + cfg.minibatch], prompts, cfg.micro_batch):
                b = pack([prompts[i] for i in idx], [responses[i] for i in idx], ctx.tokenizer.pad_token_id,
                         share=share)
                logp, _ = token_logprobs(policy, b, cfg.temperature)
                (logp * b.mask).sum().backward()
    took = time.perf_counter() - t0
    policy.zero_grad(set_to_none=True)
    policy.eval()
    return took


def run_trl(model_dir: str, python: str, script: Path, threads: int) -> float | None:
    """TRL GRPOTrainer's completion tokens/s from the peer script (None when it cannot run)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PEER_DIR=str(Path(model_dir).resolve().parent / "peer-work"))
    done = subprocess.run([python, str(script), model_dir], capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        print(f"trl peer failed (rc {done.returncode}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    row = json.loads(lines[-1])
    return float(row["tokens_per_s"])


def _parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an SFT model folder of arith (vineppo sft); or --shape")
    p.add_argument("--shape", choices=sorted(shapes.SHAPES), help="random weights of this shape (see shapes.py)")
    p.add_argument("--device", default="cpu", help="with --shape: cpu or cuda")
    p.add_argument("--micro-batch", type=int, default=8, help="with --shape: episodes per micro-batch")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="with --shape: cut micro-batches by tokens")
    p.add_argument("--scale", type=float, default=1.0, help="with --shape: workload size (< 1: a smoke run)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=0, help="prompts per iteration (default: the preset's 16)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="new tokens at most (default: the preset's 160)")
    p.add_argument("--trl-python", default=None, help="python of a venv with trl==1.16.0 (default: this one if trl "
                                                       "is importable)")
    p.add_argument("--trl-script", default=str(PEER), help="the peer script trl_grpo.py")
    p.add_argument("--json", action="store_true")
    return p


def main() -> None:
    """Parse flags, run the workload, print the table (or one JSON line)."""
    p = _parser()
    args = p.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if args.shape:
        res = shapes.update_report(args.shape, torch.device(args.device), args.repeats, args.micro_batch,
                                   args.micro_batch_tokens, args.scale)
        print(json.dumps(res | {"command": "python benchmarks/update.py " + " ".join(sys.argv[1:])}))
        return
    if not args.model:
        p.error("--model or --shape is required")
    smaller = {k: v for k, v in (("prompts_per_iter", args.prompts), ("max_new_tokens", args.max_new_tokens)) if v}
    cfg, task, prompter, ctx = setup(args.model, **smaller)
    episodes, _ = sample(cfg, task, prompter, ctx, seed=99)  # warm-up of the engine and the update
    time_update(episodes, ctx)
    trl_python = args.trl_python or (sys.executable if importlib.util.find_spec("trl") else None)
    with_trl = bool(trl_python) and Path(args.trl_script).exists()
    rows, trl_runs = [], []
    for r in range(args.repeats):  # alternating with the peer's runs: drift over minutes hits both alike
        if with_trl:
            trl_runs.append(run_trl(args.model, trl_python, Path(args.trl_script), threads))
        episodes, sampling = sample(cfg, task, prompter, ctx, seed=r)
        tokens = sum(len(ep.response_ids) for ep in episodes)
        update, limit = time_update(episodes, ctx), time_limit(episodes, ctx, can_share(ctx.models.policy))
        plain = time_limit(episodes, ctx, share=False)
        rows.append(dict(tokens=tokens, sampling_s=sampling, update_s=update, limit_s=limit, plain_limit_s=plain))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out = dict(model=args.model, threads=threads, repeats=args.repeats, prompts_per_iter=cfg.prompts_per_iter,
               samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
               token_budget=cfg.token_budget, completion_tokens=med["tokens"],
               update_tokens_per_s=med["tokens"] * cfg.epochs / med["update_s"],
               limit_tokens_per_s=med["tokens"] * cfg.epochs / med["limit_s"],
               unshared_limit_tokens_per_s=med["tokens"] * cfg.epochs / med["plain_limit_s"],
               iteration_tokens_per_s=statistics.median(r["tokens"] / (r["sampling_s"] + r["update_s"]) for r in rows),
               sampling_s=med["sampling_s"], update_s=med["update_s"])
    out["fraction_of_limit"] = out["update_tokens_per_s"] / out["limit_tokens_per_s"]
    # the run-to-run spread: each repeat's own figures (a second run should land within these ranges)
    out["fraction_of_limit_runs"] = [r["limit_s"] / r["update_s"] for r in rows]
    out["iteration_runs_tokens_per_s"] = [r["tokens"] / (r["sampling_s"] + r["update_s"]) for r in rows]
    if with_trl and all(trl_runs):
        trl = statistics.median(trl_runs)
        out.update(trl_tokens_per_s=trl, trl_runs_tokens_per_s=trl_runs,
                   vineppo_over_trl=out["iteration_tokens_per_s"] / trl,
                   vineppo_over_trl_runs=[v / t for v, t in zip(out["iteration_runs_tokens_per_s"], trl_runs)])
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>24}: {v:,.3f}" if isinstance(v, float) else f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
