"""An iteration of each algorithm against a GRPO iteration on the main job, from the runs' own metrics.

    python benchmarks/iteration.py [--algos vineppo,grpo] [--iterations 6] [--rounds 2] [--threads 2] [--src DIR]
                                   [--device cuda] [--shape qwen2.5-0.5b] [--variant NAME=ALGO:FLAGS] [--json]
                                   [-- TRAIN FLAGS]

Each round runs `vineppo train --algo A` once for each algorithm A (in turn, one at a time, in fresh
processes), both from the shipped SFT model with the main job's preset and the same seed, and reads
time/sampling_s, time/credit_s and time/update_s from their metrics.jsonl. Iteration 1 is the same batch for
both algorithms (same seed, same prompts, same samples); later iterations sample from policies that have
moved apart, so their medians compare like workloads, not identical ones. Per algorithm: the median
iteration and its phases, the tokens it trains on per iteration (the responses, and the Monte Carlo
continuations that train too) and per second, and its `ratio_to_grpo` (median iteration over GRPO's; GRPO is
always run). ``--src`` runs another checkout's
package (its src/ folder) instead of the installed one, for before/after comparisons; flags after ``--`` go to
`vineppo train` (e.g. ``-- --mc-k 3``). ``--device`` is `vineppo train`'s (default: its own choice). ``--variant
NAME=ALGO:FLAGS`` (repeatable) adds a method of its own name, an algorithm with flags of its own, run in turn with the
others in every round (``--variant "vineppo-entropy=vineppo:--mc-states entropy:2"``).

``--shape`` times the phases at a named model shape (``benchmarks/shapes.py``), not learning: the runs start from
random weights of that shape (seed 0, saved once as a model folder with the shipped SFT model's tokenizer), so
every reward is 0. A random model spreads its probability over the whole vocabulary, so the last 1% of the
vocabulary's ids are made end-of-sequence tokens: responses end after about 80 tokens (1 - 0.99^160 of them
before the preset's 160-token cap), as a trained model's do, instead of all running to the cap (an iteration whose
responses all hit the cap stops the run). Most of its tokens are outside the tokenizer's vocabulary and decode to
nothing, so its text has no line breaks and VinePPO's states are set 20 tokens apart (``--mc-states tokens:20``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SFT = Path(__file__).resolve().parents[1] / "src" / "vineppo" / "assets" / "sft-arith"  # its tokenizer, for --shape
PARTS = ("time/sampling_s", "time/credit_s", "time/update_s")
TRAINED = "train/trained_tokens"  # response tokens the update trains on in an iteration (with tree rollouts' too)


def run(algo: str, out: Path, args, extra: list[str]) -> list[dict]:
    """One training run of `algo` (an algorithm, or a --variant's name); its per-iteration time records."""
    algo, extra = (args.variants[algo][0], [*extra, *args.variants[algo][1]]) if algo in args.variants else (algo, extra)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    cmd = [sys.executable, "-m", "vineppo", "train", "--algo", algo, "--iterations", str(args.iterations),
           "--eval-every", "0", "--save-every", "0", "--seed", str(args.seed), "--out", str(out), "--json", *extra]
    if getattr(args, "device", ""):
        cmd += ["--device", args.device]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{p: r.get(p, 0.0) for p in (*PARTS, TRAINED)} | {"iteration": r["iteration"]} for r in rows if PARTS[0] in r]


def summary(runs: list[list[dict]]) -> dict:
    """Medians over rounds of iteration 1, and of every iteration, per part and in all."""
    first = [r[0] for r in runs]
    every = [it for r in runs for it in r]
    total = lambda rs: statistics.median(sum(x[p] for p in PARTS) for x in rs)  # noqa: E731
    out = {"iteration_1_s": total(first), "median_iteration_s": total(every),
           **{f"median_{p.split('/')[1]}": statistics.median(x[p] for x in every) for p in PARTS}}
    if all(TRAINED in x for x in every):
        out["median_trained_tokens"] = statistics.median(x[TRAINED] for x in every)
        out["trained_tokens_per_s"] = out["median_trained_tokens"] / out["median_iteration_s"]
    return out


