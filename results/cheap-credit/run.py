"""The learning runs of the cheap-credit study (PROTOCOL.md, H5): every task x seed x method, one `vineppo train`
at a time on 2 threads, each ended by its budget of training seconds. Finished runs (summary.json) are kept, so
a stopped study continues where it stopped; a run's checkpoint is removed after it (the study reads its metrics).

    python results/cheap-credit/run.py --scratch $SCRATCH [--tasks default,skip,long,pairs] [--seeds 0,1,2]

$SCRATCH holds the start models (commands.txt) and receives the runs in $SCRATCH/study/<task>/<method>-s<seed>/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("vineppo", "vineppo-tree", "tempo", "grpo", "dr-grpo")
ARITH = ["--config", "arith-tiny", "--eval-every", "5"]
LONG = "min_ops=6,max_ops=10,premature=0"


def task_flags(task: str, scratch: Path) -> list[str]:
    """The `vineppo train` flags of a task (PROTOCOL.md's table)."""
    return {
        "default": ARITH + ["--time-budget-s", "60"],
        "skip": ARITH + ["--model", str(scratch / "sft-skip"), "--data", "skip=0.6", "--eval-data", "skip=0.6",
                         "--time-budget-s", "60"],
        "long": ARITH + ["--model", str(scratch / "sft-long"), "--data", LONG, "--eval-data", LONG,
                         "--max-new-tokens", "256", "--time-budget-s", "150"],
        "pairs": ["--config", "examples/capital-pairs/train.yaml", "--eval-every", "5", "--time-budget-s", "240"],
    }[task]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", required=True, type=Path)
    ap.add_argument("--tasks", default="default,skip,long,pairs")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="2")
    for task in args.tasks.split(","):
        for seed in args.seeds.split(","):
            for method in args.methods.split(","):
                out = args.scratch / "study" / task / f"{method}-s{seed}"
                if (out / "summary.json").exists():
                    continue
                shutil.rmtree(out, ignore_errors=True)  # an unfinished run starts again: its clock must be whole
                out.parent.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, "-m", "vineppo", "train", "--algo", method, "--seed", seed, "--out", str(out),
                       "--iterations", "1000", "--save-every", "0", "--tensorboard", "false", "--json",
                       *task_flags(task, args.scratch)]
                start = time.time()
                with open(out.parent / f"{method}-s{seed}.log", "w") as log:
                    code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
                print(f"{task} {method} seed {seed}: exit {code}, {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
