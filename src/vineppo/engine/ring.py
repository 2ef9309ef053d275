"""The ring KV layout: fixed buffers, so that a decode step has the same shapes every time (CUDA graphs).

Every row holds its prefix and its own tokens in one row of a buffer per layer, [rows, H_kv, width, D], and every
row writes its step at one shared column ``w`` that moves on by one, modulo the width, each step. A row admitted
while the write column is w gets its prefix at columns [w - b, w) (modulo the width) and its own tokens at w,
w + 1, ...; it attends to the columns at most b + s steps behind the write column, a mask computed on the device
from each row's length. Keys carry their positions (rotary embeddings are applied before caching), so the
columns' order does not matter. The width is the job's longest prefix plus max_new_tokens (rounded up), so no
row ever overwrites its own keys.

Rows are admitted, refilled and dropped as the scheduler says, exactly as in the split layout (``split.py``),
so the same inputs and seed draw the same samples, up to float rounding (the attention sums over other
columns in another order, and a batch of N rows runs padded to its graph bucket). What the ring gives up: a
prefix is held once per row rather than once per unit (K copies of each Monte Carlo state's prefix) and every
step reads all ``width`` columns of every row; a GPU's bandwidth makes that cheap next to the launches it saves.

``RingPool`` (kept by the model runner across jobs, since graphs are bound to its addresses) owns the buffers, the
step's static inputs and the graphs (``graphs.py``); ``RingKV`` is one job's view of it, a ``batch.KVLayout``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from vineppo.core.errors import UserError
from vineppo.engine.attention import decoding
from vineppo.engine.batch import Batch, Group, KVLayout, ModelCall
from vineppo.engine.graphs import Graphs, bucket
from vineppo.engine.plan import Unit

KEEP_FRACTION = 0.05  # Engine.sleep keeps a ring of at most this share of the GPU's memory, with its graphs: capturing
# them again each iteration would cost more than the memory gives the update
ALIGN = 64  # the width is a multiple of this: aligned key lengths for fused attention, and jobs of nearby shapes
# share buffers and graphs


class RingLayer(DynamicLayer):
    """One layer of the ring for a decode step of ``rows`` rows: writes the step's keys/values at the write column
    (a device tensor, so a graph replays it at whatever column the step is at) and returns the whole buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, w: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.w = keys, values, w
        self.device, self.is_initialized = keys.device, True

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.w, key_states)
        self.values.index_copy_(2, self.w, value_states)
        return self.keys, self.values


class RingPool:
    """The ring's buffers, the decode step's static inputs and its graphs; grown on demand, freed by ``release``."""

    def __init__(self, device: torch.device, graphs: bool):
        self.device = device
        self.k: list[torch.Tensor] = []  # per layer [rows, H_kv, width, D]
        self.v: list[torch.Tensor] = []
        self.rows = self.width = 0
        self.ids = self.pos = self.lens = None  # [rows] each row's input token, position, cached tokens
        self.w = None  # [1] the write column
        self.cols = None  # [width] 0 .. width - 1
        self.graphs = Graphs() if graphs else None
        self.weights: tuple[int, ...] = ()  # where the weights were when the graphs were captured

    def ensure(self, rows: int, width: int, like: list | None, keep: list[int]) -> None:
        """Room for ``rows`` rows of ``width`` columns (the first time, of keys/values shaped like ``like``, a prefill
        group's per-layer (keys, values)); rows ``keep`` move to the front, in order."""
        if rows > self.rows or width > self.width or not self.k:
            if keep and width > self.width:
                raise RuntimeError("the ring cannot widen while rows are running")  # a job's width is fixed
            shapes = [(k.shape[1], k.shape[3], v.shape[1], v.shape[3], k.dtype) for k, v in (like or zip(self.k, self.v))]
            self._allocate(max(rows, self.rows), max(width, self.width), shapes, keep)
        elif keep != list(range(len(keep))):
            idx = torch.tensor(keep, device=self.device)
            for buf in self.k + self.v:
                buf[: len(keep)] = buf.index_select(0, idx)

    def _allocate(self, rows: int, width: int, shapes: list, keep: list[int]) -> None:
        per_token = sum((hk * dk + hv * dv) * torch.empty((), dtype=dt).element_size() for hk, dk, hv, dv, dt in shapes)
        need = rows * width * per_token
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0] + sum(t.numel() * t.element_size() for t in self.k + self.v)
            if need > free:
                raise UserError(f"the rollout engine's KV buffers need {need / 2**30:.1f} GiB ({rows} rows x {width} "
                                f"columns), {free / 2**30:.1f} GiB is free: lower --token-budget or --max-new-tokens")
        idx = torch.tensor(keep, device=self.device) if keep else None
        old_k, old_v = self.k, self.v
        self.k, self.v = [], []
        for li, (hk, dk, hv, dv, dt) in enumerate(shapes):
            for store, old, h, d in ((self.k, old_k, hk, dk), (self.v, old_v, hv, dv)):
                buf = torch.zeros(rows, h, width, d, dtype=dt, device=self.device)  # zeros: finite where masked
                if idx is not None:
                    buf[: len(keep)] = old[li].index_select(0, idx)
                store.append(buf)
        del old_k, old_v
        self.rows, self.width = rows, width
        long = dict(dtype=torch.long, device=self.device)
        self.ids, self.pos, self.lens = (torch.zeros(rows, **long) for _ in range(3))
        self.w, self.cols = torch.zeros(1, **long), torch.arange(width, **long)
        if self.graphs is not None:
            self.graphs.clear()

    def check_weights(self, model: torch.nn.Module) -> None:
        """Drop the graphs when ``model``'s weights are not where they were when the graphs were captured."""
        where = tuple(p.data_ptr() for p in model.parameters())
        if where != self.weights and self.graphs is not None:
            self.graphs.clear()
        self.weights = where

    def small(self) -> bool:
        """True on CUDA when the buffers take at most KEEP_FRACTION of the device's memory."""
        held = sum(t.numel() * t.element_size() for t in self.k + self.v)
        return self.device.type == "cuda" and held <= KEEP_FRACTION * torch.cuda.get_device_properties(self.device).total_memory

    def release(self) -> None:
        """Free the buffers and graphs (before an update; the next job allocates and captures again)."""
        self.k, self.v, self.rows, self.width = [], [], 0, 0
        self.ids = self.pos = self.lens = self.w = self.cols = None
        if self.graphs is not None:
            self.graphs.clear()


