"""The rollout engine: batched sampling with KV-cache reuse for responses, Monte Carlo continuations and evaluation.

INTERFACE (fixed; other modules are written against it):

    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=256, stop=("\\n\\nProblem:",))
    engine = Engine(model, tokenizer, token_budget=65536)
    out = engine.generate(prompts, n=8, params=params, generator=g)   # list (per prompt) of list (n) of Sample
    mc  = engine.continuations(sequences, boundaries, k=9, params=params, generator=g)
          # mc[i][j] = k Samples continuing sequences[i][:boundaries[i][j]]

HOW IT WORKS

Both entry points reduce to one job: a list of *units* (a prefix, given as a token count of one source
sequence, and a number of copies to sample from it).

1. Prefill. Source sequences are sorted by length and forwarded in groups (left-padded, explicit
   ``attention_mask`` and true ``position_ids``), each group within ``token_budget`` (rows x length).
   One forward pass over a sequence (up to its last boundary) gives the KV cache for all its boundaries,
   and its logits at position ``b - 1`` give the first-token distribution of the continuations at
   boundary ``b``. Only those logits are materialised (``logits_to_keep`` with a tensor of positions).
2. Decode. Units (sorted by prefix length, so rows of one batch need little padding) are admitted into a
   running decode batch: the prefix's cached keys/values are sliced out of the group cache at the
   boundary, left-padded to the batch length, and repeated for the copies. The prefix is never
   re-encoded. Each step feeds one token per row through the model with a ``DynamicCache`` whose layers
   write new keys/values in place into a preallocated buffer (``_BufferLayer``; the stock layer
   concatenates, copying the whole cache every step, which dominates small-model decode); finished
   rows (EOS, stop string, length) are dropped from the cache at once, and all-padding columns on the
   left are trimmed. When the batch has shrunk, more units are admitted (continuous batching), always
   keeping ``rows x (length + max_new_tokens) <= token_budget``, so memory is bounded and a large Monte
   Carlo job is chunked automatically.

DETERMINISM. All randomness comes from ``generator`` (``torch.multinomial``). On CPU, the same inputs,
parameters, budget and seed give the same samples. The batch composition depends on the inputs and on
``token_budget``: a different budget (or a different job around a prompt) changes which rows share a
batch and how much left padding they get; this does not change the distribution, but it changes which
random numbers a given row draws, and (on GPU especially, where kernels depend on shapes) the float sums
can differ in the last bits, which can flip near-ties. On CUDA, results are reproducible only up to
such non-deterministic kernels. If ``generator`` lives on another device than the model, the
probabilities are moved to the generator's device for sampling.

LIMITS. The cache handling assumes full-attention layers stored as ``DynamicLayer`` (Llama, Qwen2 without
sliding window, GPT-2, Mistral without sliding window, ...). Models whose cache has sliding-window,
linear-attention or otherwise special layers raise ``NotImplementedError``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["SamplingParams", "Sample", "Engine"]


@dataclass
class SamplingParams:
    temperature: float = 0.6  # 0 means greedy
    top_p: float = 0.9
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, besides the tokenizer's EOS


@dataclass
class Sample:
    token_ids: list[int]  # generated tokens only; includes EOS if emitted, and the token that completed a stop string
    text: str  # tokenizer.decode(token_ids, skip_special_tokens=True)
    logprobs: list[float]  # per token: log_softmax(logits / T) (plain log_softmax when greedy), before top-p
    finish_reason: str  # "stop" (EOS or stop string) or "length"


# flags computed on the device each step, so only flagged rows cost Python time
_EOS, _CAND, _LEN = 1, 2, 4


class _Group:
    """A prefilled group of source sequences: per-layer keys/values [R, H, P, D] and pad per row."""

    def __init__(self, kv, pads, logits, col):
        self.kv = kv  # list of (keys, values)
        self.pads = pads  # long tensor [R]
        self.logits = logits  # [R, U, V] logits at the needed (padded) positions
        self.col = col  # (row, boundary b) -> column of logits


class _BufferLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a preallocated buffer [N, H, capacity, D].

    ``DynamicLayer.update`` concatenates, copying the whole cache every step; here the new column is
    written in place and ``keys``/``values`` are views ``[:, :, start:n]`` (``start`` > 0 after trimming
    all-padding columns on the left). The buffer grows (by copying) only if it runs out of room.
    """

    def __init__(self, keys, values, extra):
        super().__init__()
        N, H, L, D = keys.shape
        self.extra = extra
        self.kb = keys.new_empty(N, H, L + extra, D)  # columns past n are never read
        self.vb = values.new_empty(N, H, L + extra, D)
        self.kb[:, :, :L] = keys
        self.vb[:, :, :L] = values
        self.start, self.n = 0, L
        self.device, self.is_initialized = keys.device, True
        self._views()

    def _views(self):
        self.keys = self.kb[:, :, self.start : self.n]
        self.values = self.vb[:, :, self.start : self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        if self.n + m > self.kb.shape[2]:
            grow = (0, 0, 0, m + self.extra)
            self.kb, self.vb = F.pad(self.kb, grow), F.pad(self.vb, grow)
        self.kb[:, :, self.n : self.n + m] = key_states
        self.vb[:, :, self.n : self.n + m] = value_states
        self.n += m
        self._views()
        return self.keys, self.values

    def select(self, idx, trim):
        """Keep rows ``idx``; drop ``trim`` columns on the left."""
        lo = self.start + trim
        used = self.n - lo
        N, H, _, D = self.kb.shape
        kb = self.kb.new_empty(idx.numel(), H, used + self.extra, D)
        vb = self.vb.new_empty(idx.numel(), H, used + self.extra, D)
        kb[:, :, :used] = self.kb[:, :, lo : self.n].index_select(0, idx)
        vb[:, :, :used] = self.vb[:, :, lo : self.n].index_select(0, idx)
        self.kb, self.vb, self.start, self.n = kb, vb, 0, used
        self._views()


def _new_cache(kv, extra):
    cache = DynamicCache()
    cache.layers = [_BufferLayer(k, v, extra) for k, v in kv]
    return cache


class Engine:
    def __init__(self, model, tokenizer, token_budget: int = 65536):
        self.model = model
        self.tokenizer = tokenizer
        self.token_budget = int(token_budget)
        sig = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in sig else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in sig
        eos: set[int] = set()
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        gen_cfg = getattr(model, "generation_config", None)
        g_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if g_eos is not None:
            eos.update(int(e) for e in ([g_eos] if isinstance(g_eos, int) else g_eos))
        self.eos_token_ids = sorted(eos)
        self._cand_tables: dict[tuple[tuple[str, ...], int], torch.Tensor] = {}

    # ------------------------------------------------------------------ public API

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Sample]]:
        """n samples per prompt; each prompt's KV cache is computed once and shared by its n samples."""
        for p in prompts:
            if len(p) == 0:
                raise ValueError("empty prompt")
        out = self._run([list(p) for p in prompts], [[len(p)] for p in prompts], n, params, generator, progress)
        return [r[0] for r in out]

    def continuations(
        self,
        sequences: list[list[int]],
        boundaries: list[list[int]],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[list[Sample]]]:
        """result[i][j]: k samples continuing sequences[i][:boundaries[i][j]]."""
        if len(sequences) != len(boundaries):
            raise ValueError("sequences and boundaries differ in length")
        for s, bs in zip(sequences, boundaries):
            prev = 0
            for b in bs:
                if not (prev < b <= len(s)):
                    raise ValueError(f"boundaries must be increasing, >= 1 and <= len(sequence): {bs} for length {len(s)}")
                prev = b
        return self._run([list(s) for s in sequences], [list(b) for b in boundaries], k, params, generator, progress)

    # ------------------------------------------------------------------ the job

    def _run(self, seqs, bounds, k, params, generator, progress):
        if k < 1:
            raise ValueError("need at least one sample per prefix")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        out = [[[None] * k for _ in bs] for bs in bounds]
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                self._job(seqs, bounds, k, params, generator, progress, out)
        finally:
            if was_training:
                model.train()
        return out

    def _job(self, seqs, bounds, k, params, generator, progress, out):
        dev = self.device
        budget = self.token_budget
        max_new = params.max_new_tokens
        vocab = self.model.get_output_embeddings().weight.shape[0]
        logit_budget = max(budget * 1024, vocab)  # floats of prefill logits held at once

        # ---- prefill groups: sequences sorted by length (only up to the last boundary is needed)
        order = sorted((i for i in range(len(seqs)) if bounds[i]), key=lambda i: bounds[i][-1])
        groups_idx: list[list[int]] = []
        cur: list[int] = []
        cur_max = cur_nb = 0
        for i in order:
            n_i, nb = bounds[i][-1], len(bounds[i])
            if cur and ((len(cur) + 1) * max(cur_max, n_i) > budget or (len(cur) + 1) * (cur_nb + nb) * vocab > logit_budget):
                groups_idx.append(cur)
                cur, cur_max, cur_nb = [], 0, 0
            cur.append(i)
            cur_max, cur_nb = max(cur_max, n_i), cur_nb + nb
        if cur:
            groups_idx.append(cur)

        # ---- units per group, sorted by prefix length; copies split so one unit fits the budget
        queue = []  # (group number, row in group, seq i, boundary j, b, first copy, copies)
        for g, members in enumerate(groups_idx):
            units = []
            for r, i in enumerate(members):
                for j, b in enumerate(bounds[i]):
                    per = max(1, budget // (b + max_new))
                    for c0 in range(0, k, per):
                        units.append((g, r, i, j, b, c0, min(per, k - c0)))
            units.sort(key=lambda u: u[4])
            queue.extend(units)
        queue.reverse()  # pop() from the end

        groups: dict[int, _Group] = {}
        counts: dict[int, int] = {}
        for u in queue:
            counts[u[0]] = counts.get(u[0], 0) + 1

        cand = self._candidate_table(params.stop, vocab, dev)
        eos_t = torch.tensor(self.eos_token_ids or [-1], device=dev)
        window = (max((len(s) for s in params.stop), default=0)) + 8

        # ---- running batch state
        cache = None  # DynamicCache with layers [N, H, L, D]
        N = 0
        L = 0
        mask = pos = pending = tok_buf = lp_buf = gen_len = None
        meta: list[tuple[int, int, int]] = []  # (seq i, boundary j, copy c) per row
        done = 0

        def finish(row, g, reason, tok_row, lp_row):
            nonlocal done
            i, j, c = meta[row]
            ids = tok_row[:g]
            out[i][j][c] = Sample(
                token_ids=ids,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                logprobs=lp_row[:g],
                finish_reason=reason,
            )
            done += 1

        def check(tok, rows_tok_buf, rows_lp_buf, rows_gen_len, rows_alive, base=0):
            """Flags for freshly sampled tokens of rows base.. ; returns the (batch) indices of live rows that finished."""
            flag = torch.isin(tok, eos_t).to(torch.int8) * _EOS + (rows_gen_len >= max_new).to(torch.int8) * _LEN
            if cand is not None:
                flag = flag + cand[tok] * _CAND
            flag = flag * rows_alive
            flagged = torch.nonzero(flag).view(-1)
            if flagged.numel() == 0:
                return []
            fl = flag[flagged].tolist()
            rows = flagged.tolist()
            finished = []
            for r, f in zip(rows, fl):
                reason = None
                if f & _EOS:
                    reason = "stop"
                else:
                    if f & _CAND:
                        g = int(rows_gen_len[r])
                        tail = rows_tok_buf[r, max(0, g - window) : g].tolist()
                        text = self.tokenizer.decode(tail, skip_special_tokens=True)
                        if any(s in text for s in params.stop):
                            reason = "stop"
                    if reason is None and f & _LEN:
                        reason = "length"
                if reason is not None:
                    g = int(rows_gen_len[r])
                    finish(base + r, g, reason, rows_tok_buf[r, :g].tolist(), rows_lp_buf[r, :g].tolist())
                    finished.append(base + r)
            return finished

        alive = None  # int8 [N]: 0 for finished rows still held in the batch
        dead: list[int] = []

        def compact():
            nonlocal cache, N, L, mask, pos, pending, tok_buf, lp_buf, gen_len, alive, dead
            keep = self._keep(dead, N)
            idx = torch.tensor(keep, device=dev)
            cache, N, L, mask, pos, pending, tok_buf, lp_buf, gen_len = self._select(
                keep, cache, mask, pos, pending, tok_buf, lp_buf, gen_len, meta)
            alive = alive.index_select(0, idx) if N else None
            dead = []

        def retire(rows):
            # finished rows stay (masked out of the flags) until a quarter of the batch is finished, then the
            # batch is compacted: copying the cache at every finish would cost more than the wasted rows
            dead.extend(rows)
            r = torch.tensor(rows, device=dev)
            alive[r] = 0
            gen_len[r] = 0
            pos[r] = 0  # keeps a finished row's (ignored) positions inside the model's range
            if progress is not None:
                progress(done)

        while True:
            # ---- admit units into the batch while there is room
            admitted = []
            if queue:
                cap = budget // (max(L, queue[-1][4]) + max_new)
                if N == 0 or N - len(dead) <= 0.75 * cap:
                    B, rows = L, N
                    while queue:
                        u = queue[-1]
                        nb = max(B, u[4])
                        if rows > 0 and (rows + u[6]) * (nb + max_new) > budget:
                            break
                        queue.pop()
                        admitted.append(u)
                        B, rows = nb, rows + u[6]
            if admitted:
                if dead:
                    compact()
                # prefill the groups these units come from (each group once)
                for u in admitted:
                    if u[0] not in groups:
                        groups[u[0]] = self._prefill(groups_idx[u[0]], seqs, bounds)
                state = self._admit(admitted, groups, counts, cache, N, L, mask, pos, pending,
                                    tok_buf, lp_buf, gen_len, meta, params, generator, max_new)
                cache, N, L, mask, pos, pending, tok_buf, lp_buf, gen_len, new_tok, new_lp, first = state
                ones = torch.ones(N - first, dtype=torch.int8, device=dev)
                alive = ones if first == 0 else torch.cat([alive, ones])
                # the new rows' first tokens may already finish them
                sl = slice(first, N)
                fin = check(new_tok, tok_buf[sl], lp_buf[sl], gen_len[sl], alive[sl], base=first)
                if fin:
                    retire(fin)
            if N and len(dead) >= max(1, N // 4):
                compact()
            if N == 0:
                if queue:
                    continue
                break

            # ---- one decode step
            mask = torch.cat([mask, mask.new_ones(N, 1)], dim=1)
            logits = self.model(
                input_ids=pending.view(N, 1),
                attention_mask=mask,
                position_ids=pos.view(N, 1),
                use_cache=True,
                **{self._cache_kw: cache},
            ).logits[:, -1, :]
            L += 1
            tok, lp = self._sample(logits, params, generator)
            idx = gen_len.clamp_max(max_new - 1).view(N, 1)
            tok_buf.scatter_(1, idx, tok.view(N, 1))
            lp_buf.scatter_(1, idx, lp.view(N, 1))
            gen_len += 1
            pos += 1
            pending = tok
            fin = check(tok, tok_buf, lp_buf, gen_len, alive)
            if fin:
                retire(fin)

    # ------------------------------------------------------------------ pieces

    def _prefill(self, members, seqs, bounds) -> _Group:
        """One forward over each member sequence (up to its last boundary); logits only at boundaries."""
        dev = self.device
        lens = [bounds[i][-1] for i in members]
        P = max(lens)
        R = len(members)
        ids = torch.zeros(R, P, dtype=torch.long)
        am = torch.zeros(R, P, dtype=torch.long)
        for r, i in enumerate(members):
            n = lens[r]
            ids[r, P - n :] = torch.tensor(seqs[i][:n], dtype=torch.long)
            am[r, P - n :] = 1
        ids, am = ids.to(dev), am.to(dev)
        position_ids = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)
        # padded positions whose logits are needed
        need = sorted({P - lens[r] + b - 1 for r, i in enumerate(members) for b in bounds[i]})
        col = {p: c for c, p in enumerate(need)}
        kwargs = {}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = torch.tensor(need, device=dev)
        res = self.model(input_ids=ids, attention_mask=am, position_ids=position_ids, use_cache=True, **kwargs)
        logits = res.logits
        if not self._has_logits_to_keep:
            logits = logits[:, need]
        cache = getattr(res, "cache", None) or getattr(res, "past_key_values", None)
        kv = _layers_kv(cache)
        pads = torch.tensor([P - n for n in lens], device=dev)
        colmap = {(r, b): col[P - lens[r] + b - 1] for r, i in enumerate(members) for b in bounds[i]}
        return _Group(kv, pads, logits, colmap)

    def _admit(self, admitted, groups, counts, cache, N, L, mask, pos, pending,
               tok_buf, lp_buf, gen_len, meta, params, generator, max_new):
        """Add the admitted units' rows to the batch; sample their first tokens from the prefill logits."""
        dev = self.device
        B = max(u[4] for u in admitted)
        M = sum(u[6] for u in admitted)
        # rows, grouped by source group so each gather reads one group cache
        by_group: dict[int, list] = {}
        for u in admitted:
            by_group.setdefault(u[0], []).append(u)
        parts_kv = []
        new_meta = []
        first_logits = []
        bvals = []
        for g, units in by_group.items():
            grp = groups[g]
            rows = []
            bs = []
            for (_, r, i, j, b, c0, nc) in units:
                rows.extend([r] * nc)
                bs.extend([b] * nc)
                new_meta.extend((i, j, c0 + c) for c in range(nc))
                first_logits.append(grp.logits[r, grp.col[(r, b)]].unsqueeze(0).expand(nc, -1))
            rows_t = torch.tensor(rows, device=dev)
            b_t = torch.tensor(bs, device=dev)
            t = torch.arange(B, device=dev)
            src = (grp.pads[rows_t] + b_t - B).unsqueeze(1) + t.unsqueeze(0)  # [m, B]
            src = src.clamp_min(0)
            kvg = []
            for keys, values in grp.kv:
                H = keys.shape[1]
                h = torch.arange(H, device=dev).view(1, H, 1)
                ri = rows_t.view(-1, 1, 1)
                si = src.unsqueeze(1)
                kvg.append((keys[ri, h, si], values[ri, h, si]))
            parts_kv.append(kvg)
            bvals.extend(bs)
            counts[g] -= len(units)
            if counts[g] == 0:  # every unit of the group is in the batch: free its prefill cache
                del groups[g]
        new_kv = [
            (torch.cat([p[li][0] for p in parts_kv]), torch.cat([p[li][1] for p in parts_kv]))
            for li in range(len(parts_kv[0]))
        ]
        b_all = torch.tensor(bvals, device=dev)
        new_mask = (torch.arange(B, device=dev).unsqueeze(0) >= (B - b_all).unsqueeze(1)).long()
        # first tokens
        logits = torch.cat(first_logits)
        tok, lp = self._sample(logits, params, generator)
        new_tok_buf = torch.zeros(M, max_new, dtype=torch.long, device=dev)
        new_lp_buf = torch.zeros(M, max_new, dtype=torch.float32, device=dev)
        new_tok_buf[:, 0] = tok
        new_lp_buf[:, 0] = lp
        new_gen = torch.ones(M, dtype=torch.long, device=dev)
        new_pos = b_all.clone()
        meta.extend(new_meta)
        if N == 0:
            cache = _new_cache(new_kv, min(max_new + 1, 64))
            return (cache, M, B, new_mask, new_pos, tok, new_tok_buf, new_lp_buf, new_gen, tok, lp, 0)
        Lm = max(L, B)
        cache = _new_cache(
            [(torch.cat([_lpad(layer.keys, Lm - L), _lpad(nk, Lm - B)]),
              torch.cat([_lpad(layer.values, Lm - L), _lpad(nv, Lm - B)]))
             for layer, (nk, nv) in zip(cache.layers, new_kv)],
            min(max_new + 1, 64),
        )
        mask = torch.cat([F.pad(mask, (Lm - L, 0)), F.pad(new_mask, (Lm - B, 0))])
        return (
            cache, N + M, Lm, mask, torch.cat([pos, new_pos]), torch.cat([pending, tok]),
            torch.cat([tok_buf, new_tok_buf]), torch.cat([lp_buf, new_lp_buf]), torch.cat([gen_len, new_gen]),
            tok, lp, N,
        )

    @staticmethod
    def _keep(finished, N):
        f = set(finished)
        return [r for r in range(N) if r not in f]

    def _select(self, keep, cache, mask, pos, pending, tok_buf, lp_buf, gen_len, meta):
        """Drop finished rows from the batch and trim all-padding columns on the left."""
        meta[:] = [meta[r] for r in keep]
        N = len(keep)
        if N == 0:
            return None, 0, 0, None, None, None, None, None, None
        idx = torch.tensor(keep, device=mask.device)
        mask = mask.index_select(0, idx)
        trim = int((mask.shape[1] - mask.sum(1)).min())
        for layer in cache.layers:
            layer.select(idx, trim)
        if trim:
            mask = mask[:, trim:]
        return (cache, N, mask.shape[1], mask, pos.index_select(0, idx), pending.index_select(0, idx),
                tok_buf.index_select(0, idx), lp_buf.index_select(0, idx), gen_len.index_select(0, idx))

    @staticmethod
    def _sample(logits, params, generator):
        """Sample one token per row; return (tokens [N], log-probs [N] before top-p, float32)."""
        logits = logits.float()
        T = params.temperature
        if T <= 0:
            lp_all = torch.log_softmax(logits, dim=-1)
            tok = lp_all.argmax(dim=-1)
            return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1)
        lp_all = torch.log_softmax(logits / T, dim=-1)
        if params.top_p < 1.0:
            sorted_lp, sorted_idx = lp_all.sort(dim=-1, descending=True)
            probs = sorted_lp.exp()
            cum = probs.cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass is already >= top_p
            probs = probs.masked_fill((cum - probs) >= params.top_p, 0.0)
            choice = _multinomial(probs, generator)
            tok = sorted_idx.gather(1, choice.view(-1, 1)).view(-1)
        else:
            tok = _multinomial(lp_all.exp(), generator)
        return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1)

    def _candidate_table(self, stop, vocab, dev):
        """int8 [V]: 1 where a token could complete one of the stop strings (others skip the text check)."""
        if not stop:
            return None
        key = (tuple(stop), vocab)
        if key not in self._cand_tables:
            lasts = {s[-1] for s in stop if s}
            if any(ch.isspace() for ch in lasts) or "" in stop:
                table = torch.ones(vocab, dtype=torch.int8)
            else:
                pieces = self.tokenizer.batch_decode([[t] for t in range(vocab)], skip_special_tokens=False)
                table = torch.tensor(
                    [any(ch in p for ch in lasts) or "\ufffd" in p or p == "" for p in pieces], dtype=torch.int8
                )
            self._cand_tables[key] = table
        return self._cand_tables[key].to(dev)


def _multinomial(probs, generator):
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).view(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


def _lpad(x, n):
    """Left-pad a [N, H, L, D] tensor with n zero columns along L."""
    return F.pad(x, (0, 0, n, 0)) if n else x


def _layers_kv(cache):
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
