"""The rollout engine: one interface (``api.py``), two backends.

    native  (``native.py``)       batched sampling with a shared prefix KV cache, on any HF causal LM, in process
    vllm    (``vllm_backend.py``) vLLM with automatic prefix caching (optional extra ``vineppo[vllm]``)

The native backend, one job per file: ``plan.py`` (units of work), ``schedule.py`` (admission policy),
``batch.py`` (the decode batch and its KV cache), ``stops.py`` (EOS, stop strings, length), ``sampling.py``
(temperature, top-p), ``attention.py`` (decode attention for grouped-query models). ``make_engine(name, ...)``
builds either; train, eval, analyze-values and the benchmark call only the interface.
"""

from vineppo.engine.api import ENGINES, RolloutEngine, Sample, SamplingParams, check_engine, eos_token_ids, make_engine
from vineppo.engine.native import Engine
from vineppo.engine.sampling import TOP_K

__all__ = ["ENGINES", "Engine", "RolloutEngine", "Sample", "SamplingParams", "TOP_K", "check_engine", "eos_token_ids",
           "make_engine"]
