"""Experiment: vineppo train with a linear learning-rate warmup over the policy optimiser's first N steps. args: N then vineppo train args"""
import sys

import torch

import vineppo.training.trainer as tr
from vineppo import cli

warm = int(sys.argv[1])

class WarmAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        self._n = getattr(self, "_n", 0) + 1
        for g in self.param_groups:
            g.setdefault("base_lr", g["lr"])
            g["lr"] = g["base_lr"] * min(1.0, self._n / warm)
        return super().step(closure)
tr.torch.optim.AdamW = WarmAdamW
sys.exit(cli.main(["train"] + sys.argv[2:]))
