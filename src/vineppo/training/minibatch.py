"""The one minibatch driver every update goes through (PPO and its critic, RestEM, DPO+): epochs of shuffled
minibatches over the items of all ranks, micro-batches whose gradients add up, one clipped step per minibatch.

Each minibatch is a slice of one permutation of every rank's item ids, each rank working on its own members;
a loss is divided by the minibatch's weight (e.g. tokens) over all ranks and gradients are summed across ranks
(by the DDP or FSDP wrapper of `parallel.wrap`), so N processes take the step one would. Every rank runs the
same number of micro-batches (empty ones where it has run out), as those wrappers need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from vineppo.core import distributed as dist
from vineppo.models import parallel

Loss = Callable[[list[int], float], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Net:
    """A module the driver trains: its optimiser, and its loss on a micro-batch."""

    module: nn.Module  # as updates run it (parallel.wrap)
    optimizer: torch.optim.Optimizer
    loss: Loss  # (this rank's items, the minibatch's weight over ranks) -> (loss divided by it, statistics to sum)
    weights: list[float] | None = None  # this net's item weights (None: the driver's), e.g. tokens for a critic


@dataclass(kw_only=True)
class Schedule:
    """How the driver walks the items."""

    epochs: int  # passes over the items
    minibatch: int  # items per optimiser step, over all ranks
    grad_clip: float  # the largest global gradient norm of each module
    generator: torch.Generator  # the minibatch order: seeded alike on every rank
    split: Callable[[list[int]], list[list[int]]]  # a minibatch's local items -> micro-batches, `aligned` over ranks


def drive(nets: list[Net], schedule: Schedule, ids: list[int], weights: list[float],
          totals: dict[str, float] | None = None) -> dict[str, float]:
    """Optimiser steps over this rank's items (global `ids`, their `weights`); the losses' statistics summed into
    `totals` (returned), with `steps` and the first net's `grad_norm`. A non-finite first-net gradient raises."""
    everyone = sorted(g for part in dist.all_gather_objects(ids) for g in part)
    local = {g: i for i, g in enumerate(ids)}
    totals = {"steps": 0.0, "grad_norm": 0.0} if totals is None else totals
    for _ in range(schedule.epochs):
        order = [everyone[k] for k in torch.randperm(len(everyone), generator=schedule.generator).tolist()]
        for start in range(0, len(order), schedule.minibatch):
            mb = [local[g] for g in order[start:start + schedule.minibatch] if g in local]
            own = [weights if net.weights is None else net.weights for net in nets]
            denominators = dist.all_sum([sum(w[i] for i in mb) for w in own])
            for net in nets:
                net.optimizer.zero_grad(set_to_none=True)
            micro = schedule.split(mb)
            for k, idx in enumerate(micro):
                for net, denominator in zip(nets, denominators):
                    with parallel.no_sync(net.module, sync=k == len(micro) - 1):  # DDP: all-reduce on the last
                        loss, stats = net.loss(idx, denominator)
                        loss.backward()
                    for key, v in stats.items():
                        totals[key] = totals.get(key, 0.0) + v
            for j, net in enumerate(nets):
                norm = parallel.clip_grad_norm(net.module, schedule.grad_clip)
                if j == 0:
                    if not math.isfinite(norm):  # a NaN/inf loss shows here, identically on every rank
                        raise FloatingPointError(f"the loss or its gradient is not finite (grad norm {norm}); "
                                                 "the optimiser step was skipped")
                    totals["grad_norm"] += norm
                net.optimizer.step()
            totals["steps"] += 1
    return totals


def aligned(batches: list[list[int]]) -> list[list[int]]:
    """Pad with empty micro-batches to the most any rank has: every rank must join every forward and backward."""
    most = max(dist.all_gather_objects(len(batches)))
    return batches + [[] for _ in range(most - len(batches))]


def chunks(items: list[int], size: int) -> list[list[int]]:
    """`items` cut into micro-batches of `size`, in order, `aligned` over ranks."""
    return aligned([items[m:m + size] for m in range(0, len(items), max(1, size))])
