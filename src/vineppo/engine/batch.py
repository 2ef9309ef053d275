"""The running decode batch: one row per sample being generated, its per-row state, and which rows finished.

Where the rows' keys and values live is the batch's KV layout (``kv``), called as rows come and go: the split
layout (``split.py``: own tokens per row, prefixes once per unit; eager decoding) or the ring layout (``ring.py``:
fixed buffers for CUDA graphs). A finished row stays in place, masked, until a new row takes its place
(``fill``) or the batch is rebuilt without it (``rebuild``: kept rows first, then the new ones).

Admission decisions (``schedule.py``) read ``N``, ``L`` (the longest running row, prefix + own tokens) and the
finished places ``dead``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicLayer

from vineppo.engine.plan import Unit


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


class RowId(NamedTuple):
    """Whose sample a batch row is generating."""

    seq: int  # source sequence
    boundary: int  # boundary index j
    copy: int  # sample index among the k


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


# Per-row state, in the order rebuild sets it.
_ROW_FIELDS = ("pos", "pending", "tok", "lp", "gen", "limit", "alive", "slot", "copy", "b", "s")


class Batch:
    """The running decode batch, one row per sample being generated (see the module docstring)."""

    def __init__(self, dev, max_new: int, budgets: list[list[int]], kv):
        self.dev, self.max_new = dev, max_new
        self.budgets = budgets  # budgets[i][j]: new tokens allowed to the rows continuing boundary j of sequence i
        self.kv = kv  # the KV layout: split.SplitKV or ring.RingKV
        self.N = 0  # rows, running or finished
        self.L = 0  # the longest running row: prefix + own tokens
        self.meta: list[RowId] = []
        self.dead: list[int] = []  # finished rows still held, masked, until refilled or rebuilt away
        self.pos = self.pending = None  # [N] position and token of each row's next input
        self.tok = self.lp = None  # [N, max_new] tokens generated so far and their log-probs
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

    def rebuild(self, units: list[Unit], groups: dict[int, Group], tok0, lp0) -> None:
        """Drop dead rows and append the rows of ``units`` (the layout copies each kept row's cache once).
        ``tok0``/``lp0`` are the new rows' first tokens, already sampled from the prefill logits."""
        dead = set(self.dead)
        keep = [r for r in range(self.N) if r not in dead]
        keep_t = torch.tensor(keep, device=self.dev) if keep and dead else None
        sel = (lambda t: t.index_select(0, keep_t)) if keep_t is not None else (lambda t: t)  # noqa: E731
        L_old = int(sel(self.b + self.s).max()) if keep else 0  # the columns that are padding for every kept row go
        G = int(sel(self.s).max()) if keep else 0
        new_b = [u.length for u in units for _ in range(u.copies)]
        self.meta = [self.meta[r] for r in keep] + [RowId(u.seq, u.boundary, u.first + c)
                                                      for u in units for c in range(u.copies)]
        self.dead = []
        self.N, self.L = len(keep) + len(new_b), max([L_old] + new_b)
        self.kv.rebuild(self, keep, G, units, groups)
        if self.N == 0:
            for name in _ROW_FIELDS:
                setattr(self, name, None)
            return
        self._append_rows(keep, keep_t, units, tok0, lp0, self._admit(list(range(len(keep), self.N)), units, groups))

    def _append_rows(self, keep, keep_t, units, tok0, lp0, slots) -> None:
        """Per-row state: the kept rows' (selected when rows were dropped), then the new rows'."""
        slot, copy, b_new = slots
        M = len(b_new)
        new_tok = torch.zeros(M, self.max_new, dtype=torch.long, device=self.dev)
        new_lp = torch.zeros(M, self.max_new, dtype=torch.float32, device=self.dev)
        if M:
            new_tok[:, 0], new_lp[:, 0] = tok0, lp0
        else:
            tok0 = new_tok[:, 0]
        zeros = torch.zeros(M, dtype=torch.long, device=self.dev)
        fresh = dict(pos=b_new.clone(), pending=tok0, tok=new_tok, lp=new_lp, gen=zeros + 1, limit=self._limits(units),
                     alive=torch.ones(M, dtype=torch.int8, device=self.dev), slot=slot, copy=copy, b=b_new, s=zeros)
        for name in _ROW_FIELDS:
            new = fresh[name]
            if keep:
                cur = getattr(self, name)
                cur = cur.index_select(0, keep_t) if keep_t is not None else cur
                new = torch.cat([cur, new])
            setattr(self, name, new)

    def fill(self, units: list[Unit], groups: dict[int, Group], tok0, lp0) -> torch.Tensor:
        """Put the rows of ``units`` in place of finished rows (no other row is touched); return their indices."""
        self.L = max([self.L] + [u.length for u in units])
        M = sum(u.copies for u in units)
        slots = self.dead[:M]
        self.dead = self.dead[M:]
        idx = torch.tensor(slots, device=self.dev)
        row = 0
        for u in units:
            for c in range(u.copies):
                self.meta[slots[row + c]] = RowId(u.seq, u.boundary, u.first + c)
            row += u.copies
        self.slot[idx], self.copy[idx], self.b[idx] = self._admit(slots, units, groups)
        self.pos[idx], self.pending[idx], self.gen[idx], self.alive[idx], self.s[idx] = self.b[idx], tok0, 1, 1, 0
        self.limit[idx] = self._limits(units)
        self.tok[idx], self.lp[idx] = 0, 0.0
        self.tok[idx, 0], self.lp[idx, 0] = tok0, lp0
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

    def step(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Record every row's freshly sampled token (and log-prob); it is the next step's input."""
        idx = self.gen.clamp_max(self.max_new - 1).view(self.N, 1)
        self.tok.scatter_(1, idx, tok.view(self.N, 1))
        self.lp.scatter_(1, idx, lp.view(self.N, 1))
        self.gen += 1
        self.pos += 1
        self.s += 1
        self.pending = tok
        self.L += 1
        self.kv.step(self)
