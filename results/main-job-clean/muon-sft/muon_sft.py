"""Experiment: SFT with Muon on hidden matrices (AdamW on embeddings/norms). usage: muon_sft.py OUT SEED EPOCHS MUON_LR ADJUST WD"""
import sys

import torch

import vineppo.training.sft as sft

out, seed, epochs, mlr, adjust, wd = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], float(sys.argv[6])

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

_AdamW = torch.optim.AdamW
def patched(groups, lr, betas):
    ps = [p for g in groups for p in g["params"]]
    hidden = [p for p in ps if p.ndim == 2 and p.shape[0] != 512 and p.shape[1] != 512]  # not the tied embedding
    rest = [p for p in ps if all(p is not h for h in hidden)]
    print(f"muon {sum(p.numel() for p in hidden)} params in {len(hidden)} matrices; adamw {sum(p.numel() for p in rest)}", flush=True)
    m = torch.optim.Muon(hidden, lr=mlr, weight_decay=wd, adjust_lr_fn=None if adjust == "original" else adjust)
    a = _AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1}, {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}], lr=lr, betas=betas)
    return Both(m, a)
sft.torch.optim.AdamW = patched
sft.run_sft(sft.SFTConfig("arith", out=out, seed=seed, epochs=epochs))
