"""Experiment: vineppo train with only the positive part of the (whitened) advantages. args: vineppo train args"""
import sys

import vineppo.training.ppo as ppo
from vineppo import cli

_pl = ppo.policy_loss
def pl(logp, old_logp, ref_logp, advantages, *a, **k):
    return _pl(logp, old_logp, ref_logp, advantages.clamp(min=0), *a, **k)
ppo.policy_loss = pl
sys.exit(cli.main(["train"] + sys.argv[1:]))
