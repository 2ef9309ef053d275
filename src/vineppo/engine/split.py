"""The split KV layout of the eager decode path: each row's own tokens in a buffer written in place, its prefix in
the prefix store (``prefixes.py``), held once for all copies of its unit.

A row continues a prefix that the store holds once per unit; the row's own cache holds the tokens it generated
since it was admitted. Every row writes its next token at the same column of a preallocated buffer, so a row
with s own tokens occupies the last s columns of the own-cache view; the columns to its left hold finite
keys/values (zeros, or a finished row's leftovers) and are masked out. Admitting a row copies nothing but its
per-row state; a rebuild (``Batch.rebuild``) copies the kept rows' own columns, not their prefixes. The decode
attention (``attention.py``) reads each prefix once per step for all its copies.

Shapes change every step (the view widens by one column), so this layout suits eager execution: the CPU, and
a GPU with CUDA graphs off. The static layout for CUDA graphs is ``ring.py``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from vineppo.engine.attention import decoding
from vineppo.engine.batch import Batch, Group, KVLayout, ModelCall
from vineppo.engine.plan import Unit
from vineppo.engine.prefixes import Prefixes, StepView

EXTRA_COLUMNS = 64  # an own-token buffer has room for this many steps (at most max_new_tokens + 1) before it is regrown


class OwnLayer(DynamicLayer):
    """One layer's own-token cache of the batch: keys/values [N, H, capacity, D], the view the last ``width`` columns
    before the write column ``w``.

    A decode step writes its column in place (``DynamicLayer.update`` concatenates, copying the whole cache every
    step) and, when the engine's decode attention runs (``shared``), returns the view: the attention adds the
    prefix store's keys itself. Otherwise (a model whose attention the engine does not replace) it returns each
    row's prefix and own tokens side by side, [N, H, P + width, D], for the model's own attention.
    """

    def __init__(self, kb, vb, width, kv: SplitKV, batch, index):
        super().__init__()
        self.kb, self.vb, self.w, self.width, self.extra = kb, vb, width, width, kv.extra
        self.kv, self.batch, self.index = kv, batch, index
        self.device, self.is_initialized = kb.device, True
        self._views()

    def _views(self):
        self.keys = self.kb[:, :, self.w - self.width : self.w]
        self.values = self.vb[:, :, self.w - self.width : self.w]

    def get_seq_length(self) -> int:
        """The key length the model's mask must cover before this step's column (``SplitKV.attention_mask``)."""
        return self.width + (0 if self.kv.shared else self.kv.step_view(self.batch).width)

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
        if self.kv.shared:
            return self.keys, self.values
        pk, pv = self.kv.prefix_rows(self.batch, self.index)
        return torch.cat([pk, self.keys], dim=2), torch.cat([pv, self.values], dim=2)

    def shrink(self, width: int) -> None:
        """Drop view columns on the left that no row uses."""
        self.width = width
        self._views()


class SplitKV(KVLayout):
    """The batch's caches in the split layout (see the module docstring)."""

    def __init__(self, max_new: int, p_max: int, shared: bool):
        self.extra = min(max_new + 1, EXTRA_COLUMNS)  # own-cache columns a buffer holds past the view before regrowing
        self.shared = shared  # the engine's decode attention reads the prefix store (else each layer hands it out)
        self.prefixes = Prefixes(p_max)
        self.cache: DynamicCache | None = None  # of OwnLayer
        self.width = 0  # own-cache columns in the view: the most own tokens any row has
        self.view: StepView | None = None  # the prefix store's step view; None after rows change

    def rebuild(self, batch: Batch, keep: list[int], G: int, units: list[Unit], groups: dict[int, Group]) -> None:
        """A fresh own-token cache: the kept rows' last G own columns, then zeros for the new rows."""
        self.view = None
        if batch.N == 0:
            self.cache = None
            return
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
                buf = old.new_empty(batch.N, H, G + self.extra, D)  # columns past G are written before they are read
                buf[Nk:, :, :G].zero_()  # the new rows' view columns: finite, masked
                d = 0
                for a, b in runs:
                    buf[d : d + b - a, :, :G] = old[a:b, :, old.shape[2] - G :]
                    d += b - a
                pair.append(buf)
            cache.layers.append(OwnLayer(pair[0], pair[1], G, self, batch, li))
        self.cache = cache
        self.width = G

    def admit(self, batch: Batch, rows: list[int], units: list[Unit],
              groups: dict[int, Group]) -> tuple[list[int], list[int]]:
        """A prefix slot for each unit (copied into the store once); per new row: its slot and copy index."""
        slot, copy = [], []
        for u in units:
            grp = groups[u.group]
            s = self.prefixes.add(grp.kv, u.row, grp.pads[u.row], u.length, u.copies)
            slot += [s] * u.copies
            copy += range(u.copies)
        self.view = None
        return slot, copy

    def retire(self, batch: Batch, slots: list[int]) -> None:
        """Finished rows give up their prefix slots; view columns no row uses any more are dropped."""
        self.prefixes.release(slots)
        self.view = None
        width = int(batch.s.max())
        if width < self.width:
            for layer in self.cache.layers:
                layer.shrink(width)
            self.width = width

    def step(self, batch: Batch) -> None:
        """Every row wrote one own column."""
        self.width += 1

    def forward(self, model: ModelCall, batch: Batch) -> torch.Tensor:
        """One decode step: every row's pending token through ``model``; the next-token logits [N, V]."""
        N = batch.N
        with decoding(batch, self) as step:
            logits = model(batch.pending.view(N, 1), self.attention_mask(batch), batch.pos.view(N, 1), self.cache)
        if self.shared and step.calls == 0:
            raise NotImplementedError("the model's attention does not go through transformers' attention interface, "
                                      "so the engine cannot add the prefix keys it holds apart")
        return logits

    # ------------------------------------------------------------------ what a decode step reads

    def step_view(self, batch: Batch) -> StepView:
        """The prefix store's view for this step (recomputed only after rows changed)."""
        if self.view is None:
            self.view = self.prefixes.view(batch.slot, batch.copy)
        return self.view

    def attention_mask(self, batch: Batch) -> torch.Tensor:
        """The step's mask over each row's own columns (and, when the model attends to each row's prefix through
        the cache, its prefix columns first), plus the column being written: [N, 1, 1, keys + 1] boolean when the
        engine's attention reads it (transformers takes a 4-D mask as it is instead of building one every step),
        else [N, keys + 1] for the model's own mask builder."""
        G = self.width
        own = torch.arange(G + 1, device=batch.dev).unsqueeze(0) >= (G - batch.s).unsqueeze(1)
        if self.shared:
            return own.view(batch.N, 1, 1, G + 1)
        prefix = torch.arange(self.step_view(batch).width, device=batch.dev).unsqueeze(0) < batch.b.unsqueeze(1)
        return torch.cat([prefix, own], dim=1).long()

    def prefix_rows(self, batch: Batch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prefix keys and values of ``layer``, [N, H, P, D] (finished rows: slot 0's, masked)."""
        P = self.step_view(batch).width
        pk, pv = self.prefixes.k[layer], self.prefixes.v[layer]
        return pk.index_select(0, batch.slot)[:, :, :P], pv.index_select(0, batch.slot)[:, :, :P]
