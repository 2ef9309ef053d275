"""The model side of the native engine: everything a job asks of the model, in one object built once per engine.

``ModelRunner`` holds the model and what calling it takes (the keyword its cache goes by, whether it takes
``logits_to_keep``, its end-of-sequence ids, the stop strings' candidate tables), how decode steps run (``split``,
``ring`` or ``graphs``: the ring's steps replayed as CUDA graphs, on buffers it keeps across jobs) and the sampling
step. A job (``job.py``) calls it and nothing else for the model:

    group = runner.prefill(members, sequences, boundaries)  # one forward over a group: KV cache, boundary logits
    logits = runner.decode(batch)                           # one decode step over the batch's KV layout
    tok, lp, ent = runner.sample(logits, params, generator)  # one token per row (ent: None unless params.entropy)

``runner.layout(...)`` is the KV layout of a job's batch (``batch.KVLayout``); a layout's decode step calls back
only ``runner.forward``, the model's one-token call, never the job or the engine.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache

from vineppo.engine.api import Request, SamplingParams, eos_token_ids
from vineppo.engine.attention import packed_decode
from vineppo.engine.batch import Batch, Group, KVLayout, layers_kv
from vineppo.engine.plan import Plan
from vineppo.engine.ring import RingKV, RingPool, planned_rows
from vineppo.engine.sampling import Drawn, sample
from vineppo.engine.split import SplitKV
from vineppo.engine.stops import candidate_table
from vineppo.models.causal_lm import cache_keyword, pretrained

DECODE = ("auto", "split", "ring", "graphs")  # how decode steps run (see ModelRunner)


class ModelRunner:
    """The model and its calls for the native engine's jobs (see the module docstring)."""

    def __init__(self, model, tokenizer, decode: str = "auto", fused_sampling: bool = False):
        """``decode``: ``split`` (eager steps over the split layout, ``split.py``), ``graphs`` (CUDA graphs over the
        ring layout, ``ring.py``; CUDA only), ``ring`` (the ring's steps run eagerly: the graphs' computation on
        any device) or ``auto`` (graphs on CUDA, split elsewhere). ``fused_sampling``: the sampling step compiled
        into fused kernels (``sampling.py`` says what changes)."""
        if decode not in DECODE:
            raise ValueError(f"decode must be one of {', '.join(DECODE)}, got {decode!r}")
        self.model, self.tokenizer, self.fused_sampling = model, tokenizer, fused_sampling
        self.cache_kw = cache_keyword(model)
        self.logits_to_keep = "logits_to_keep" in inspect.signature(pretrained(model).forward).parameters
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.tables: dict[tuple[tuple[str, ...], int], torch.Tensor] = {}  # stop_table's, memoised
        if decode == "auto":
            decode = "graphs" if self.device.type == "cuda" else "split"
        if decode == "graphs" and self.device.type != "cuda":
            raise ValueError("decode='graphs' needs a CUDA model; use 'ring' for the same steps run eagerly")
        self.decode_mode = decode
        self.pool = RingPool(self.device, graphs=decode == "graphs") if decode != "split" else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @contextmanager
    def running(self):
        """For one job: the model in eval and inference mode, its decode attention the engine's where it runs
        transformers' SDPA; yields whether it does (``attention.packed_decode``). Training mode is restored after."""
        was_training = self.model.training
        self.model.eval()
        if self.pool is not None:
            self.pool.check_weights(self.model)
        try:
            with torch.inference_mode(), packed_decode(self.model) as shared:
                yield shared
        finally:
            if was_training:
                self.model.train()

    def layout(self, req: Request, plan: Plan, budget: int, shared: bool) -> KVLayout:
        """The KV layout of a job's batch: split (eager) or the ring (static shapes, CUDA graphs)."""
        p_max = max((b for bs in req.boundaries for b in bs), default=1)
        if self.pool is None:
            return SplitKV(req.params.max_new_tokens, p_max, shared)
        copies = sum(u.copies for u in plan.queue) * (1 if req.more is None else 2)  # adaptive: the ring may grow
        rows = planned_rows([u.length for u in plan.queue], copies, budget, req.params.max_new_tokens)
        return RingKV(self.pool, rows, p_max + req.params.max_new_tokens)

    def stop_table(self, stop: tuple[str, ...], vocab: int) -> torch.Tensor | None:
        """int8 [V]: 1 where a token could complete a stop string (``stops.candidate_table``, memoised per runner)."""
        return candidate_table(self.tokenizer, stop, vocab, self.tables)

    def prefill(self, members: list[int], seqs: list[list[int]], bounds: list[list[int]]) -> Group:
        """One forward over each member sequence (up to its last boundary); logits only at boundaries."""
        dev = self.device
        lens = [bounds[i][-1] for i in members]
        P = max(lens)
        ids = torch.zeros(len(members), P, dtype=torch.long)
        am = torch.zeros(len(members), P, dtype=torch.long)
        for r, i in enumerate(members):
            ids[r, P - lens[r] :] = torch.tensor(seqs[i][: lens[r]], dtype=torch.long)
            am[r, P - lens[r] :] = 1
        ids, am = ids.to(dev), am.to(dev)
        position_ids = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)
        # padded positions whose logits are needed
        need = sorted({P - lens[r] + b - 1 for r, i in enumerate(members) for b in bounds[i]})
        col = {p: c for c, p in enumerate(need)}
        kwargs = {"logits_to_keep": torch.tensor(need, device=dev)} if self.logits_to_keep else {}
        res = self.model(input_ids=ids, attention_mask=am, position_ids=position_ids, use_cache=True, **kwargs)
        logits = res.logits if self.logits_to_keep else res.logits[:, need]
        kv = layers_kv(getattr(res, "cache", None) or getattr(res, "past_key_values", None))
        colmap = {(r, b): col[P - lens[r] + b - 1] for r, i in enumerate(members) for b in bounds[i]}
        return Group(kv, [P - n for n in lens], logits, colmap)

    def decode(self, batch: Batch) -> torch.Tensor:
        """One decode step: every row's pending token through the model, over the batch's layout; logits [N, V]."""
        return batch.kv.forward(self.forward, batch)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """The model's decode call (``batch.ModelCall``): one token per row with ``cache``; the next-token logits."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self.cache_kw: cache})
        return out.logits[:, -1, :]

    def sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Drawn:
        """One token per row (``sampling.sample``): tokens, log-probs and, if ``params.entropy``, entropies."""
        return sample(logits, params, generator, self.fused_sampling)
