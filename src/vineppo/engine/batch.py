"""The running decode batch and its KV cache: a preallocated buffer written in place, rows refilled or rebuilt.

Rows are right-aligned: every row writes its next token at the same column, so a row holding t tokens
(prefix + generated) occupies the last t of the L columns of the cache view; the columns to its left hold
finite keys/values (zeros, or a finished row's leftovers) and are masked out. A finished row stays in
place, masked, until a new row takes its place (``fill``) or the batch is rebuilt (``rebuild``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

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


class _BufferLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a preallocated buffer [N, H, capacity, D].

    ``DynamicLayer.update`` concatenates, copying the whole cache every step; here the new column is
    written in place and ``keys``/``values`` are views ``[:, :, start:n]`` (``start`` moves right when the
    columns on the left are padding for every row). Every column below ``n`` holds finite values, so any
    of them may come back into the view, masked. When the buffer runs out of room, the view is copied to
    the front of a larger one.
    """

    def __init__(self, kb, vb, n, extra):
        super().__init__()
        self.kb, self.vb, self.start, self.n, self.extra = kb, vb, 0, n, extra  # columns past n are never read
        self.device, self.is_initialized = kb.device, True
        self._views()

    def _views(self):
        self.keys = self.kb[:, :, self.start : self.n]
        self.values = self.vb[:, :, self.start : self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        if self.n + m > self.kb.shape[2]:
            used = self.n - self.start
            N, H, _, D = self.kb.shape
            kb, vb = self.kb.new_empty(N, H, used + m + self.extra, D), self.vb.new_empty(N, H, used + m + self.extra, D)
            kb[:, :, :used], vb[:, :, :used] = self.keys, self.values
            self.kb, self.vb, self.start, self.n = kb, vb, 0, used
        self.kb[:, :, self.n : self.n + m] = key_states
        self.vb[:, :, self.n : self.n + m] = value_states
        self.n += m
        self._views()
        return self.keys, self.values


def new_cache(kv, extra):
    """A DynamicCache of buffer layers holding copies of ``kv`` (a list of (keys, values) per layer)."""
    cache = DynamicCache()
    cache.layers = []
    for k, v in kv:
        N, H, L, D = k.shape
        kb, vb = k.new_empty(N, H, L + extra, D), v.new_empty(N, H, L + extra, D)
        kb[:, :, :L], vb[:, :, :L] = k, v
        cache.layers.append(_BufferLayer(kb, vb, L, extra))
    return cache


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


# Per-row state besides the cache, in the order rebuild sets it.
_ROW_FIELDS = ("pos", "pending", "tok", "lp", "gen", "limit", "alive")


class Batch:
    """The running decode batch, one row per sample being generated (see the module docstring)."""

    def __init__(self, dev, max_new, extra, budgets):
        self.dev, self.max_new, self.extra = dev, max_new, extra
        self.budgets = budgets  # budgets[i][j]: new tokens allowed to the rows continuing boundary j of sequence i
        self.N = self.L = 0
        self.cache = None  # DynamicCache of _BufferLayer
        self.meta: list[RowId] = []
        self.dead: list[int] = []  # finished rows still held, masked, until refilled or rebuilt away
        self.mask = None  # [N, L] attention mask of the cache view (plus the column being written)
        self.pos = self.pending = None  # [N] position and token of each row's next input
        self.tok = self.lp = None  # [N, max_new] tokens generated so far and their log-probs
        self.gen = self.limit = self.alive = None  # [N] tokens generated, allowed, and 1 while the row runs

    @property
    def n(self):
        """The cache's write column in its buffer: a prefix of b tokens can be written in place if b <= n."""
        return self.cache.layers[0].n if self.N else 0

    def _limits(self, units):
        """The new-token budget of every row of ``units``, in row order."""
        return torch.tensor([self.budgets[u.seq][u.boundary] for u in units for _ in range(u.copies)],
                            dtype=torch.long, device=self.dev)

    def rebuild(self, units: list[Unit], groups: dict[int, Group], tok0, lp0) -> None:
        """Drop dead rows, trim all-padding columns on the left and append the rows of ``units``.

        Each kept row's keys/values are copied once, straight into the new buffer, and each new row's prefix
        is copied once out of its group's prefill cache (the prefix is never re-encoded). ``tok0``/``lp0`` are
        the new rows' first tokens, already sampled from the prefill logits.
        """
        dead = set(self.dead)
        keep = [r for r in range(self.N) if r not in dead]
        keep_t = torch.tensor(keep, device=self.dev) if keep and dead else None
        old_mask = self.mask.index_select(0, keep_t) if keep_t is not None else self.mask
        trim = int((old_mask.shape[1] - old_mask.sum(1)).min()) if keep else 0
        L_old = self.L - trim if keep else 0
        new_b = [u.length for u in units for _ in range(u.copies)]
        L = max([L_old] + new_b)
        self.meta = [self.meta[r] for r in keep] + [RowId(u.seq, u.boundary, u.first + c)
                                                      for u in units for c in range(u.copies)]
        self.dead = []
        self.N, self.L = len(keep) + len(new_b), L
        if self.N == 0:
            self.cache = self.mask = None
            for name in _ROW_FIELDS:
                setattr(self, name, None)
            return
        self.cache = self._copy_cache(keep, trim, L_old, units, groups)
        b_new = torch.tensor(new_b, dtype=torch.long, device=self.dev)
        mask = torch.zeros(self.N, L, dtype=torch.long, device=self.dev)
        if keep:
            mask[: len(keep), L - L_old :] = old_mask[:, trim:]
        if new_b:
            mask[len(keep) :] = (torch.arange(L, device=self.dev).unsqueeze(0) >= (L - b_new).unsqueeze(1)).long()
        self.mask = mask
        self._append_rows(keep, keep_t, units, b_new, tok0, lp0)

    def _copy_cache(self, keep, trim, L_old, units, groups) -> DynamicCache:
        """A fresh cache: the kept rows' columns [trim, trim + L_old), right-aligned, then the new rows' prefixes."""
        Nk, L = len(keep), self.L
        runs = []  # runs of consecutive kept rows: slice copies, no index_select temporaries
        for r in keep:
            if runs and runs[-1][1] == r:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        n_layers = len(self.cache.layers) if Nk else len(groups[units[0].group].kv)
        cache = DynamicCache()
        cache.layers = []
        for li in range(n_layers):
            pair = []
            for w in range(2):  # keys, values
                old = (self.cache.layers[li].keys, self.cache.layers[li].values)[w] if Nk else groups[units[0].group].kv[li][w]
                _, H, _, D = old.shape
                buf = old.new_empty(self.N, H, L + self.extra, D)
                if Nk:
                    buf[:Nk, :, : L - L_old].zero_()
                    src = old[:, :, trim : trim + L_old]
                    d = 0
                    for a, b in runs:
                        buf[d : d + b - a, :, L - L_old : L] = src[a:b]
                        d += b - a
                row = Nk
                for u in units:
                    grp = groups[u.group]
                    p = grp.pads[u.row]
                    buf[row : row + u.copies, :, : L - u.length].zero_()
                    buf[row : row + u.copies, :, L - u.length : L] = grp.kv[li][w][u.row, :, p : p + u.length]
                    row += u.copies
                pair.append(buf)
            cache.layers.append(_BufferLayer(pair[0], pair[1], L, self.extra))
        return cache

    def _append_rows(self, keep, keep_t, units, b_new, tok0, lp0) -> None:
        """Per-row state: the kept rows' (selected when rows were dropped), then the new rows'."""
        M = len(b_new)
        new_tok = torch.zeros(M, self.max_new, dtype=torch.long, device=self.dev)
        new_lp = torch.zeros(M, self.max_new, dtype=torch.float32, device=self.dev)
        if M:
            new_tok[:, 0], new_lp[:, 0] = tok0, lp0
        else:
            tok0 = new_tok[:, 0]
        fresh = dict(pos=b_new, pending=tok0, tok=new_tok, lp=new_lp,
                     gen=torch.ones(M, dtype=torch.long, device=self.dev), limit=self._limits(units),
                     alive=torch.ones(M, dtype=torch.int8, device=self.dev))
        for name in _ROW_FIELDS:
            new = fresh[name]
            if keep:
                cur = getattr(self, name)
                cur = cur.index_select(0, keep_t) if keep_t is not None else cur
                new = torch.cat([cur, new])
            setattr(self, name, new)

    def fill(self, units: list[Unit], groups: dict[int, Group], tok0, lp0) -> torch.Tensor:
        """Write the rows of ``units`` in place of finished rows (no other row is copied); return their indices.

        Needs at least as many finished rows as new rows, and every new prefix to fit left of the write column.
        """
        layers = self.cache.layers
        n = layers[0].n
        B = max(u.length for u in units)
        if B > self.L:  # widen the view to the left: those columns are finite and masked for the other rows
            for layer in layers:
                layer.start = n - B
                layer._views()
            self.mask = F.pad(self.mask, (B - self.L, 0))
            self.L = B
        M = sum(u.copies for u in units)
        slots = self.dead[:M]
        self.dead = self.dead[M:]
        idx = torch.tensor(slots, device=self.dev)
        b_new = torch.tensor([u.length for u in units for _ in range(u.copies)], device=self.dev)
        row = 0
        for u in units:
            grp, rows, b = groups[u.group], idx[row : row + u.copies], u.length
            p = grp.pads[u.row]
            for layer, (k, v) in zip(layers, grp.kv):
                layer.kb[rows, :, n - b : n] = k[u.row, :, p : p + b]
                layer.vb[rows, :, n - b : n] = v[u.row, :, p : p + b]
            self.mask[rows] = 0
            self.mask[rows, self.L - b :] = 1
            for c in range(u.copies):
                self.meta[slots[row + c]] = RowId(u.seq, u.boundary, u.first + c)
            row += u.copies
        self.pos[idx], self.pending[idx], self.gen[idx], self.alive[idx] = b_new, tok0, 1, 1
        self.limit[idx] = self._limits(units)
        self.tok[idx], self.lp[idx] = 0, 0.0
        self.tok[idx, 0], self.lp[idx, 0] = tok0, lp0
        return idx

    def retire(self, rows: list[int]) -> None:
        """Mark finished rows and mask them out; trim the view's columns that are now padding for every row."""
        self.dead.extend(rows)
        r = torch.tensor(rows, device=self.dev)
        self.alive[r] = 0
        self.gen[r] = 0
        self.pos[r] = 0  # keeps a finished row's (ignored) positions inside the model's range
        self.mask[r] = 0  # it attends to its own new columns only, so it stays finite
        trim = self.L - int((self.mask.sum(1) * self.alive).max())
        if 0 < trim < self.L:
            for layer in self.cache.layers:
                layer.start += trim
                layer._views()
            self.mask = self.mask[:, trim:]
            self.L -= trim

    def step(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Record every row's freshly sampled token (and log-prob); it is the next step's input."""
        idx = self.gen.clamp_max(self.max_new - 1).view(self.N, 1)
        self.tok.scatter_(1, idx, tok.view(self.N, 1))
        self.lp.scatter_(1, idx, lp.view(self.N, 1))
        self.gen += 1
        self.pos += 1
        self.pending = tok
        self.L += 1
