"""Monte Carlo continuations over torchrun ranks: every rank's states pooled, dealt out by cost, results sent home."""

from __future__ import annotations

import dataclasses

from vineppo.core import distributed as dist
from vineppo.engine.api import Request, Sample


class BalancedContinuations:
    """An engine wrapper: Monte Carlo states of all ranks are pooled, dealt out by cost, and results sent home.

    A long response has many more states (and longer continuations) than a short one, so dealing states by
    count would leave ranks idle; the cost of a state is the tokens it will likely generate, K times the
    rest of its response. Without torchrun this is the engine itself.
    """

    def __init__(self, engine):
        self.engine = engine
        self.states_run = 0  # states this rank computed (to check that every state is run exactly once)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """Same contract as Engine.continuations, computed cooperatively by every rank (adaptive jobs: each its own)."""
        # `more` grades this rank's episodes, and dialogue records hold this rank's tools and environments: neither
        # can be dealt out to another rank
        if not dist.active() or req.more is not None or req.records is not None:
            self.states_run += sum(len(b) for b in req.boundaries)
            return self.engine.continuations(req)
        req = req.checked()
        pools = dist.all_gather_objects(list(zip(req.sequences, req.boundaries, req.budgets)))
        units = [(req.k * (len(seq) - b + 1), r, i, j) for r, pool in enumerate(pools)
                 for i, (seq, bs, _) in enumerate(pool) for j, b in enumerate(bs)]
        load, mine = [0.0] * dist.world(), []
        for cost, r, i, j in sorted(units, reverse=True):  # longest job first to the least-loaded rank
            target = min(range(dist.world()), key=load.__getitem__)
            load[target] += cost
            if target == dist.rank():
                mine.append((r, i, j))
        jobs: dict[tuple[int, int], list[int]] = {}
        for r, i, j in sorted(mine):
            jobs.setdefault((r, i), []).append(j)
        keys = list(jobs)
        self.states_run += len(mine)
        out = self.engine.continuations(dataclasses.replace(
            req, sequences=[pools[r][i][0] for r, i in keys],
            boundaries=[[pools[r][i][1][j] for j in jobs[(r, i)]] for r, i in keys],
            budgets=[[pools[r][i][2][j] for j in jobs[(r, i)]] for r, i in keys]))
        done = {(r, i, j): samples for (r, i), per in zip(keys, out) for j, samples in zip(jobs[(r, i)], per)}
        results: dict = {}
        for part in dist.all_gather_objects(done):
            results.update({key: v for key, v in part.items() if key[0] == dist.rank()})
        return [[results[(dist.rank(), i, j)] for j in range(len(bs))] for i, bs in enumerate(req.boundaries)]
