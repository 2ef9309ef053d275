"""Planning a job: which source sequences are prefilled together, and the units of work, in admission order.

Both entry points reduce to one job: a list of units, each a prefix (a token count of one source sequence)
and a number of copies to sample from it. ``generate`` has one unit per prompt (the whole prompt);
``continuations`` one per boundary.

Adaptive sampling (``continuations(..., more=...)``): a unit's copies are only the first round of its prefix.
``Rounds`` counts the samples of each prefix still running; when the last one finishes it asks ``more`` how many
to add, and queues them as new units of the same prefill group. The group's keys and values stay cached until
every prefix in it is done, so a later round copies them again and never re-encodes the prefix.
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
    """The prefill groups (source indices) and the queue of units, popped from its end (shortest prefix first)."""

    groups: list[list[int]]
    queue: list[Unit]
    unadmitted: dict[int, int]  # group -> its units not yet in the batch (its prefill cache is freed at 0)
    open: dict[int, int] = field(default_factory=dict)  # group -> its prefixes still sampling (adaptive jobs only)

    def can_free(self, group: int) -> bool:
        """True when no unit of ``group`` waits for its prefill cache and no prefix of it may ask for more."""
        return self.unadmitted.get(group, 0) == 0 and self.open.get(group, 0) == 0


def plan_job(bounds: list[list[int]], k: int, budget: int, max_new: int, vocab: int) -> Plan:
    """Groups of sequences sorted by length within ``budget``; their units sorted by prefix length, split to fit."""
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
    unadmitted: dict[int, int] = {}
    for u in queue:
        unadmitted[u.group] = unadmitted.get(u.group, 0) + 1
    return Plan(groups, queue, unadmitted)


def split(u: Unit, budget: int, max_new: int) -> list[Unit]:
    """``u`` as units whose copies fit the budget together (rows x (prefix + max_new) <= budget)."""
    per = max(1, budget // (u.length + max_new))
    return [Unit(u.group, u.row, u.seq, u.boundary, u.length, u.first + c, min(per, u.copies - c))
            for c in range(0, u.copies, per)]


class Rounds:
    """Adaptive jobs: when every sample of a prefix has finished, ask ``more`` and queue the next round's units."""

    def __init__(self, plan: Plan, more: More, k: int, out: list, budget: int, max_new: int):
        self.plan, self.more, self.out, self.budget, self.max_new = plan, more, out, budget, max_new
        self.running: dict[tuple[int, int], int] = {}  # (i, j) -> its samples still being drawn
        self.template: dict[tuple[int, int], Unit] = {}  # (i, j) -> a unit of its prefix (group, row, length)
        for u in plan.queue:
            if (u.seq, u.boundary) not in self.template:
                self.template[u.seq, u.boundary] = u
                self.running[u.seq, u.boundary] = k
                plan.open[u.group] = plan.open.get(u.group, 0) + 1

    def finished(self, i: int, j: int) -> int | None:
        """Count one finished sample of (i, j); the prefill group to free when that settles its whole group, else None."""
        self.running[i, j] -= 1
        if self.running[i, j]:
            return None
        drawn = self.out[i][j]
        extra = self.more(i, j, drawn)
        u = self.template[i, j]
        if extra > 0:
            self.running[i, j] = extra
            drawn.extend([None] * extra)
            units = split(Unit(u.group, u.row, i, j, u.length, len(drawn) - extra, extra), self.budget, self.max_new)
            self.plan.queue.extend(reversed(units))  # popped from the end: next in line
            self.plan.unadmitted[u.group] += len(units)
            return None
        self.plan.open[u.group] -= 1
        return u.group if self.plan.can_free(u.group) else None


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
