"""The running decode batch: one row per sample being generated, its per-row state, and which rows finished; and
``KVLayout``, the contract of where the rows' keys and values live.

The batch tells its layout (``kv``) as rows come and go (``rebuild``, ``admit``, ``retire``, ``step``), and the
layout runs the decode step over them (``forward``, given the model's call). Two layouts implement it: the split
layout (``split.py``: own tokens per row, prefixes once per unit; eager decoding) and the ring layout
(``ring.py``: fixed buffers for CUDA graphs). A finished row stays in place, masked, until a new row takes its
place (``fill``) or the batch is rebuilt without it (``rebuild``: kept rows first, then the new ones).

Admission decisions (``schedule.py``) read ``N``, ``L`` (the longest running row, prefix + own tokens) and the
finished places ``dead``.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from vineppo.engine.plan import Unit
from vineppo.engine.sampling import Drawn


class Group:
    """A prefilled group of source sequences: per-layer keys/values [R, H, P, D] and left padding per row."""

    def __init__(self, kv, pads, logits, col):
        self.kv = kv  # list of (keys, values)
        self.pads = pads  # left padding per row (ints)
        self.logits = logits  # [R, U, V] logits at the needed (padded) positions
        self.col = col  # (row, boundary b) -> column of logits

    def first_logits(self, u: Unit) -> torch.Tensor:
        """The next-token logits after ``u``'s prefix, one row per copy."""
        return self.logits[u.row, self.col[(u.row, u.length)]].unsqueeze(0).expand(u.copies, -1)


def layers_kv(cache):
    """(keys, values) per layer of a model's returned cache; only full-attention DynamicLayer caches are supported."""
    if cache is None:
        raise NotImplementedError("the model returned no KV cache")
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"unsupported cache type {type(cache).__name__}")
    kv = []
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"cache layer {type(layer).__name__} is not supported (only full-attention DynamicLayer caches)"
            )
        kv.append((layer.keys, layer.values))
    return kv


# The model's decode call a layout makes (``runner.ModelRunner.forward``): (input_ids [N, 1], attention_mask,
# position_ids [N, 1], cache) -> the next-token logits [N, V].
ModelCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]


class KVLayout(Protocol):
    """Where a batch's keys and values live (see the module docstring): ``Batch`` calls the first four as rows
    change, the runner's decode step calls ``forward``."""

    def rebuild(self, batch: Batch, keep: list[int], G: int, units: list[Unit], groups: dict[int, Group]) -> None:
        """The batch is rebuilt: old rows ``keep`` move to the front, in order (G: the most own tokens one of them has),
        then room for the rows of ``units``."""

    def admit(self, batch: Batch, rows: list[int], units: list[Unit],
              groups: dict[int, Group]) -> tuple[list[int], list[int]]:
        """Take in the rows of ``units`` at ``rows``, prefixes from their groups; per row: prefix slot, copy index."""

    def retire(self, batch: Batch, slots: list[int]) -> None:
        """Rows on prefix ``slots`` finished (the batch has masked them): free what they held."""

    def step(self, batch: Batch) -> None:
        """Every row wrote one token's keys and values."""

    def forward(self, model: ModelCall, batch: Batch) -> torch.Tensor:
        """One decode step: every row's pending token through ``model``; the next-token logits [N, V]."""


# Per-row state, in the order rebuild sets it ("ent" only when the job records entropies).
_ROW_FIELDS = ("pos", "pending", "tok", "lp", "ent", "gen", "limit", "alive", "slot", "copy", "b", "s")


