"""One sampling job of the native engine and the scheduler that runs it: the plan (``plan.py``: the queue of
units and, for adaptive jobs, the rounds), the prefilled groups' caches, the decode batch (``batch.py``) and the
finisher (``stops.py``). ``Job.step()`` is one decode step: admit what fits, sample one token for every row,
finish rows.

The job calls its model runner (``runner.py``) for the model: ``prefill`` a group, ``decode`` one step, ``sample``
the tokens; nothing calls back into the job (the finisher returns the samples it wrote). Everything else about the
order of work lives here, so the same inputs, budget and seed give the same samples.
"""

from __future__ import annotations

import torch

from vineppo.engine import schedule
from vineppo.engine.api import Request, Sample
from vineppo.engine.batch import Batch, Group
from vineppo.engine.plan import Unit, plan_job
from vineppo.engine.runner import ModelRunner
from vineppo.engine.stops import Finisher


class Job:
    """The scheduler of one request within ``budget`` tokens: owns its plan (the queue, adaptive rounds), group
    caches, batch and finisher; ``runner`` runs the model (``shared``: its decode attention is on, as
    ``ModelRunner.running`` says)."""

    def __init__(self, runner: ModelRunner, req: Request, budget: int, shared: bool = True):
        self.runner, self.req, self.budget, self.max_new = runner, req, budget, req.params.max_new_tokens
        self.out: list[list[list[Sample | None]]] = [[[None] * req.k for _ in bs] for bs in req.boundaries]
        p, device, vocab = req.params, runner.device, runner.vocab
        self.plan = plan_job(req.boundaries, req.k, budget, self.max_new, vocab, req.more)
        cand = runner.stop_table(p.stop, vocab)
        self.finisher = Finisher(runner.tokenizer, p.stop, torch.tensor(runner.eos_token_ids or [-1], device=device),
                                 None if cand is None else cand.to(device), self.out, req.progress)
        self.batch = Batch(device, self.max_new, req.budgets, runner.layout(req, self.plan, budget, shared), p.entropy)
        self.groups: dict[int, Group] = {}  # prefilled groups whose units are not all admitted yet

    def run(self) -> list[list[list[Sample]]]:
        """Step until every unit is sampled; result[i][j]: the k samples after bounds[i][j]."""
        while self.step():
            pass
        return self.out

    def step(self) -> bool:
        """Admit units as rows finish, decode one token for every row, finish the rows that ended; False when done."""
        admitted = schedule.admit(self.plan.queue, self.batch, self.budget, self.max_new)
        if admitted:
            self._admit(admitted)
        elif schedule.should_shed(self.batch):
            self.batch.rebuild([], self.groups, None)
        if self.batch.N == 0:
            return bool(self.plan.queue)
        drawn = self.runner.sample(self.runner.decode(self.batch), self.req.params, self.req.generator)
        self.batch.step(drawn)
        self._finish(drawn[0])
        return True

    def _admit(self, units: list[Unit]) -> None:
        """Prefill the units' groups (each once), sample their first tokens, and bring them into the batch."""
        batch, groups = self.batch, self.groups
        for u in units:
            if u.group not in groups:
                groups[u.group] = self.runner.prefill(self.plan.groups[u.group], self.req.sequences, self.req.boundaries)
        logits = torch.cat([groups[u.group].first_logits(u) for u in units])
        first = self.runner.sample(logits, self.req.params, self.req.generator)  # from the prefill
        live = batch.N - len(batch.dead)
        if schedule.fits_in_place(batch, units, self.budget, self.max_new):
            rows = batch.fill(units, groups, first)
        else:
            batch.rebuild(units, groups, first)
            rows = torch.arange(live, batch.N, device=batch.dev)  # kept rows first, then the new ones
        for u in units:
            self.plan.unadmitted[u.group] -= 1
            if self.plan.can_free(u.group):  # every unit of the group is in the batch, no round to come: free its cache
                del groups[u.group]
        self._finish(first[0], rows)  # the new rows' first tokens may already finish them

    def _finish(self, tok: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Finish the rows (all, or ``rows``) that ``tok`` ends; in an adaptive job, each sample written may settle
        its prefix (which may queue a next round), and a group whose prefixes are all settled frees its cache."""
        for i, j in self.finisher.check(self.batch, tok, rows):
            if self.plan.more is not None:
                self.groups.pop(self.plan.finished(i, j, self.out[i][j]), None)
