"""Finishing rows: EOS, stop strings and length, flagged on the device each step so only flagged rows cost Python."""

from __future__ import annotations

import torch

from vineppo.engine.api import Progress, Sample
from vineppo.engine.batch import Batch

# flags computed on the device each step
_EOS, _CAND, _LEN = 1, 2, 4
STOP_WINDOW = 8  # tokens decoded past the longest stop string's length when looking for it at a row's end


def candidate_table(tokenizer, stop: tuple[str, ...], vocab: int, cache: dict) -> torch.Tensor | None:
    """int8 [V]: 1 where a token could complete one of the stop strings (others skip the text check); memoised."""
    if not stop:
        return None
    key = (tuple(stop), vocab)
    if key not in cache:
        lasts = {s[-1] for s in stop if s}
        if any(ch.isspace() for ch in lasts) or "" in stop:
            table = torch.ones(vocab, dtype=torch.int8)
        else:
            pieces = tokenizer.batch_decode([[t] for t in range(vocab)], skip_special_tokens=False)
            table = torch.tensor(
                [any(ch in p for ch in lasts) or "\ufffd" in p or p == "" for p in pieces], dtype=torch.int8
            )
        cache[key] = table
    return cache[key]


class Finisher:
    """Ends the rows whose newest token finishes them and writes their Samples into ``out[i][j][c]``."""

    def __init__(self, tokenizer, stop: tuple[str, ...], eos: torch.Tensor, cand: torch.Tensor | None, out: list,
                 progress: Progress | None):
        self.tokenizer, self.stop, self.eos, self.cand, self.out, self.progress = tokenizer, stop, eos, cand, out, progress
        self.window = max((len(s) for s in stop), default=0) + STOP_WINDOW
        self.done = self.tokens = 0  # samples finished so far in the job, and their tokens

    def check(self, batch: Batch, tok: torch.Tensor, rows: torch.Tensor | None = None) -> list[tuple[int, int]]:
        """Finish the rows (all, or the indices ``rows``) whose fresh tokens ``tok`` end them (EOS, stop, length);
        return the (sequence i, boundary j) of each sample written, in order (adaptive jobs count them)."""
        sl = slice(None) if rows is None else rows
        gen = batch.gen[sl]
        flag = torch.isin(tok, self.eos).to(torch.int8) * _EOS + (gen >= batch.limit[sl]).to(torch.int8) * _LEN
        if self.cand is not None:
            flag = flag + self.cand[tok] * _CAND
        flag = flag * batch.alive[sl]
        flagged = torch.nonzero(flag).view(-1)
        if flagged.numel() == 0:
            return []
        finished, written = [], []
        index = None if rows is None else rows.tolist()
        for r, f in zip(flagged.tolist(), flag[flagged].tolist()):
            row = r if index is None else index[r]
            reason = self._reason(batch, row, int(gen[r]), f)
            if reason is not None:
                written.append(self._emit(batch, row, int(gen[r]), reason))
                finished.append(row)
        if finished:
            self.done += len(finished)
            batch.retire(finished)
            if self.progress is not None:
                self.progress(self.done, self.tokens)
        return written

    def _reason(self, batch: Batch, row: int, n: int, f: int) -> str | None:
        """'stop' (EOS, or a stop string at the row's end), 'length', or None (a candidate that completed nothing)."""
        if f & _EOS:
            return "stop"
        if f & _CAND:
            tail = batch.tok[row, max(0, n - self.window) : n].tolist()
            if any(s in self.tokenizer.decode(tail, skip_special_tokens=True) for s in self.stop):
                return "stop"
        return "length" if f & _LEN else None

    def _emit(self, batch: Batch, row: int, n: int, reason: str) -> tuple[int, int]:
        """Write row ``row``'s sample of ``n`` tokens into ``out``; its (i, j)."""
        ids = batch.tok[row, :n].tolist()
        self.tokens += n
        i, j, c = batch.meta[row]
        self.out[i][j][c] = Sample(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                   logprobs=batch.lp[row, :n].tolist(), finish_reason=reason,
                                   entropies=None if batch.ent is None else batch.ent[row, :n].tolist())
        return i, j
