"""Experiment: vineppo train with Muon (match_rms_adamw) on the policy's matrices, AdamW on the rest. args: vineppo train args"""
import sys

import torch

import vineppo.training.trainer as tr
from vineppo import cli


class Both(torch.optim.Optimizer):
    def __init__(self, a, b):
        self.a, self.b = a, b
        self.defaults = {}; self.state = {}
        self.param_groups = a.param_groups + b.param_groups
        self._optimizer_step_pre_hooks = {}; self._optimizer_step_post_hooks = {}
    def step(self, closure=None):
        self.a.step(); self.b.step()
    def zero_grad(self, set_to_none=True):
        self.a.zero_grad(set_to_none); self.b.zero_grad(set_to_none)
    def state_dict(self):
        return {"a": self.a.state_dict(), "b": self.b.state_dict()}
    def load_state_dict(self, sd):
        self.a.load_state_dict(sd["a"]); self.b.load_state_dict(sd["b"])

_AdamW = torch.optim.AdamW
def patched(params, lr, **kw):
    ps = list(params)
    if len(ps) < 5:  # not the policy
        return _AdamW(ps, lr=lr, **kw)
    m = [p for p in ps if p.ndim == 2]; o = [p for p in ps if p.ndim != 2]
    print(f"RL muon on {len(m)} matrices, adamw on {len(o)}", flush=True)
    return Both(torch.optim.Muon(m, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"), _AdamW(o, lr=lr, **kw))
tr.torch.optim.AdamW = patched
sys.exit(cli.main(["train"] + sys.argv[1:]))
