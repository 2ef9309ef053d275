"""A VinePPO iteration against a GRPO iteration on the main job, from the runs' own metrics.

    python benchmarks/iteration.py [--iterations 6] [--rounds 2] [--threads 2] [--src DIR] [--json] [-- TRAIN FLAGS]

Each round runs `vineppo train --algo vineppo` and `--algo grpo` once each (alternating, one at a time, in
fresh processes), both from the shipped SFT model with the main job's preset and the same seed, and reads
time/sampling_s, time/credit_s and time/update_s from their metrics.jsonl. Iteration 1 is the same batch for
both algorithms (same seed, same prompts, same samples); later iterations sample from policies that have
moved apart, so their medians compare like workloads, not identical ones. ``--src`` runs another checkout's
package (its src/ folder) instead of the installed one, for before/after comparisons; flags after ``--`` go to
`vineppo train` (e.g. ``-- --mc-k 3``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PARTS = ("time/sampling_s", "time/credit_s", "time/update_s")


def run(algo: str, out: Path, args, extra: list[str]) -> list[dict]:
    """One training run; its per-iteration time records."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    cmd = [sys.executable, "-m", "vineppo", "train", "--algo", algo, "--iterations", str(args.iterations),
           "--eval-every", "0", "--save-every", "0", "--seed", str(args.seed), "--out", str(out), "--json", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{p: r.get(p, 0.0) for p in PARTS} | {"iteration": r["iteration"]} for r in rows if PARTS[0] in r]


def summary(runs: list[list[dict]]) -> dict:
    """Medians over rounds of iteration 1, and of every iteration, per part and in all."""
    first = [r[0] for r in runs]
    every = [it for r in runs for it in r]
    total = lambda rs: statistics.median(sum(x[p] for p in PARTS) for x in rs)  # noqa: E731
    return {"iteration_1_s": total(first), "median_iteration_s": total(every),
            **{f"median_{p.split('/')[1]}": statistics.median(x[p] for x in every) for p in PARTS}}


def run_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of a benchmark made of `run`s (this one and dtype.py)."""
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--src", default="", help="a checkout's src/ folder to run instead of the installed package")
    ap.add_argument("--json", action="store_true")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(ap)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    runs: dict[str, list] = {"vineppo": [], "grpo": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for algo in runs:
                runs[algo].append(run(algo, Path(tmp) / f"{algo}-{r}", args, extra))
                print(f"round {r + 1} {algo}: {summary(runs[algo][-1:])['median_iteration_s']:.2f} s per iteration",
                      file=sys.stderr)
    res = {"iterations": args.iterations, "rounds": args.rounds, "threads": args.threads, "train_flags": extra,
           "vineppo": summary(runs["vineppo"]), "grpo": summary(runs["grpo"]), "runs": runs}
    res["ratio_iteration_1"] = res["vineppo"]["iteration_1_s"] / res["grpo"]["iteration_1_s"]
    res["ratio_median_iteration"] = res["vineppo"]["median_iteration_s"] / res["grpo"]["median_iteration_s"]
    if args.json:
        print(json.dumps(res))
        return
    for algo in ("vineppo", "grpo"):
        s = res[algo]
        print(f"{algo:8s} iteration 1 {s['iteration_1_s']:.2f} s, median {s['median_iteration_s']:.2f} s "
              f"(sampling {s['median_sampling_s']:.2f}, credit {s['median_credit_s']:.2f}, update {s['median_update_s']:.2f})")
    print(f"VinePPO / GRPO: iteration 1 (same batch) {res['ratio_iteration_1']:.2f}x, "
          f"median iteration {res['ratio_median_iteration']:.2f}x")


if __name__ == "__main__":
    main()
