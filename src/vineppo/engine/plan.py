"""Planning a job: which source sequences are prefilled together, and the units of work, in admission order.

Both entry points reduce to one job: a list of units, each a prefix (a token count of one source sequence)
and a number of copies to sample from it. ``generate`` has one unit per prompt (the whole prompt);
``continuations`` one per boundary.

Adaptive sampling (``continuations(..., more=...)``): a unit's copies are only the first round of its prefix.
The plan counts the samples of each prefix still running (``Plan.finished``); when the last one finishes it asks
``more`` how many to add, and queues them as new units of the same prefill group. The group's keys and values stay
cached until every prefix in it is done, so a later round copies them again and never re-encodes the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vineppo.engine.api import More

LOGITS_PER_TOKEN = 1024  # a prefill group may hold budget x this many floats of boundary logits (at least a vocabulary)


@dataclass
class Unit:
    """Copies of one prefix to sample: the rows they become share the prefix's keys and values."""

    group: int  # the prefill group of its source sequence
    row: int  # the sequence's row in that group
    seq: int  # the source sequence's index in the job
    boundary: int  # the boundary's index j among the sequence's boundaries
    length: int  # the prefix: the first `length` tokens of the sequence
    first: int  # the first copy's index among the k samples of this prefix
    copies: int  # how many samples this unit holds


@dataclass
class Plan:
    """A job's work: the prefill groups (source indices) and the queue of units, popped from its end (shortest prefix
    first); in an adaptive job (``more``), its rounds too (``finished``)."""

    groups: list[list[int]]
    queue: list[Unit]
    unadmitted: dict[int, int]  # group -> its units not yet in the batch (its prefill cache is freed at 0)
    budget: int  # the job's token budget and max_new_tokens: a round's units are split to fit them
    max_new: int
    more: More | None = None  # adaptive jobs: how many samples to add to a prefix whose samples have all finished
    running: dict[tuple[int, int], int] = field(default_factory=dict)  # (i, j) -> its samples still being drawn
    template: dict[tuple[int, int], Unit] = field(default_factory=dict)  # (i, j) -> a unit of its prefix
    open: dict[int, int] = field(default_factory=dict)  # group -> its prefixes still sampling

    def can_free(self, group: int) -> bool:
        """True when no unit of ``group`` waits for its prefill cache and no prefix of it may ask for more."""
        return self.unadmitted.get(group, 0) == 0 and self.open.get(group, 0) == 0

    def finished(self, i: int, j: int, drawn: list) -> int | None:
        """Adaptive jobs: count one finished sample of (i, j), ``drawn`` its samples so far. After its last, ask
        ``more`` and queue the next round's units (``drawn`` gets their places), or settle the prefix; return the
        prefill group to free when that settles the whole group, else None."""
        self.running[i, j] -= 1
        if self.running[i, j]:
            return None
        extra = self.more(i, j, drawn)
        u = self.template[i, j]
        if extra > 0:
            self.running[i, j] = extra
            drawn.extend([None] * extra)
            units = split(Unit(u.group, u.row, i, j, u.length, len(drawn) - extra, extra), self.budget, self.max_new)
            self.queue.extend(reversed(units))  # popped from the end: next in line
            self.unadmitted[u.group] += len(units)
            return None
        self.open[u.group] -= 1
        return u.group if self.can_free(u.group) else None


def plan_job(bounds: list[list[int]], k: int, budget: int, max_new: int, vocab: int, more: More | None = None) -> Plan:
    """Groups of sequences sorted by length within ``budget``; their units sorted by prefix length, split to fit;
    with ``more``, every prefix's first round of k samples running."""
    groups = prefill_groups(bounds, budget, vocab)
    queue: list[Unit] = []
    for g, members in enumerate(groups):
        units = []
        for r, i in enumerate(members):
            for j, b in enumerate(bounds[i]):
                units.extend(split(Unit(g, r, i, j, b, 0, k), budget, max_new))
        units.sort(key=lambda u: u.length)  # rows of one batch then need little left padding
        queue.extend(units)
    queue.reverse()
    plan = Plan(groups, queue, {}, budget, max_new, more)
    for u in queue:
        plan.unadmitted[u.group] = plan.unadmitted.get(u.group, 0) + 1
        if more is not None and (u.seq, u.boundary) not in plan.template:
            plan.template[u.seq, u.boundary], plan.running[u.seq, u.boundary] = u, k
            plan.open[u.group] = plan.open.get(u.group, 0) + 1
    return plan


def split(u: Unit, budget: int, max_new: int) -> list[Unit]:
    """``u`` as units whose copies fit the budget together (rows x (prefix + max_new) <= budget)."""
    per = max(1, budget // (u.length + max_new))
    return [Unit(u.group, u.row, u.seq, u.boundary, u.length, u.first + c, min(per, u.copies - c))
            for c in range(0, u.copies, per)]


def prefill_groups(bounds: list[list[int]], budget: int, vocab: int) -> list[list[int]]:
    """Sequences with boundaries, sorted by last boundary, in groups of rows x length <= budget (and bounded logits)."""
    logit_budget = max(budget * LOGITS_PER_TOKEN, vocab)  # floats of prefill logits held at once
    order = sorted((i for i in range(len(bounds)) if bounds[i]), key=lambda i: bounds[i][-1])
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_max = cur_nb = 0
    for i in order:
        n_i, nb = bounds[i][-1], len(bounds[i])
        too_long = (len(cur) + 1) * max(cur_max, n_i) > budget
        too_many_logits = (len(cur) + 1) * (cur_nb + nb) * vocab > logit_budget
        if cur and (too_long or too_many_logits):
            groups.append(cur)
            cur, cur_max, cur_nb = [], 0, 0
        cur.append(i)
        cur_max, cur_nb = max(cur_max, n_i), cur_nb + nb
    if cur:
        groups.append(cur)
    return groups
