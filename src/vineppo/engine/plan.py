"""Planning a job: which source sequences are prefilled together, and the units of work, in admission order.

Both entry points reduce to one job: a list of units, each a prefix (a token count of one source sequence)
and a number of copies to sample from it. ``generate`` has one unit per prompt (the whole prompt);
``continuations`` one per boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def plan_job(bounds: list[list[int]], k: int, budget: int, max_new: int, vocab: int) -> Plan:
    """Groups of sequences sorted by length within ``budget``; their units sorted by prefix length, split to fit."""
    groups = prefill_groups(bounds, budget, vocab)
    queue: list[Unit] = []
    for g, members in enumerate(groups):
        units = []
        for r, i in enumerate(members):
            for j, b in enumerate(bounds[i]):
                per = max(1, budget // (b + max_new))  # copies of one unit must fit the budget together
                for c0 in range(0, k, per):
                    units.append(Unit(g, r, i, j, b, c0, min(per, k - c0)))
        units.sort(key=lambda u: u.length)  # rows of one batch then need little left padding
        queue.extend(units)
    queue.reverse()
    unadmitted: dict[int, int] = {}
    for u in queue:
        unadmitted[u.group] = unadmitted.get(u.group, 0) + 1
    return Plan(groups, queue, unadmitted)


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
