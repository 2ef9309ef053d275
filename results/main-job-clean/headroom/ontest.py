"""RL whose training problems are the test problems themselves: the most a run can gain on them in its budget."""
import dataclasses
import sys

import vineppo.tasks as T
from vineppo.cli import main
from vineppo.tasks import arith

orig = arith.load_arith
def load(split, path=None, seed=0, **kw):
    return orig("test" if split == "train" else split, path, seed, **kw)
T.register(dataclasses.replace(T.get_task("arith"), load=load))
sys.exit(main())
