"""CUDA graphs of the ring layout's decode step: one graph per batch-size bucket, captured on first use, replayed.

An eager decode step of a 24-layer model launches about a thousand kernels, each prepared by Python and the
dispatcher, so on a GPU it is bound by the host, not by the device. A graph records the launches once and
replays them with one call. A graph replays fixed kernels on fixed memory, so the step it records reads only
static buffers (``ring.RingPool``: the KV ring, the step's inputs) and the number of rows must not change: a
batch of N rows runs in the graph of the smallest bucket >= N, its rows N.. padding that attends to nothing.

Graphs share one memory pool (they never run at the same time) and live as long as the buffers and weights
they were captured on: ``ring.RingPool`` drops them when it reallocates or the weights move.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def bucket(n: int, cap: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) >= n, at most ``cap``:
    at most 1.5x the rows needed, and few graphs to capture."""
    p = 1
    while p < n:
        if p >= 2 and p * 3 // 2 >= n:
            return min(p * 3 // 2, cap)
        p *= 2
    return min(p, cap)


class Graphs:
    """Captured decode steps by key (the bucket), with the seconds spent capturing them."""

    def __init__(self):
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for every graph's intermediate tensors
        self.captured = 0  # graphs captured so far (a reallocation or new weights clear them, not this count)
        self.capture_s = 0.0  # seconds spent warming up and capturing

    def run(self, key: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay the graph of ``key`` (captured from ``step`` the first time); its output tensor, valid until the
        next replay."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(step)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the capture: library handles and workspaces are created here, not recorded
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.captured += 1
        self.capture_s += time.perf_counter() - t0
        return graph, out

    def clear(self) -> None:
        """Drop every graph (their buffers or weights are going away)."""
        self.graphs.clear()
        self.pool = None
