"""The admission policy: when units leave the queue for the decode batch, and whether they are copied in.

New rows either take finished rows' places in place (``Batch.fill``: nothing else is copied) or come in with a
rebuild (``Batch.rebuild``: every kept row is copied once into a fresh buffer). A rebuild pays for itself only
when the batch grows by a good margin or sheds many finished rows; the thresholds below say when.
Every admission keeps rows x (length + max_new_tokens) <= token_budget, so memory stays bounded and a large
job is chunked by itself.
"""

from __future__ import annotations

from vineppo.engine.batch import Batch
from vineppo.engine.plan import Unit

# A batch without finished rows admits only while its live rows are at most this fraction of what the budget
# holds: growing by less than a third is not worth copying every row.
GROW_BELOW = 0.75
# When the budget holds fewer than this many times the batch's rows, growing is not worth a rebuild either:
# admit only as many rows as there are finished places to refill in place.
MIN_GROWTH = 1.25
# With nothing to admit, a rebuild sheds the finished rows once they are this fraction of the batch: below it,
# decoding a few masked rows costs less than copying the others.
SHED_FRACTION = 0.25


def admit(queue: list[Unit], batch: Batch, budget: int, max_new: int) -> list[Unit]:
    """Pop the units (shortest prefix first) that join the batch now; none when it is not worth it yet."""
    if not queue:
        return []
    live = batch.N - len(batch.dead)
    cap = budget // (max(batch.L, queue[-1].length) + max_new)  # rows the budget holds at this length
    if not (batch.N == 0 or batch.dead or live <= GROW_BELOW * cap):
        return []
    room = len(batch.dead) if batch.N and cap < MIN_GROWTH * batch.N else cap
    admitted: list[Unit] = []
    L, rows, new = batch.L, live, 0
    while queue:
        u = queue[-1]
        nb = max(L, u.length)
        if rows > 0 and ((rows + u.copies) * (nb + max_new) > budget or new + u.copies > room):
            break
        admitted.append(queue.pop())
        L, rows, new = nb, rows + u.copies, new + u.copies
    return admitted


def fits_in_place(batch: Batch, units: list[Unit], budget: int, max_new: int) -> bool:
    """True when ``units`` can take finished rows' places: enough of them, and the batch stays within the budget."""
    longest = max(u.length for u in units)
    return sum(u.copies for u in units) <= len(batch.dead) and batch.N * (max(batch.L, longest) + max_new) <= budget


def should_shed(batch: Batch) -> bool:
    """True when enough of the batch has finished that a rebuild without them pays off."""
    return len(batch.dead) >= max(1, int(batch.N * SHED_FRACTION))
