"""Diagnostic: `vineppo` with arith's train split cut to its first FIT_N problems (default 64).

Can RL raise the reward on the prompts it trains on, when it does not raise it on the test set?
    FIT_N=64 python results/main-job/diagnosis/fit64.py train --model SFT_DIR --iterations 20 ...
    FIT_N=64 python results/main-job/diagnosis/fit64.py eval --model CKPT --split train --limit 64 ...
(the eval leaves the split alone past the first 64 problems, so `--limit 64` reads the same problems).
"""
import dataclasses
import os
import sys

from vineppo import tasks
from vineppo.cli import main
from vineppo.tasks import arith  # noqa: F401  (registers arith)

N = int(os.environ.get("FIT_N", "64"))
base = tasks.get_task("arith")


def load(split, path=None, seed=0, **kw):
    out = base.load(split, path, seed, **kw)
    return out[:N] if split == "train" else out


tasks.register(dataclasses.replace(base, name="arith", load=load))
main(sys.argv[1:])
