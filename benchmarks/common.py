"""What several benchmarks share: the CPU thread count, and a tokenizer for random-weight models."""

from __future__ import annotations

import os

import torch


def set_threads(n: int | None = None) -> int:
    """Use `n` torch threads (None: every core this process may run on); returns the number."""
    if not n:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:
            n = os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


class NullTok:
    """A tokenizer for random weights: no EOS, every text empty (the engine runs to the length limit)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def batch_decode(self, ids, skip_special_tokens=False):
        return ["" for _ in ids]