def shaped_model(shape: str, folder: Path) -> Path:
    """A model folder with random weights of ``shape`` (float32, as a run loads them), the last 1% of its vocabulary's
    ids end-of-sequence tokens, and the SFT model's tokenizer."""
    import shapes
    import torch  # torch and transformers (shapes), only for --shape: the runs themselves are subprocesses

    model = shapes.random_model(shape, torch.device("cpu"), torch.float32)
    V = model.config.vocab_size
    model.generation_config.eos_token_id = list(range(V - V // 100, V))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vineppo.json"):
        shutil.copy(SFT / name, folder / name)
    return folder


def run_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of a benchmark made of `run`s (this one and dtype.py)."""
    ap.add_argument("--algos", default="vineppo,grpo", help="comma-separated algorithms (grpo is always run)")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--src", default="", help="a checkout's src/ folder to run instead of the installed package")
    ap.add_argument("--device", default="", help="vineppo train's --device (default: its own choice)")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(variants={})  # --variant's methods, where a benchmark takes them


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(ap)
    ap.add_argument("--shape", default="", help="random weights of a named shape (benchmarks/shapes.py): phases, not learning")
    ap.add_argument("--variant", action="append", default=[], help="NAME=ALGO:FLAGS, a method of its own (repeatable)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.variants = {v.split("=", 1)[0]: (v.split("=", 1)[1].split(":", 1)[0], v.split(":", 1)[1].split())
                     for v in args.variant}
    names = [a for a in args.algos.split(",") if a and a != "grpo"] + list(args.variants) + ["grpo"]
    runs: dict[str, list] = {a: [] for a in names}
    with tempfile.TemporaryDirectory() as tmp:
        flags = extra
        if args.shape:
            flags = ["--model", str(shaped_model(args.shape, Path(tmp) / args.shape)), "--mc-states", "tokens:20", *extra]
        for r in range(args.rounds):
            for algo in runs:
                runs[algo].append(run(algo, Path(tmp) / f"{algo}-{r}", args, flags))
                print(f"round {r + 1} {algo}: {summary(runs[algo][-1:])['median_iteration_s']:.2f} s per iteration",
                      file=sys.stderr)
    res = {"command": "python benchmarks/iteration.py " + " ".join(argv), "shape": args.shape or None,
           "device": args.device or None, "iterations": args.iterations, "rounds": args.rounds,
           "threads": args.threads, "train_flags": extra,
           "versions": {p: importlib.metadata.version(p) for p in ("torch", "transformers")},
           **{a: summary(runs[a]) for a in names}, "runs": runs}
    for a in names:
        res[a]["ratio_to_grpo"] = res[a]["median_iteration_s"] / res["grpo"]["median_iteration_s"]
    if "vineppo" in runs:  # the keys earlier files have
        res["ratio_iteration_1"] = res["vineppo"]["iteration_1_s"] / res["grpo"]["iteration_1_s"]
        res["ratio_median_iteration"] = res["vineppo"]["ratio_to_grpo"]
    if args.json:
        print(json.dumps(res))
        return
    for algo in names:
        s = res[algo]
        print(f"{algo:12s} iteration 1 {s['iteration_1_s']:.2f} s, median {s['median_iteration_s']:.2f} s "
              f"(sampling {s['median_sampling_s']:.2f}, credit {s['median_credit_s']:.2f}, update "
              f"{s['median_update_s']:.2f}), {s['ratio_to_grpo']:.2f}x GRPO"
              + (f", {s['trained_tokens_per_s']:.0f} trained tokens/s" if "trained_tokens_per_s" in s else ""))


if __name__ == "__main__":
    main()
