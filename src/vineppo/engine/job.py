"""One sampling job of the native engine and the scheduler that runs it: the queue of units (``plan.py``), the
prefilled groups' caches, the decode batch (``batch.py``), the finisher (``stops.py``) and, for adaptive jobs,
the rounds. ``Job.step()`` is one decode step: admit what fits, sample one token for every row, finish rows.

The job asks its engine for the two model calls (``prefill`` a group, ``forward`` one decode step); everything
else about the order of work lives here, so the same inputs, budget and seed give the same samples.
"""

from __future__ import annotations

import torch

from vineppo.engine import schedule
from vineppo.engine.api import Request, Sample
from vineppo.engine.batch import Batch, Group
from vineppo.engine.plan import Rounds, Unit, plan_job
from vineppo.engine.sampling import sample
from vineppo.engine.stops import Finisher


class Job:
    """The scheduler of one request on `engine`: owns its queue, group caches, batch, finisher and rounds."""

    def __init__(self, engine, req: Request, shared: bool = True):
        self.engine, self.req = engine, req
        self.out: list[list[list[Sample | None]]] = [[[None] * req.k for _ in bs] for bs in req.boundaries]
        p, budget, device = req.params, engine.token_budget, engine.device
        vocab = engine.model.get_output_embeddings().weight.shape[0]
        self.plan = plan_job(req.boundaries, req.k, budget, p.max_new_tokens, vocab)
        cand = engine.stop_candidates(p.stop, vocab)
        self.finisher = Finisher(engine.tokenizer, p.stop, torch.tensor(engine.eos_token_ids or [-1], device=device),
                                 None if cand is None else cand.to(device), self.out, req.progress)
        self.batch = Batch(device, p.max_new_tokens, req.budgets, engine.layout(req, self.plan, shared))
        self.groups: dict[int, Group] = {}  # prefilled groups whose units are not all admitted yet
        self.rounds = None
        if req.more is not None:  # adaptive: each finished sample may settle its prefix, or queue its next round
            self.rounds = Rounds(self.plan, req.more, req.k, self.out, budget, p.max_new_tokens)
            self.finisher.on_emit = self._settled

    def run(self) -> list[list[list[Sample]]]:
        """Step until every unit is sampled; result[i][j]: the k samples after bounds[i][j]."""
        try:
            while self.step():
                pass
        finally:  # on_emit is this job's own method: the cycle kept the job's KV caches alive until a full gc
            self.finisher.on_emit = None
        return self.out

    def step(self) -> bool:
        """Admit units as rows finish, decode one token for every row, finish the rows that ended; False when done."""
        budget, max_new = self.engine.token_budget, self.req.params.max_new_tokens
        admitted = schedule.admit(self.plan.queue, self.batch, budget, max_new)
        if admitted:
            self._admit(admitted)
        elif schedule.should_shed(self.batch):
            self.batch.rebuild([], self.groups, None, None)
        if self.batch.N == 0:
            return bool(self.plan.queue)
        logits = self.engine.forward(self.batch)
        tok, lp = sample(logits, self.req.params, self.req.generator, self.engine.fused_sampling)
        self.batch.step(tok, lp)
        self.finisher.check(self.batch, tok)
        return True

    def _admit(self, units: list[Unit]) -> None:
        """Prefill the units' groups (each once), sample their first tokens, and bring them into the batch."""
        batch, groups = self.batch, self.groups
        for u in units:
            if u.group not in groups:
                groups[u.group] = self.engine.prefill(self.plan.groups[u.group], self.req.sequences, self.req.boundaries)
        logits = torch.cat([groups[u.group].first_logits(u) for u in units])
        tok0, lp0 = sample(logits, self.req.params, self.req.generator, self.engine.fused_sampling)  # from the prefill
        live = batch.N - len(batch.dead)
        if schedule.fits_in_place(batch, units, self.engine.token_budget, self.req.params.max_new_tokens):
            rows = batch.fill(units, groups, tok0, lp0)
        else:
            batch.rebuild(units, groups, tok0, lp0)
            rows = torch.arange(live, batch.N, device=batch.dev)  # kept rows first, then the new ones
        for u in units:
            self.plan.unadmitted[u.group] -= 1
            if self.plan.can_free(u.group):  # every unit of the group is in the batch, no round to come: free its cache
                del groups[u.group]
        self.finisher.check(batch, tok0, rows)  # the new rows' first tokens may already finish them

    def _settled(self, i: int, j: int) -> None:
        """A sample of prefix (i, j) was emitted: a group whose prefixes are all settled frees its cache."""
        self.groups.pop(self.rounds.finished(i, j), None)
