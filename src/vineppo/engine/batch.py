"""The running decode batch and its KV cache: each row keeps only the keys/values it generated, written in place.

A row continues a prefix that the prefix store (``prefixes.py``) holds once for all copies of its unit; the row's
own cache holds the tokens it generated since it was admitted. Every row writes its next token at the same
column of a preallocated buffer, so a row with s own tokens occupies the last s columns of the own-cache view;
the columns to its left hold finite keys/values (zeros, or a finished row's leftovers) and are masked out.
Admitting a row copies nothing but its per-row state; a finished row stays in place, masked, until a new row
takes its place (``fill``) or the batch is rebuilt without it (``rebuild``, which copies the kept rows' own
columns, not their prefixes).

Admission decisions (``schedule.py``) read ``L`` and ``n``: the longest row (prefix + own tokens) and the write
column of a cache that held every row's prefix in its own row, the layout this one replaced. They are kept as
counters so the same inputs, budget and seed still give the same batches, and so the same samples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from vineppo.engine.plan import Unit
from vineppo.engine.prefixes import Prefixes, StepView


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


class _OwnLayer(DynamicLayer):
    """One layer's own-token cache of the batch: keys/values [N, H, capacity, D], the view the last ``width`` columns
    before the write column ``w``.

    A decode step writes its column in place (``DynamicLayer.update`` concatenates, copying the whole cache every
    step) and, when the engine's decode attention runs (``shared``), returns the view: the attention adds the
    prefix store's keys itself. Otherwise (a model whose attention the engine does not replace) it returns each
    row's prefix and own tokens side by side, [N, H, P + width, D], for the model's own attention.
    """

    def __init__(self, kb, vb, width, extra, batch, index):
        super().__init__()
        self.kb, self.vb, self.w, self.width, self.extra = kb, vb, width, width, extra
        self.batch, self.index = batch, index
        self.device, self.is_initialized = kb.device, True
        self._views()

    def _views(self):
        self.keys = self.kb[:, :, self.w - self.width : self.w]
        self.values = self.vb[:, :, self.w - self.width : self.w]

    def get_seq_length(self) -> int:
        """The key length the model's mask must cover before this step's column (``Batch.attention_mask``)."""
        return self.width + (0 if self.batch.shared else self.batch.step_view().width)

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        if self.w + m > self.kb.shape[2]:  # out of room: the view moves to the front of a larger buffer
            N, H, _, D = self.kb.shape
            kb, vb = self.kb.new_empty(N, H, self.width + m + self.extra, D), self.vb.new_empty(N, H, self.width + m + self.extra, D)
            kb[:, :, : self.width], vb[:, :, : self.width] = self.keys, self.values
            self.kb, self.vb, self.w = kb, vb, self.width
        self.kb[:, :, self.w : self.w + m] = key_states
        self.vb[:, :, self.w : self.w + m] = value_states
        self.w += m
        self.width += m
        self._views()
        if self.batch.shared:
            return self.keys, self.values
        pk, pv = self.batch.prefix_rows(self.index)
        return torch.cat([pk, self.keys], dim=2), torch.cat([pv, self.values], dim=2)

    def shrink(self, width: int) -> None:
        """Drop view columns on the left that no row uses."""
        self.width = width
        self._views()


# Per-row state besides the cache, in the order rebuild sets it.
_ROW_FIELDS = ("pos", "pending", "tok", "lp", "gen", "limit", "alive", "slot", "copy", "b", "s")


class Batch:
    """The running decode batch, one row per sample being generated (see the module docstring)."""

    def __init__(self, dev, max_new, extra, budgets, p_max, shared=True):
        self.dev, self.max_new, self.extra = dev, max_new, extra
        self.budgets = budgets  # budgets[i][j]: new tokens allowed to the rows continuing boundary j of sequence i
        self.shared = shared  # the engine's decode attention reads the prefix store (else each layer hands it out)
        self.prefixes = Prefixes(p_max)
        self.N = self.L = 0
        self.width = 0  # own-cache columns in the view: the most own tokens any row has
        self.start = self.write = self.capacity = 0  # the replaced layout's view start, write column and buffer size
        self.cache = None  # DynamicCache of _OwnLayer
        self.view: StepView | None = None  # the prefix store's step view; None after rows change
        self.meta: list[RowId] = []
        self.dead: list[int] = []  # finished rows still held, masked, until refilled or rebuilt away
        self.pos = self.pending = None  # [N] position and token of each row's next input
        self.tok = self.lp = None  # [N, max_new] tokens generated so far and their log-probs
        self.gen = self.limit = self.alive = None  # [N] tokens generated, allowed, and 1 while the row runs
        self.slot = self.copy = None  # [N] the row's prefix slot (0 once finished) and its copy index in the slot
        self.b = self.s = None  # [N] prefix tokens (0 once finished) and own tokens in the cache

    @property
    def n(self):
        """The replaced layout's write column: a new prefix of b tokens could take a finished row's place if b <= n."""
        return self.write if self.N else 0

    def _limits(self, units):
        """The new-token budget of every row of ``units``, in row order."""
        return torch.tensor([self.budgets[u.seq][u.boundary] for u in units for _ in range(u.copies)],
                            dtype=torch.long, device=self.dev)

    def _slots(self, units, groups):
        """A prefix slot for each unit, and per row of ``units``: its slot, copy index and prefix length."""
        slot, copy, b = [], [], []
        for u in units:
            grp = groups[u.group]
            s = self.prefixes.add(grp.kv, u.row, grp.pads[u.row], u.length, u.copies)
            slot += [s] * u.copies
            copy += range(u.copies)
            b += [u.length] * u.copies
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.dev)  # noqa: E731
        self.view = None
        return t(slot), t(copy), t(b)

    def rebuild(self, units: list[Unit], groups: dict[int, Group], tok0, lp0) -> None:
        """Drop dead rows and append the rows of ``units``: each kept row's own columns are copied once, straight
        into the new buffer; a new row's prefix goes to the prefix store once per unit. ``tok0``/``lp0`` are the
        new rows' first tokens, already sampled from the prefill logits."""
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
        self.start, self.write, self.capacity = 0, self.L, self.L + self.extra
        self.view = None
        if self.N == 0:
            self.cache = None
            for name in _ROW_FIELDS:
                setattr(self, name, None)
            return
        self.cache = self._copy_cache(keep, G, units, groups)
        self.width = G
        self._append_rows(keep, keep_t, units, tok0, lp0, self._slots(units, groups))

    def _copy_cache(self, keep, G, units, groups) -> DynamicCache:
        """A fresh own-token cache: the kept rows' last G own columns, then zeros for the new rows."""
        Nk = len(keep)
        runs = []  # runs of consecutive kept rows: slice copies, no index_select temporaries
        for r in keep:
            if runs and runs[-1][1] == r:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        olds = [(layer.keys, layer.values) for layer in self.cache.layers] if Nk else groups[units[0].group].kv
        cache = DynamicCache()
        cache.layers = []
        for li, old_kv in enumerate(olds):
            pair = []
            for old in old_kv:
                _, H, _, D = old.shape
                buf = old.new_empty(self.N, H, G + self.extra, D)  # columns past G are written before they are read
                buf[Nk:, :, :G].zero_()  # the new rows' view columns: finite, masked
                d = 0
                for a, b in runs:
                    buf[d : d + b - a, :, :G] = old[a:b, :, old.shape[2] - G :]
                    d += b - a
                pair.append(buf)
            cache.layers.append(_OwnLayer(pair[0], pair[1], G, self.extra, self, li))
        return cache

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
        B = max(u.length for u in units)
        if B > self.L:  # the replaced layout widened its view to the left here
            self.start, self.L = self.write - B, B
        M = sum(u.copies for u in units)
        slots = self.dead[:M]
        self.dead = self.dead[M:]
        idx = torch.tensor(slots, device=self.dev)
        row = 0
        for u in units:
            for c in range(u.copies):
                self.meta[slots[row + c]] = RowId(u.seq, u.boundary, u.first + c)
            row += u.copies
        self.slot[idx], self.copy[idx], self.b[idx] = self._slots(units, groups)
        self.pos[idx], self.pending[idx], self.gen[idx], self.alive[idx], self.s[idx] = self.b[idx], tok0, 1, 1, 0
        self.limit[idx] = self._limits(units)
        self.tok[idx], self.lp[idx] = 0, 0.0
        self.tok[idx, 0], self.lp[idx, 0] = tok0, lp0
        return idx

    def retire(self, rows: list[int]) -> None:
        """Mark finished rows and mask them out; give up their prefix slots; trim columns no running row uses."""
        self.dead.extend(rows)
        r = torch.tensor(rows, device=self.dev)
        self.prefixes.release(self.slot[r].tolist())
        self.view = None
        self.alive[r] = 0
        self.gen[r] = 0
        self.pos[r] = 0  # keeps a finished row's (ignored) positions inside the model's range
        for t in (self.slot, self.copy, self.b, self.s):
            t[r] = 0  # it attends to its own new columns only, so it stays finite
        trim = self.L - int(((self.b + self.s) * self.alive).max())
        if 0 < trim < self.L:
            self.start += trim
            self.L -= trim
            self.s.clamp_(max=self.L)  # a finished row's oldest own columns may fall out of the view
        width = int(self.s.max())
        if width < self.width:
            for layer in self.cache.layers:
                layer.shrink(width)
            self.width = width

    def step(self, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Record every row's freshly sampled token (and log-prob); it is the next step's input."""
        idx = self.gen.clamp_max(self.max_new - 1).view(self.N, 1)
        self.tok.scatter_(1, idx, tok.view(self.N, 1))
        self.lp.scatter_(1, idx, lp.view(self.N, 1))
        self.gen += 1
        self.pos += 1
        self.s += 1
        self.width += 1
        self.pending = tok
        self.L += 1
        if self.write + 1 > self.capacity:  # the replaced layout's buffer regrew here
            used = self.write - self.start
            self.start, self.write, self.capacity = 0, used, used + 1 + self.extra
        self.write += 1

    # ------------------------------------------------------------------ what a decode step reads

    def step_view(self) -> StepView:
        """The prefix store's view for this step (recomputed only after rows changed)."""
        if self.view is None:
            self.view = self.prefixes.view(self.slot, self.copy)
        return self.view

    def attention_mask(self) -> torch.Tensor:
        """The step's mask over each row's own columns (and, when the model attends to each row's prefix through
        the cache, its prefix columns first), plus the column being written: [N, 1, 1, keys + 1] boolean when the
        engine's attention reads it (transformers takes a 4-D mask as it is instead of building one every step),
        else [N, keys + 1] for the model's own mask builder."""
        G = self.width
        own = torch.arange(G + 1, device=self.dev).unsqueeze(0) >= (G - self.s).unsqueeze(1)
        if self.shared:
            return own.view(self.N, 1, 1, G + 1)
        prefix = torch.arange(self.step_view().width, device=self.dev).unsqueeze(0) < self.b.unsqueeze(1)
        return torch.cat([prefix, own], dim=1).long()

    def prefix_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prefix keys and values of ``layer``, [N, H, P, D] (finished rows: slot 0's, masked)."""
        P = self.step_view().width
        pk, pv = self.prefixes.k[layer], self.prefixes.v[layer]
        return pk.index_select(0, self.slot)[:, :, :P], pv.index_select(0, self.slot)[:, :, :P]
