"""The prefix store: the keys/values of the prefixes a decode batch continues, held once per unit, not once per row.

A unit is k copies of one prefix (``plan.py``). Its rows share the prefix's keys and values, so the store keeps
them in one slot, per layer ``[slots, H_kv, P, D]``, copied once out of the prefill cache when the unit is
admitted; each row's own cache (``batch.py``) holds only the tokens it generated. A decode step attends to
both (``attention.py``): the copies of a slot are the rows of one query block over the slot's keys, so a
prefix is read once per step for all its copies instead of once per copy, and admitting a row copies nothing.

Slot 0 is never given out: finished rows point at it, and its length is 0 (no prefix to attend to).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class StepView:
    """What a decode step's attention needs of the store, the same for every layer of the step."""

    slots: int  # S: slots 0..S-1 are attended to
    width: int  # P: columns 0..P-1 of every slot (the longest prefix in use)
    copies: int  # C: query rows per slot
    rows: torch.Tensor  # [S * C] batch row of each (slot, copy) query row; row 0 where none (its result is unread)
    where: torch.Tensor  # [N] each batch row's (slot * C + copy)
    mask: torch.Tensor  # [S, 1, 1, P] additive: 0 on a slot's prefix, -inf past it


class Prefixes:
    """Slots of prefix keys/values, per layer, with the rows still using each (see the module docstring)."""

    def __init__(self, p_max: int):
        self.p_max = p_max  # the longest prefix of the job: every slot's width
        self.k: list[torch.Tensor] = []  # per layer [capacity, H_kv, p_max, D]
        self.v: list[torch.Tensor] = []
        self.length = [0]  # per slot: prefix tokens (0: free)
        self.refs = [0]  # per slot: rows still running on it
        self.free: list[int] = []  # a heap of free slots: the lowest is reused first, so the slots in use stay packed
        self.copies = 1  # the most rows one slot has had

    def add(self, kv, row: int, pad: int, length: int, copies: int) -> int:
        """A slot holding ``length`` tokens of row ``row`` of a prefill cache ``kv`` (left padding ``pad``)."""
        slot = heapq.heappop(self.free) if self.free else self._new_slot(kv)
        for li, (k, v) in enumerate(kv):
            self.k[li][slot, :, :length] = k[row, :, pad : pad + length]
            self.v[li][slot, :, :length] = v[row, :, pad : pad + length]
        self.length[slot], self.refs[slot] = length, copies
        self.copies = max(self.copies, copies)
        return slot

    def release(self, slots: list[int]) -> None:
        """One row of each of ``slots`` finished; a slot no row uses is free again."""
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.length[s] = 0
                heapq.heappush(self.free, s)

    def _new_slot(self, kv) -> int:
        """Append a slot, doubling the buffers when they are full (slot 0, the empty prefix, comes with the first)."""
        if not self.k:
            for k, v in kv:
                _, H, _, D = k.shape
                self.k.append(k.new_zeros(8, H, self.p_max, D))  # zeros: columns past a prefix are finite, masked
                self.v.append(v.new_zeros(8, H, self.p_max, D))
        if len(self.length) == self.k[0].shape[0]:
            for store in (self.k, self.v):
                for li, t in enumerate(store):
                    grown = t.new_zeros(2 * t.shape[0], *t.shape[1:])
                    grown[: t.shape[0]] = t
                    store[li] = grown
        self.length.append(0)
        self.refs.append(0)
        return len(self.length) - 1

    def view(self, slot: torch.Tensor, copy: torch.Tensor) -> StepView:
        """The step's view for rows on ``slot`` (0: none) as copy ``copy`` of it."""
        N, dev = slot.shape[0], slot.device
        used = [s for s, n in enumerate(self.length) if n]
        S, C = (max(used) + 1 if used else 1), self.copies
        P = max(max(self.length[:S]), 1)
        where = slot * C + copy
        rows = torch.zeros(S * C, dtype=torch.long, device=dev)
        live = slot > 0
        rows[where[live]] = torch.arange(N, device=dev)[live]
        lengths = torch.tensor(self.length[:S], device=dev)
        mask = torch.zeros(S, 1, 1, P, dtype=self.k[0].dtype, device=dev) if self.k else None
        if mask is not None:
            mask.masked_fill_((torch.arange(P, device=dev) >= lengths.view(S, 1)).view(S, 1, 1, P), float("-inf"))
        return StepView(S, P, C, rows, where, mask)
