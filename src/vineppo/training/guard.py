"""A numerics check before a run's first update in a process (a fresh start or a resume): the trainer's
log-probs of the iteration's responses must agree with the ones they are compared to, or the run stops.

What must agree, on the first micro-batch, as a mean per-token KL estimate (k3, the estimator the KL term uses):
- the policy under the run's dtype against the frozen reference, while the policy has taken no optimiser step
  (then they are the same weights; a fresh run only: after a resume the optimiser has state);
- the policy against the sampler's log-probs, when the sampler gave them (the same weights and temperature);
- under `--dtype bfloat16`, the policy in bf16 autocast against the same policy in float32.
A dtype or kernel path that breaks any of these shows as a gap of whole nats per token, where rounding gives
hundredths; training on it silently wrecks the run (a KL of ~1,500 on the SmolLM2 preset's first update).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch

from vineppo.core import distributed as dist
from vineppo.core.errors import UserError
from vineppo.models import parallel
from vineppo.training.forward import can_share, pack, pad_rows, token_logprobs
from vineppo.training.ppo import Learner, Rollouts, UpdateConfig, micro_batches

BOUND = 0.05  # mean per-token KL (nats) above which two log-prob paths of the same weights disagree
_checked: weakref.WeakSet = weakref.WeakSet()  # the optimisers whose run was checked in this process


def check(nets: Learner, data: Rollouts, cfg: UpdateConfig) -> dict[str, float]:
    """The gaps measured on this run's first update in this process (nothing after); raises past BOUND."""
    if nets.optimizer in _checked:
        return {}
    _checked.add(nets.optimizer)
    device = next(nets.policy.parameters()).device
    idx = micro_batches(list(range(len(data.prompts))), data.prompts, cfg.micro_batch, data.responses,
                        cfg.micro_batch_tokens)[0]
    share = can_share(nets.policy) and (nets.reference is None or can_share(nets.reference))
    b = pack([data.prompts[i] for i in idx], [data.responses[i] for i in idx], data.pad_id, share=share,
             masks=[data.mask(i) for i in idx]).to(device)
    trainer = _logprobs(nets.policy, b, cfg, parallel.autocast(device, cfg.dtype))
    others = {}
    if nets.reference is not None and not nets.optimizer.state:
        others["reference"] = _logprobs(nets.reference, b, cfg, parallel.autocast(device, cfg.dtype))
    if data.old_logprobs is not None:
        others["sampler"] = pad_rows([data.old_logprobs[i] for i in idx], b.mask.shape, device)
    if parallel.DTYPES[cfg.dtype] is not None:
        others["float32"] = _logprobs(nets.policy, b, cfg, nullcontext())
    mine = {name: _kl(trainer, other, b.mask) for name, other in others.items()}
    gaps = {name: max(g[name] for g in dist.all_gather_objects(mine)) for name in mine}  # every rank stops alike
    for name, gap in gaps.items():
        if gap > BOUND:
            raise UserError(f"numerics check: before the first update the policy's log-probs under --dtype {cfg.dtype} "
                            f"on {device.type} and the {name}'s disagree by a mean per-token KL of {gap:.3g} "
                            f"(bound {BOUND}); training on them would diverge. Try --dtype float32")
    return gaps


def _logprobs(model: torch.nn.Module, b, cfg: UpdateConfig, precision) -> torch.Tensor:
    with torch.no_grad(), precision:
        return token_logprobs(model, b, cfg.temperature)[0].float()


def _kl(logp: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over response tokens of k3 = exp(d) - d - 1, d = other - logp (0 for an empty micro-batch)."""
    d = (other - logp) * mask
    return float(((d.exp() - d - 1) * mask).sum() / mask.sum().clamp(min=1))
