"""The rollout engine: one interface (``api.py``), two backends.

    native  (``native.py``)       batched sampling with a shared prefix KV cache, on any HF causal LM, in process
    vllm    (``vllm_backend.py``) vLLM with automatic prefix caching (optional extra ``vineppo[vllm]``)

The native backend, one job per file: ``job.py`` (the scheduler of one request: queue, batch, finisher),
``runner.py`` (the model: prefill, decode step, sampling; the one object that calls it), ``plan.py`` (units of
work), ``schedule.py`` (admission policy), ``batch.py`` (the decode batch and ``KVLayout``, the contract of its
two KV layouts: ``split.py``, eager: rows' own tokens, and ``prefixes.py``, the prefixes rows continue, one copy
per unit; and ``ring.py``, fixed buffers, replayed as CUDA graphs by ``graphs.py``), ``stops.py`` (EOS, stop
strings, length), ``sampling.py`` (temperature, top-p, entropies), ``attention.py`` (decode attention over either
layout), ``budget.py`` (the token budget, from free memory on a GPU). ``make_engine(name, ...)`` builds either
backend; train, eval, analyze-values and the benchmark call only the interface.
"""

from __future__ import annotations

from vineppo.core.config import check_engine
from vineppo.engine.api import Request, RolloutEngine, Sample, SamplingParams, eos_token_ids
from vineppo.engine.native import Engine
from vineppo.engine.sampling import TOP_K


def make_engine(name: str, model, tokenizer, model_dir: str | None = None, token_budget: int = 65536,
                cuda_graphs: bool = True) -> RolloutEngine:
    """The rollout engine `name` (config.ENGINES) for `model`; vLLM loads its own copy of the weights from `model_dir`;
    the native engine decodes with CUDA graphs on CUDA unless `cuda_graphs` is False."""
    check_engine(name)
    if name == "vllm":
        from vineppo.engine.vllm_backend import VLLMEngine  # imports vllm, an optional dependency

        return VLLMEngine(model, tokenizer, model_dir, token_budget=token_budget)
    return Engine(model, tokenizer, token_budget=token_budget, decode="auto" if cuda_graphs else "split")


__all__ = ["Engine", "Request", "RolloutEngine", "Sample", "SamplingParams", "TOP_K", "eos_token_ids", "make_engine"]
