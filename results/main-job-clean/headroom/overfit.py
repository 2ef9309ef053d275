"""RL on a fixed pool of N train problems (argv[1]): does the update raise the reward on problems it sees again?"""
import dataclasses
import sys

import vineppo.tasks as T
from vineppo.cli import main
from vineppo.tasks import arith

n = int(sys.argv.pop(1))
orig = arith.load_arith
def load(split, path=None, seed=0, **kw):
    out = orig(split, path, seed, **kw)
    return out[:n] if split == "train" else out
T.register(dataclasses.replace(T.get_task("arith"), load=load))
sys.exit(main())