class Batch:
    """The running decode batch, one row per sample being generated (see the module docstring)."""

    def __init__(self, dev, max_new: int, budgets: list[list[int]], kv: KVLayout, entropy: bool = False):
        self.dev, self.max_new = dev, max_new
        self.budgets = budgets  # budgets[i][j]: new tokens allowed to the rows continuing boundary j of sequence i
        self.kv = kv
        self.fields = [f for f in _ROW_FIELDS if entropy or f != "ent"]
        self.N = 0  # rows, running or finished
        self.L = 0  # the longest running row: prefix + own tokens
        self.meta: list[tuple[int, int, int]] = []  # per row, whose sample it is: (sequence i, boundary j, copy c)
        self.dead: list[int] = []  # finished rows still held, masked, until refilled or rebuilt away
        self.pos = self.pending = None  # [N] position and token of each row's next input
        self.tok = self.lp = self.ent = None  # [N, max_new] tokens so far, their log-probs (and entropies, if asked)
        self.gen = self.limit = self.alive = None  # [N] tokens generated, allowed, and 1 while the row runs
        self.slot = self.copy = None  # [N] the row's prefix slot (0 once finished) and its copy index (split layout)
        self.b = self.s = None  # [N] prefix tokens (0 once finished) and own tokens in the cache

    def _limits(self, units):
        """The new-token budget of every row of ``units``, in row order."""
        return torch.tensor([self.budgets[u.seq][u.boundary] for u in units for _ in range(u.copies)],
                            dtype=torch.long, device=self.dev)

    def _admit(self, rows, units, groups):
        """The layout takes in the rows of ``units`` at ``rows``; per row: its slot, copy index and prefix length."""
        slot, copy = self.kv.admit(self, rows, units, groups)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.dev)  # noqa: E731
        return t(slot), t(copy), t([u.length for u in units for _ in range(u.copies)])

    def rebuild(self, units: list[Unit], groups: dict[int, Group], first: Drawn | None) -> None:
        """Drop dead rows and append the rows of ``units`` (the layout copies each kept row's cache once).
        ``first``: the new rows' first tokens, already sampled from the prefill logits."""
        dead = set(self.dead)
        keep = [r for r in range(self.N) if r not in dead]
        keep_t = torch.tensor(keep, device=self.dev) if keep and dead else None
        sel = (lambda t: t.index_select(0, keep_t)) if keep_t is not None else (lambda t: t)  # noqa: E731
        L_old = int(sel(self.b + self.s).max()) if keep else 0  # the columns that are padding for every kept row go
        G = int(sel(self.s).max()) if keep else 0
        new_b = [u.length for u in units for _ in range(u.copies)]
        self.meta = [self.meta[r] for r in keep] + [(u.seq, u.boundary, u.first + c)
                                                      for u in units for c in range(u.copies)]
        self.dead = []
        self.N, self.L = len(keep) + len(new_b), max([L_old] + new_b)
        self.kv.rebuild(self, keep, G, units, groups)
        if self.N == 0:
            for name in _ROW_FIELDS:
                setattr(self, name, None)
            return
        self._append_rows(keep, keep_t, units, first, self._admit(list(range(len(keep), self.N)), units, groups))

    def _append_rows(self, keep, keep_t, units, first, slots) -> None:
        """Per-row state: the kept rows' (selected when rows were dropped), then the new rows'."""
        slot, copy, b_new = slots
        M = len(b_new)
        zeros = torch.zeros(M, dtype=torch.long, device=self.dev)
        fresh = dict(pos=b_new.clone(), gen=zeros + 1, limit=self._limits(units),
                     alive=torch.ones(M, dtype=torch.int8, device=self.dev), slot=slot, copy=copy, b=b_new, s=zeros)
        fresh.update(self._records(M, first))
        for name in self.fields:
            new = fresh[name]
            if keep:
                cur = getattr(self, name)
                cur = cur.index_select(0, keep_t) if keep_t is not None else cur
                new = torch.cat([cur, new])
            setattr(self, name, new)

    def _records(self, M: int, first: Drawn | None) -> dict[str, torch.Tensor]:
        """The records [M, max_new] of M new rows, their first draw at column 0, and their first input."""
        recs = {name: torch.zeros(M, self.max_new, dtype=dtype, device=self.dev)
                for name, dtype in (("tok", torch.long), ("lp", torch.float32), ("ent", torch.float32))
                if name in self.fields}
        if M:
            for name, x in zip(("tok", "lp", "ent"), first):
                if name in recs:
                    recs[name][:, 0] = x
        return dict(recs, pending=first[0] if M else recs["tok"][:, 0])

    def fill(self, units: list[Unit], groups: dict[int, Group], first: Drawn) -> torch.Tensor:
        """Put the rows of ``units`` in place of finished rows (no other row is touched); return their indices."""
        self.L = max([self.L] + [u.length for u in units])
        M = sum(u.copies for u in units)
        slots = self.dead[:M]
        self.dead = self.dead[M:]
        idx = torch.tensor(slots, device=self.dev)
        row = 0
        for u in units:
            for c in range(u.copies):
                self.meta[slots[row + c]] = (u.seq, u.boundary, u.first + c)
            row += u.copies
        self.slot[idx], self.copy[idx], self.b[idx] = self._admit(slots, units, groups)
        self.pos[idx], self.pending[idx], self.gen[idx], self.alive[idx], self.s[idx] = self.b[idx], first[0], 1, 1, 0
        self.limit[idx] = self._limits(units)
        for t, x in zip((self.tok, self.lp, self.ent), first):
            if t is not None:
                t[idx] = 0
                t[idx, 0] = x
        return idx

    def retire(self, rows: list[int]) -> None:
        """Mark finished rows and mask them out; the layout frees what they held; trim columns no running row uses."""
        self.dead.extend(rows)
        r = torch.tensor(rows, device=self.dev)
        slots = self.slot[r].tolist()
        self.alive[r] = 0
        self.gen[r] = 0
        self.pos[r] = 0  # keeps a finished row's (ignored) positions inside the model's range
        for t in (self.slot, self.copy, self.b, self.s):
            t[r] = 0  # it attends to its own new columns only, so it stays finite
        self.L = int(((self.b + self.s) * self.alive).max())
        self.kv.retire(self, slots)

    def step(self, drawn: Drawn) -> None:
        """Record every row's fresh token (its log-prob, its entropy if asked); it is the next step's input."""
        idx = self.gen.clamp_max(self.max_new - 1).view(self.N, 1)
        for t, x in zip((self.tok, self.lp, self.ent), drawn):
            if t is not None:
                t.scatter_(1, idx, x.view(self.N, 1))
        self.gen += 1
        self.pos += 1
        self.s += 1
        self.pending = drawn[0]
        self.L += 1
        self.kv.step(self)