class RingKV(KVLayout):
    """One job's rows in the ring (see the module docstring)."""

    def __init__(self, pool: RingPool, rows: int, width: int):
        self.pool = pool
        self.rows = rows  # the most rows the job's batch can hold at once
        self.width = -(-width // ALIGN) * ALIGN  # columns a row needs (longest prefix + max_new), rounded up
        self.w = 0  # the write column, modulo the pool's width

    def rebuild(self, batch: Batch, keep: list[int], G: int, units: list[Unit], groups: dict[int, Group]) -> None:
        """Kept rows to the front; room for the new ones (allocated on the job's first admission)."""
        if batch.N:
            like = groups[units[0].group].kv if units else None
            self.pool.ensure(max(self.rows, batch.N), self.width, like, keep)

    def admit(self, batch: Batch, rows: list[int], units: list[Unit],
              groups: dict[int, Group]) -> tuple[list[int], list[int]]:
        """Write each new row's prefix at the columns before the write column; slots and copies are not used here."""
        if not units:
            return [], []
        pool = self.pool
        longest = max(u.length for u in units)
        span = torch.arange(longest, device=pool.device)
        dst_cols = (self.w - longest + span).remainder(pool.width)  # the prefix ends just before the write column
        at, by_group = 0, {}
        for u in units:  # (destination row, source row, end of the prefix in the group's padded cache) per row
            grp = groups[u.group]
            by_group.setdefault(u.group, []).extend((rows[at + c], u.row, grp.pads[u.row] + u.length)
                                                    for c in range(u.copies))
            at += u.copies
        for g, members in by_group.items():
            dst, src, end = (torch.tensor(x, device=pool.device) for x in zip(*members))
            # a row with a shorter prefix than the longest also gets the columns before it: masked, never read
            src_cols = (end.unsqueeze(1) - longest + span).clamp_(min=0)
            for li, (k, v) in enumerate(groups[g].kv):
                for buf, cache in ((pool.k[li], k), (pool.v[li], v)):
                    buf.transpose(1, 2)[dst.unsqueeze(1), dst_cols] = cache.transpose(1, 2)[src.unsqueeze(1), src_cols]
        zeros = [0] * len(rows)
        return zeros, zeros

    def retire(self, batch: Batch, slots: list[int]) -> None:
        """Nothing to free: a finished row's length is 0, so it attends to its own write column only."""

    def step(self, batch: Batch) -> None:
        """Every row wrote the write column: move it on."""
        self.w = (self.w + 1) % self.pool.width

    def forward(self, model: ModelCall, batch: Batch) -> torch.Tensor:
        """One decode step over the ring, as a graph replay on CUDA (``graphs.py``); the next-token logits [N, V]."""
        pool, n = self.pool, batch.N
        nb = bucket(n, pool.rows)
        pool.ids[:n].copy_(batch.pending)
        pool.pos[:n].copy_(batch.pos)
        torch.add(batch.b, batch.s, out=pool.lens[:n])
        if nb > n:  # padding rows: token 0 at position 0, attending to their own write column only
            for t in (pool.ids, pool.pos, pool.lens):
                t[n:nb].zero_()
        pool.w.fill_(self.w)
        if pool.graphs is None:
            return self._decode(model, nb)[:n]
        return pool.graphs.run(nb, lambda: self._decode(model, nb))[:n]

    def _decode(self, model: ModelCall, nb: int) -> torch.Tensor:
        """The step on the first ``nb`` rows of the pool's static buffers: only tensor operations of fixed shapes."""
        pool = self.pool
        cached = (pool.w - pool.cols).remainder(pool.width).unsqueeze(0) <= pool.lens[:nb].unsqueeze(1)
        mask = torch.zeros(nb, 1, 1, pool.width, dtype=pool.k[0].dtype, device=pool.device)
        mask.masked_fill_(~cached.view(nb, 1, 1, pool.width), float("-inf"))
        cache = DynamicCache()
        cache.layers = [RingLayer(k[:nb], v[:nb], pool.w) for k, v in zip(pool.k, pool.v)]
        with decoding(None, self, ring=True):
            return model(pool.ids[:nb].view(nb, 1), mask, pool.pos[:nb].view(nb, 1), cache)


def planned_rows(lengths: list[int], copies: int, budget: int, max_new: int) -> int:
    """The most rows a job's batch can hold: ``copies`` rows in all, and the scheduler keeps rows x (longest row +
    max_new) within ``budget``, so rows <= budget / (shortest prefix + max_new)."""
    return max(1, min(copies, budget // (min(lengths, default=1) + max_new)))
