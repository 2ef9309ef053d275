"""Experiment: vineppo train with plain SGD on the policy. args: LR then vineppo train args"""
import sys

import torch

import vineppo.training.trainer as tr
from vineppo import cli

sgd_lr = float(sys.argv[1])
_AdamW = torch.optim.AdamW
def patched(params, lr, **kw):
    ps = list(params)
    if len(ps) < 5:
        return _AdamW(ps, lr=lr, **kw)
    print(f"RL SGD lr {sgd_lr}", flush=True)
    return torch.optim.SGD(ps, lr=sgd_lr)
tr.torch.optim.AdamW = patched
sys.exit(cli.main(["train"] + sys.argv[2:]))
