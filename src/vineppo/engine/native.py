"""The native backend: batched sampling with KV-cache reuse, on any Hugging Face causal LM, in this process.

HOW IT WORKS (one job per file)

1. Plan (``plan.py``). Source sequences are sorted by length and cut into prefill groups within
   ``token_budget`` (rows x length); each (sequence, boundary) becomes units of copies to sample.
2. Prefill (``Engine.prefill``). One forward pass over a group (left-padded, explicit ``attention_mask`` and
   true ``position_ids``, each sequence up to its last boundary) gives the KV cache for all its boundaries,
   and its logits at position ``b - 1`` give the first-token distribution after boundary ``b``. Only those
   logits are materialised (``logits_to_keep`` with a tensor of positions).
3. Admit (``schedule.py``). Units, shortest prefix first, join the running decode batch (``batch.py``) as soon
   as rows finish (continuous batching). New rows take finished rows' places in place; the batch is rebuilt
   (kept rows first) only to grow, to shed finished rows no new row takes, or to stay within the budget as rows
   lengthen. Where the rows' keys/values live is the batch's KV layout:
   - split (``split.py``; eager steps, the CPU's): a unit's prefix is copied out of the group cache once, into
     a slot of the prefix store (``prefixes.py``) that all its copies read; a row's own cache holds only the
     tokens it generates, written in place into a preallocated buffer;
   - ring (``ring.py``; CUDA graphs, the GPU's): every row holds its prefix and tokens in fixed buffers, so a
     step has the same shapes every time and is replayed as a CUDA graph (``graphs.py``).
4. Decode (``Job.step`` in ``job.py``, which owns the job's queue, caches, batch and finisher). Each step feeds
   one token per row through the model with a ``DynamicCache`` whose layers are the layout's. The step's
   attention (``attention.py``) reads each prefix in the store once for all its copies (split) or each row's
   buffer (ring), and packs a key/value head's query heads into one attention. Finished rows (EOS, stop
   string, length; ``stops.py``) are masked out at once.
5. Sample (``sampling.py``: as few passes over [rows, vocabulary] as the same draws allow). Top-p first looks at
   the ``TOP_K`` most likely tokens; when they hold ``top_p`` of the mass (as usual at T < 1) the nucleus is among
   them and a full sort of the vocabulary is skipped.

DETERMINISM. All randomness comes from ``generator`` (``sampling.draw``, torch.multinomial's draw). On CPU, the
same inputs, parameters, budget and seed give the same samples. The batch composition depends on the inputs and on
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

import torch

from vineppo.engine.api import Progress, Request, Sample, SamplingParams, check_prompts, eos_token_ids
from vineppo.engine.attention import packed_decode
from vineppo.engine.batch import Batch, Group, layers_kv
from vineppo.engine.job import Job
from vineppo.engine.plan import Plan
from vineppo.engine.ring import RingKV, RingPool, planned_rows
from vineppo.engine.split import SplitKV
from vineppo.engine.stops import candidate_table
from vineppo.models.causal_lm import cache_keyword, pretrained

DECODE = ("auto", "split", "ring", "graphs")  # how decode steps run (see Engine)

class Engine:
    """The native rollout engine (see the module docstring); samples from ``model`` itself, so weights are never stale."""

    logprobs_are_the_policys = True  # Sample.logprobs: log_softmax(logits / T) of ``model``, what PPO's ratio needs

    def __init__(self, model, tokenizer, token_budget: int = 65536, decode: str = "auto", fused_sampling: bool = False):
        """``decode``: ``split`` (eager steps over the split layout, ``split.py``), ``graphs`` (CUDA graphs over the
        ring layout, ``ring.py``; CUDA only), ``ring`` (the ring's steps run eagerly: the graphs' computation on
        any device) or ``auto`` (graphs on CUDA, split elsewhere). ``fused_sampling``: the sampling step compiled
        into fused kernels (``sampling.py`` says what changes)."""
        if decode not in DECODE:
            raise ValueError(f"decode must be one of {', '.join(DECODE)}, got {decode!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.token_budget = int(token_budget)
        self.fused_sampling = fused_sampling
        self.cache_kw = cache_keyword(model)
        self._has_logits_to_keep = "logits_to_keep" in inspect.signature(pretrained(model).forward).parameters
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._cand_tables: dict[tuple[tuple[str, ...], int], torch.Tensor] = {}  # stop_candidates, memoised
        if decode == "auto":
            decode = "graphs" if self.device.type == "cuda" else "split"
        if decode == "graphs" and self.device.type != "cuda":
            raise ValueError("decode='graphs' needs a CUDA model; use 'ring' for the same steps run eagerly")
        self.decode = decode
        self.pool = RingPool(self.device, graphs=decode == "graphs") if decode != "split" else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator | None = None, progress: Progress | None = None,
                 examples: list | None = None) -> list[list[Sample]]:
        """n samples per prompt; each prompt's KV cache is computed once and shared by its n samples (`examples`: what
        a multi-turn engine reads of each prompt; unused here)."""
        check_prompts(prompts)
        out = self._run(Request(prompts, [[len(p)] for p in prompts], n, params, generator, progress).checked())
        return [r[0] for r in out]

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """result[i][j]: k samples continuing sequences[i][:boundaries[i][j]] (then ``more`` asks for further rounds)."""
        return self._run(req.checked())

    def sleep(self) -> None:
        """Free the ring's buffers and graphs unless they are small (the split layout holds nothing between jobs)."""
        if self.pool is not None and not self.pool.small():
            self.pool.release()

    def push_weights(self, model: torch.nn.Module) -> None:
        """Nothing to push: the engine samples from the model it was given, whose weights the update changes."""

    # ------------------------------------------------------------------ the job

    def _run(self, req: Request) -> list[list[list[Sample]]]:
        """Run `req` (checked) as one Job, the model in eval mode for its duration."""
        was_training = self.model.training
        self.model.eval()
        if self.pool is not None:
            self.pool.check_weights(self.model)
        try:
            with torch.inference_mode(), packed_decode(self.model) as shared:
                return Job(self, req, shared).run()
        finally:
            if was_training:
                self.model.train()

    # ------------------------------------------------------------------ what a Job asks of its engine

    def layout(self, req: Request, plan: Plan, shared: bool) -> SplitKV | RingKV:
        """The KV layout of a job's batch: split (eager) or the ring (static shapes, CUDA graphs)."""
        p_max = max((b for bs in req.boundaries for b in bs), default=1)
        if self.pool is None:
            return SplitKV(req.params.max_new_tokens, p_max, shared)
        copies = sum(u.copies for u in plan.queue) * (1 if req.more is None else 2)  # adaptive: the ring may grow
        rows = planned_rows([u.length for u in plan.queue], copies, self.token_budget, req.params.max_new_tokens)
        return RingKV(self.pool, rows, p_max + req.params.max_new_tokens)

    def forward(self, batch: Batch) -> torch.Tensor:
        """One decode step: every row's pending token through the model; the next-token logits [N, V]."""
        return batch.kv.forward(self, batch)

    def stop_candidates(self, stop: tuple[str, ...], vocab: int) -> torch.Tensor | None:
        """int8 [V]: 1 where a token could complete a stop string (``stops.candidate_table``, memoised per engine)."""
        return candidate_table(self.tokenizer, stop, vocab, self._cand_tables)

    def prefill(self, members: list[int], seqs: list[list[int]], bounds: list[list[int]]) -> Group:
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
        kv = layers_kv(cache)
        pads = [P - n for n in lens]
        colmap = {(r, b): col[P - lens[r] + b - 1] for r, i in enumerate(members) for b in bounds[i]}
        return Group(kv, pads, logits, colmap)
