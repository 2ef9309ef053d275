"""The learning runs of the regimes study (PROTOCOL.md): every condition x seed x method, one `vineppo train` at a
time on 2 threads, each ended by its budget of training seconds. Finished runs (summary.json) are kept, so a stopped
study continues where it stopped; a run's checkpoint is removed after it (the study reads its metrics). The order is
the protocol's: condition by condition, seed by seed, the methods in turn.

    python results/regimes/run.py --scratch $SCRATCH [--conditions hard,cutoff,groups-2,groups-4,long,game]
        [--seeds 0,1,2] [--methods ...]

$SCRATCH holds the start models and the chosen prompts and budget (choose.py, commands.txt) and receives the runs
in $SCRATCH/study/<condition>/<method>-s<seed>/ (the final checkpoint kept for the conditions of the held-out
shift, KEEP).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

# Each method: the `vineppo train` flags that make it (its ALGOS settings, and the study's two VinePPO variants).
# `vineppo` and `grpo` say whitening: the default when the study ran, `scale` since (the study's H6 rule).
METHODS = {
    "vineppo": ["--algo", "vineppo", "--advantage-norm", "whiten"],  # batch whitening, the paper's normalisation
    "vineppo-scale": ["--algo", "vineppo", "--advantage-norm", "scale"],  # a zero advantage stays zero
    "vineppo-entropy": ["--algo", "vineppo", "--advantage-norm", "scale", "--mc-states", "entropy:2"],
    "tempo": ["--algo", "tempo"],
    "grpo": ["--algo", "grpo", "--advantage-norm", "whiten"],
    "grpo-scale": ["--algo", "grpo", "--advantage-norm", "scale"],
    "dr-grpo": ["--algo", "dr-grpo"],
}
KEEP = ("hard", "groups-2", "groups-4")  # conditions whose final models the held-out shift evaluates
GAME_METHODS = ("vineppo-chosen", "grpo", "dr-grpo")  # the multi-turn condition: the normalisation chosen on the others
ARITH = ["--config", "arith-tiny", "--eval-every", "5"]
LONG = "min_ops=8,max_ops=12,premature=0"


def condition_flags(condition: str, scratch: Path) -> list[str]:
    """The `vineppo train` flags of a condition (PROTOCOL.md's table); `select.json` holds what choose.py chose."""
    chosen = json.loads((scratch / "select.json").read_text()) if (scratch / "select.json").exists() else {}
    return {
        "hard": ARITH + ["--train-ids", str(scratch / "hard-ids.txt"), "--time-budget-s", "90"],
        "cutoff": ARITH + ["--max-new-tokens", str(chosen.get("cutoff_tokens", 0)), "--time-budget-s", "90"],
        "groups-2": ARITH + ["--prompts-per-iter", "64", "--samples-per-prompt", "2", "--time-budget-s", "90"],
        "groups-4": ARITH + ["--prompts-per-iter", "32", "--samples-per-prompt", "4", "--time-budget-s", "90"],
        "long": ARITH + ["--model", str(scratch / "sft-long"), "--data", LONG, "--eval-data", LONG,
                         "--max-new-tokens", str(chosen.get("long_tokens", 0)), "--time-budget-s", "180"],
        "game": ["--config", "results/regimes/game.yaml", "--time-budget-s", "600"],
    }[condition]


def method_flags(method: str, scratch: Path) -> list[str]:
    """A method's flags; `vineppo-chosen` is VinePPO with the normalisation the single-turn conditions chose."""
    if method == "vineppo-chosen":
        norm = json.loads((scratch / "chosen-norm.json").read_text())["advantage_norm"]
        return ["--algo", "vineppo", "--advantage-norm", norm]
    return METHODS[method]


def train(job: tuple[str, str, str], scratch: Path, core: int | None) -> None:
    """One run (condition, method, seed): on one thread pinned to `core`, or on 2 threads when `core` is None."""
    condition, method, seed = job
    out = scratch / "study" / condition / f"{method}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run starts again: its clock must be whole
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vineppo", "train", *method_flags(method, scratch), "--seed", seed, "--out", str(out),
           "--iterations", "1000", "--save-every", "0", "--tensorboard", "false", "--json",
           *condition_flags(condition, scratch)]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1" if core is not None else "2")
    start = time.time()
    with open(out.parent / f"{method}-s{seed}.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if condition not in KEEP:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print(f"{condition} {method} seed {seed}: exit {code}, {time.time() - start:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", required=True, type=Path)
    ap.add_argument("--conditions", default="groups-4,groups-2,hard,cutoff,long,game")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=None, help="default: every method of the condition")
    args = ap.parse_args()
    jobs = [(c, m, s) for c in args.conditions.split(",") for s in args.seeds.split(",")
            for m in (args.methods.split(",") if args.methods else (GAME_METHODS if c == "game" else METHODS))
            if not (args.scratch / "study" / c / f"{m}-s{s}" / "summary.json").exists()]
    single = queue.Queue()
    for job in [j for j in jobs if j[0] != "game"]:
        single.put(job)

    def worker(core: int) -> None:
        while True:
            try:
                job = single.get_nowait()
            except queue.Empty:
                return
            train(job, args.scratch, core)

    threads = [threading.Thread(target=worker, args=(core,)) for core in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in [j for j in jobs if j[0] == "game"]:  # SmolLM2 runs: one at a time, 2 threads
        train(job, args.scratch, None)


if __name__ == "__main__":
    main()
