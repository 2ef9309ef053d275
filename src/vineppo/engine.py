"""The rollout engine: batched sampling with KV-cache reuse for responses, Monte Carlo continuations and evaluation.

INTERFACE (fixed; other modules are written against it):

    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=256, stop=("\\n\\nProblem:",))
    engine = Engine(model, tokenizer, token_budget=65536)
    out = engine.generate(prompts, n=8, params=params, generator=g)   # list (per prompt) of list (n) of Sample
    mc  = engine.continuations(sequences, boundaries, k=9, params=params, generator=g, budgets=budgets)
          # mc[i][j] = k Samples continuing sequences[i][:boundaries[i][j]], each with at most
          # budgets[i][j] new tokens (default: params.max_new_tokens)

HOW IT WORKS

Both entry points reduce to one job: a list of *units* (a prefix, given as a token count of one source
sequence, and a number of copies to sample from it).

1. Prefill. Source sequences are sorted by length and forwarded in groups (left-padded, explicit
   ``attention_mask`` and true ``position_ids``), each group within ``token_budget`` (rows x length).
   One forward pass over a sequence (up to its last boundary) gives the KV cache for all its boundaries,
   and its logits at position ``b - 1`` give the first-token distribution of the continuations at
   boundary ``b``. Only those logits are materialised (``logits_to_keep`` with a tensor of positions).
2. Decode. Units (sorted by prefix length, so rows of one batch need little padding) are admitted into a
   running decode batch: the prefix's cached keys/values are copied out of the group cache at the
   boundary, right-aligned with the batch's other rows, once per copy. The prefix is never re-encoded.
   Each step feeds one token per row through the model with a ``DynamicCache`` whose layers write new
   keys/values in place into a preallocated buffer (``_BufferLayer``; the stock layer concatenates,
   copying the whole cache every step, which dominates small-model decode). Finished rows (EOS, stop
   string, length) are masked out at once, and padding columns on the left are dropped by moving the
   cache view. New units are admitted as soon as rows finish (continuous batching): their rows take the
   finished rows' places in place, so no other row is copied. The batch is rebuilt (each kept row copied
   once into a fresh buffer) only to grow, to shed finished rows no new row takes, to stay within the
   budget as the cache lengthens, or when a new prefix does not fit left of the write column. Admission
   always keeps ``rows x (length + max_new_tokens) <= token_budget``, so memory is bounded and a large
   Monte Carlo job is chunked automatically.
3. Sampling. Top-p first looks at the ``TOP_K`` most likely tokens; when they hold ``top_p`` of the mass
   (as usual at T < 1) the nucleus is among them and a full sort of the vocabulary is skipped.

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


END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
TOP_K = 32  # top-p sampling first tries the TOP_K most likely tokens (exact when they hold top_p of the mass)

# flags computed on the device each step, so only flagged rows cost Python time
_EOS, _CAND, _LEN = 1, 2, 4


class _Group:
    """A prefilled group of source sequences: per-layer keys/values [R, H, P, D] and pad per row."""

    def __init__(self, kv, pads, logits, col):
        self.kv = kv  # list of (keys, values)
        self.pads = pads  # left padding per row (ints)
        self.logits = logits  # [R, U, V] logits at the needed (padded) positions
        self.col = col  # (row, boundary b) -> column of logits


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


def _new_cache(kv, extra):
    """A DynamicCache of buffer layers holding copies of ``kv`` (a list of (keys, values) per layer)."""
    cache = DynamicCache()
    cache.layers = []
    for k, v in kv:
        N, H, L, D = k.shape
        kb, vb = k.new_empty(N, H, L + extra, D), v.new_empty(N, H, L + extra, D)
        kb[:, :, :L], vb[:, :, :L] = k, v
        cache.layers.append(_BufferLayer(kb, vb, L, extra))
    return cache


class _Batch:
    """The running decode batch, one row per sample being generated.

    Rows are right-aligned: every row writes its next token at the same column, so a row holding t tokens
    (prefix + generated) occupies the last t of the L columns of the view; the columns to its left hold
    finite keys/values (zeros, or a finished row's leftovers) and are masked out. A finished row stays in
    place, masked, until a new row takes its place (``fill``) or the batch is rebuilt.
    """

    def __init__(self, dev, max_new, extra, budgets):
        self.dev, self.max_new, self.extra = dev, max_new, extra
        self.budgets = budgets  # budgets[i][j]: new tokens allowed to the rows continuing boundary j of sequence i
        self.N = self.L = 0
        self.cache = None  # DynamicCache of _BufferLayer
        self.meta: list[tuple[int, int, int]] = []  # (seq i, boundary j, copy c) per row
        self.dead: list[int] = []  # finished rows still held, masked, until refilled or rebuilt away
        self.mask = self.pos = self.pending = self.tok = self.lp = self.gen = self.limit = self.alive = None

    def _limits(self, units):
        """The new-token budget of every row of ``units``, in row order."""
        return torch.tensor([self.budgets[u[2]][u[3]] for u in units for _ in range(u[6])], dtype=torch.long,
                            device=self.dev)

    def rebuild(self, units, groups, tok0, lp0):
        """Drop dead rows, trim all-padding columns on the left and append the rows of ``units``.

        Each kept row's keys/values are copied once, straight into the new buffer, and each new row's prefix
        is copied once out of its group's prefill cache (the prefix is never re-encoded). ``tok0``/``lp0`` are
        the new rows' first tokens, already sampled from the prefill logits.
        """
        dev = self.dev
        dead = set(self.dead)
        keep = [r for r in range(self.N) if r not in dead]
        Nk = len(keep)
        old_mask = self.mask
        if Nk and dead:
            keep_t = torch.tensor(keep, device=dev)
            old_mask = old_mask.index_select(0, keep_t)
        trim = int((old_mask.shape[1] - old_mask.sum(1)).min()) if Nk else 0
        L_old = self.L - trim if Nk else 0
        new_b = [u[4] for u in units for _ in range(u[6])]
        M = len(new_b)
        L = max([L_old] + new_b)
        N = Nk + M
        self.meta = [self.meta[r] for r in keep] + [(u[2], u[3], u[5] + c) for u in units for c in range(u[6])]
        self.dead = []
        self.N, self.L = N, L
        if N == 0:
            self.cache = self.mask = self.pos = self.pending = None
            self.tok = self.lp = self.gen = self.limit = self.alive = None
            return
        # runs of consecutive kept rows: slice copies, no index_select temporaries
        runs = []
        for r in keep:
            if runs and runs[-1][1] == r:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        n_layers = len(self.cache.layers) if Nk else len(groups[units[0][0]].kv)
        layers = []
        for li in range(n_layers):
            pair = []
            for w in range(2):  # keys, values
                if Nk:
                    old_layer = self.cache.layers[li]
                    old = (old_layer.keys, old_layer.values)[w]
                else:
                    old = groups[units[0][0]].kv[li][w]
                _, H, _, D = old.shape
                buf = old.new_empty(N, H, L + self.extra, D)
                if Nk:
                    buf[:Nk, :, : L - L_old].zero_()
                    src = old[:, :, trim : trim + L_old]
                    d = 0
                    for a, b in runs:
                        buf[d : d + b - a, :, L - L_old : L] = src[a:b]
                        d += b - a
                row = Nk
                for g, r, _i, _j, b, _c0, nc in units:
                    grp = groups[g]
                    p = grp.pads[r]
                    buf[row : row + nc, :, : L - b].zero_()
                    buf[row : row + nc, :, L - b : L] = grp.kv[li][w][r, :, p : p + b]
                    row += nc
                pair.append(buf)
            layers.append(_BufferLayer(pair[0], pair[1], L, self.extra))
        self.cache = DynamicCache()
        self.cache.layers = layers

        b_new = torch.tensor(new_b, dtype=torch.long, device=dev)
        mask = torch.zeros(N, L, dtype=torch.long, device=dev)
        if Nk:
            mask[:Nk, L - L_old :] = old_mask[:, trim:]
        if M:
            mask[Nk:] = (torch.arange(L, device=dev).unsqueeze(0) >= (L - b_new).unsqueeze(1)).long()
        self.mask = mask
        new_tok = torch.zeros(M, self.max_new, dtype=torch.long, device=dev)
        new_lp = torch.zeros(M, self.max_new, dtype=torch.float32, device=dev)
        if M:
            new_tok[:, 0], new_lp[:, 0] = tok0, lp0
        else:
            tok0 = new_tok[:, 0]
        fields = (("pos", b_new), ("pending", tok0), ("tok", new_tok), ("lp", new_lp),
                  ("gen", torch.ones(M, dtype=torch.long, device=dev)), ("limit", self._limits(units)),
                  ("alive", torch.ones(M, dtype=torch.int8, device=dev)))
        for name, new in fields:
            cur = getattr(self, name)
            if Nk:
                cur = cur.index_select(0, keep_t) if dead else cur
                new = torch.cat([cur, new])
            setattr(self, name, new)

    @property
    def n(self):
        """The cache's write column in its buffer: a prefix of b tokens can be written in place if b <= n."""
        return self.cache.layers[0].n if self.N else 0

    def fill(self, units, groups, tok0, lp0):
        """Write the rows of ``units`` in place of finished rows (no other row is copied); return their indices.

        Needs at least as many finished rows as new rows, and every new prefix to fit left of the write column.
        """
        layers = self.cache.layers
        n = layers[0].n
        B = max(u[4] for u in units)
        if B > self.L:  # widen the view to the left: those columns are finite and masked for the other rows
            for layer in layers:
                layer.start = n - B
                layer._views()
            self.mask = F.pad(self.mask, (B - self.L, 0))
            self.L = B
        M = sum(u[6] for u in units)
        slots = self.dead[:M]
        self.dead = self.dead[M:]
        idx = torch.tensor(slots, device=self.dev)
        b_new = torch.tensor([u[4] for u in units for _ in range(u[6])], device=self.dev)
        row = 0
        for g, r, i, j, b, c0, nc in units:
            grp, rows = groups[g], idx[row : row + nc]
            p = grp.pads[r]
            for layer, (k, v) in zip(layers, grp.kv):
                layer.kb[rows, :, n - b : n] = k[r, :, p : p + b]
                layer.vb[rows, :, n - b : n] = v[r, :, p : p + b]
            self.mask[rows] = 0
            self.mask[rows, self.L - b :] = 1
            for c in range(nc):
                self.meta[slots[row + c]] = (i, j, c0 + c)
            row += nc
        self.pos[idx], self.pending[idx], self.gen[idx], self.alive[idx] = b_new, tok0, 1, 1
        self.limit[idx] = self._limits(units)
        self.tok[idx], self.lp[idx] = 0, 0.0
        self.tok[idx, 0], self.lp[idx, 0] = tok0, lp0
        return idx

    def retire(self, rows):
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
        # A chat model ends a turn with a token that need not be its tokenizer's EOS (SmolLM2: <|endoftext|>
        # besides <|im_end|>): every known end-of-turn token the tokenizer has as a special token stops a row.
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        special |= set(getattr(tokenizer, "added_tokens_encoder", ()))
        eos.update(int(tokenizer.convert_tokens_to_ids(t)) for t in END_OF_TURN if t in special)
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
        budgets: list[list[int]] | None = None,
    ) -> list[list[list[Sample]]]:
        """result[i][j]: k samples continuing sequences[i][:boundaries[i][j]], each of at most budgets[i][j] tokens."""
        if len(sequences) != len(boundaries):
            raise ValueError("sequences and boundaries differ in length")
        for s, bs in zip(sequences, boundaries):
            prev = 0
            for b in bs:
                if not (prev < b <= len(s)):
                    raise ValueError(f"boundaries must be increasing, >= 1 and <= len(sequence): {bs} for length {len(s)}")
                prev = b
        if budgets is not None:
            if [len(b) for b in budgets] != [len(b) for b in boundaries]:
                raise ValueError("budgets must have the nesting of boundaries")
            if any(not 1 <= n <= params.max_new_tokens for bs in budgets for n in bs):
                raise ValueError(f"budgets must lie in 1..max_new_tokens={params.max_new_tokens}")
        return self._run([list(s) for s in sequences], [list(b) for b in boundaries], k, params, generator, progress,
                         budgets)

    # ------------------------------------------------------------------ the job

    def _run(self, seqs, bounds, k, params, generator, progress, budgets=None):
        if k < 1:
            raise ValueError("need at least one sample per prefix")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        out = [[[None] * k for _ in bs] for bs in bounds]
        budgets = budgets or [[params.max_new_tokens] * len(bs) for bs in bounds]
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                self._job(seqs, bounds, budgets, k, params, generator, progress, out)
        finally:
            if was_training:
                model.train()
        return out

    def _job(self, seqs, bounds, budgets, k, params, generator, progress, out):
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
        batch = _Batch(dev, max_new, extra=min(max_new + 1, 64), budgets=budgets)
        done = 0

        def check(tok, rows=None):
            """Finish the rows (all, or the indices ``rows``) whose fresh tokens ``tok`` end them (EOS, stop, length)."""
            nonlocal done
            sl = slice(None) if rows is None else rows
            gen = batch.gen[sl]
            flag = torch.isin(tok, eos_t).to(torch.int8) * _EOS + (gen >= batch.limit[sl]).to(torch.int8) * _LEN
            if cand is not None:
                flag = flag + cand[tok] * _CAND
            flag = flag * batch.alive[sl]
            flagged = torch.nonzero(flag).view(-1)
            if flagged.numel() == 0:
                return
            finished = []
            index = None if rows is None else rows.tolist()
            for r, f in zip(flagged.tolist(), flag[flagged].tolist()):
                row = r if index is None else index[r]
                n = int(gen[r])
                reason = "stop" if f & _EOS else None
                if reason is None and f & _CAND:
                    tail = batch.tok[row, max(0, n - window) : n].tolist()
                    if any(s in self.tokenizer.decode(tail, skip_special_tokens=True) for s in params.stop):
                        reason = "stop"
                if reason is None and f & _LEN:
                    reason = "length"
                if reason is not None:
                    i, j, c = batch.meta[row]
                    ids = batch.tok[row, :n].tolist()
                    out[i][j][c] = Sample(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                          logprobs=batch.lp[row, :n].tolist(), finish_reason=reason)
                    finished.append(row)
            if finished:
                done += len(finished)
                batch.retire(finished)
                if progress is not None:
                    progress(done)

        while True:
            # ---- admit units as soon as rows have finished (or the batch could grow by a third). New rows take
            # finished rows' places in place, which is cheap; the batch is rebuilt (copied) only to grow, to shed
            # finished rows no new row takes (a quarter of the batch), to stay within the budget as the cache
            # lengthens, or when a new prefix does not fit left of the cache's write column.
            admitted = []
            live = batch.N - len(batch.dead)
            if queue:
                cap = budget // (max(batch.L, queue[-1][4]) + max_new)
                if batch.N == 0 or batch.dead or live <= 0.75 * cap:
                    room = len(batch.dead) if batch.N and cap < 1.25 * batch.N else cap
                    L, rows, new = batch.L, live, 0
                    while queue:
                        u = queue[-1]
                        nb = max(L, u[4])
                        if rows > 0 and ((rows + u[6]) * (nb + max_new) > budget or new + u[6] > room):
                            break
                        admitted.append(queue.pop())
                        L, rows, new = nb, rows + u[6], new + u[6]
            if admitted:
                for u in admitted:  # prefill the groups these units come from (each group once)
                    if u[0] not in groups:
                        groups[u[0]] = self._prefill(groups_idx[u[0]], seqs, bounds)
                logits = torch.cat([groups[g].logits[r, groups[g].col[(r, b)]].unsqueeze(0).expand(nc, -1)
                                    for g, r, _i, _j, b, _c0, nc in admitted])
                tok0, lp0 = self._sample(logits, params, generator)  # first tokens come from the prefill logits
                B = max(u[4] for u in admitted)
                if (sum(u[6] for u in admitted) <= len(batch.dead) and B <= batch.n
                        and batch.N * (max(batch.L, B) + max_new) <= budget):
                    rows_t = batch.fill(admitted, groups, tok0, lp0)
                else:
                    batch.rebuild(admitted, groups, tok0, lp0)
                    rows_t = torch.arange(live, batch.N, device=dev)
                for u in admitted:
                    counts[u[0]] -= 1
                    if counts[u[0]] == 0:  # every unit of the group is in the batch: free its prefill cache
                        del groups[u[0]]
                check(tok0, rows_t)  # the new rows' first tokens may already finish them
            elif len(batch.dead) >= max(1, batch.N // 4):
                batch.rebuild([], groups, None, None)
            if batch.N == 0:
                if queue:
                    continue
                break

            # ---- one decode step
            N = batch.N
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(N, 1)], dim=1)
            logits = self.model(
                input_ids=batch.pending.view(N, 1),
                attention_mask=batch.mask,
                position_ids=batch.pos.view(N, 1),
                use_cache=True,
                **{self._cache_kw: batch.cache},
            ).logits[:, -1, :]
            batch.L += 1
            tok, lp = self._sample(logits, params, generator)
            idx = batch.gen.clamp_max(max_new - 1).view(N, 1)
            batch.tok.scatter_(1, idx, tok.view(N, 1))
            batch.lp.scatter_(1, idx, lp.view(N, 1))
            batch.gen += 1
            batch.pos += 1
            batch.pending = tok
            check(tok)

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
        pads = [P - n for n in lens]
        colmap = {(r, b): col[P - lens[r] + b - 1] for r, i in enumerate(members) for b in bounds[i]}
        return _Group(kv, pads, logits, colmap)

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
            # The nucleus lies inside the top TOP_K tokens of every row whenever their mass reaches top_p
            # (usual at T < 1); then a top-k beats a full sort, and multinomial draws from TOP_K, not the vocabulary.
            top_lp, top_idx = lp_all.topk(min(TOP_K, lp_all.shape[-1]), dim=-1)
            if not bool((top_lp.exp().sum(-1) >= params.top_p).all()):
                top_lp, top_idx = lp_all.sort(dim=-1, descending=True)
            probs = top_lp.exp()
            cum = probs.cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass is already >= top_p
            probs = probs.masked_fill((cum - probs) >= params.top_p, 0.0)
            choice = _multinomial(probs, generator)
            tok = top_idx.gather(1, choice.view(-1, 1)).view(-1)
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
