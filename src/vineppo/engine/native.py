"""The native backend: batched sampling with KV-cache reuse, on any Hugging Face causal LM, in this process.

HOW IT WORKS (one job per file)

1. Plan (``plan.py``). Source sequences are sorted by length and cut into prefill groups within
   ``token_budget`` (rows x length); each (sequence, boundary) becomes units of copies to sample.
2. Prefill (``ModelRunner.prefill``; ``runner.py`` holds the model and makes every call to it). One forward
   pass over a group (left-padded, explicit ``attention_mask`` and true ``position_ids``, each sequence up to
   its last boundary) gives the KV cache for all its boundaries, and its logits at position ``b - 1`` give the
   first-token distribution after boundary ``b``. Only those logits are materialised (``logits_to_keep`` with a
   tensor of positions).
3. Admit (``schedule.py``). Units, shortest prefix first, join the running decode batch (``batch.py``) as soon
   as rows finish (continuous batching). New rows take finished rows' places in place; the batch is rebuilt
   (kept rows first) only to grow, to shed finished rows no new row takes, or to stay within the budget as rows
   lengthen. Where the rows' keys/values live is the batch's KV layout:
   - split (``split.py``; eager steps, the CPU's): a unit's prefix is copied out of the group cache once, into
     a slot of the prefix store (``prefixes.py``) that all its copies read; a row's own cache holds only the
     tokens it generates, written in place into a preallocated buffer;
   - ring (``ring.py``; CUDA graphs, the GPU's): every row holds its prefix and tokens in fixed buffers, so a
     step has the same shapes every time and is replayed as a CUDA graph (``graphs.py``).
4. Decode (``Job.step`` in ``job.py``, which owns the job's queue, caches, batch and finisher). Each step
   (``ModelRunner.decode``) has the batch's layout (``batch.KVLayout``, which both layouts implement) feed one
   token per row through the model with a ``DynamicCache`` whose layers are the layout's. The step's attention
   (``attention.py``) reads each prefix in the store once for all its copies (split) or each row's buffer
   (ring), and packs a key/value head's query heads into one attention. Finished rows (EOS, stop string,
   length; ``stops.py``) are masked out at once.
5. Sample (``sampling.py``: as few passes over [rows, vocabulary] as the same draws allow). Top-p first looks at
   the ``TOP_K`` most likely tokens; when they hold ``top_p`` of the mass (as usual at T < 1) the nucleus is among
   them and a full sort of the vocabulary is skipped. With ``SamplingParams(entropy=True)`` the same step also
   records each token's entropy of softmax(logits / T) (``Sample.entropies``), which changes no draw.

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

import torch

from vineppo.engine.api import Progress, Request, Sample, SamplingParams, check_prompts
from vineppo.engine.job import Job
from vineppo.engine.runner import ModelRunner


class Engine:
    """The native rollout engine (see the module docstring); samples from ``model`` itself, so weights are never stale."""

    logprobs_are_the_policys = True  # Sample.logprobs: log_softmax(logits / T) of ``model``, what PPO's ratio needs

    def __init__(self, model, tokenizer, token_budget: int = 65536, decode: str = "auto", fused_sampling: bool = False):
        """``decode`` and ``fused_sampling``: how the model runner decodes and samples (``runner.ModelRunner``)."""
        self.model, self.tokenizer, self.token_budget = model, tokenizer, int(token_budget)
        self.runner = ModelRunner(model, tokenizer, decode, fused_sampling)
        self.eos_token_ids = self.runner.eos_token_ids  # every token id that ends a sample (``api.eos_token_ids``)

    @property
    def device(self) -> torch.device:
        return self.runner.device

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
        pool = self.runner.pool
        if pool is not None and not pool.small():
            pool.release()

    def push_weights(self, model: torch.nn.Module) -> None:
        """Nothing to push: the engine samples from the model it was given, whose weights the update changes."""

    def _run(self, req: Request) -> list[list[list[Sample]]]:
        """Run `req` (checked) as one Job within the token budget, the model in eval mode for its duration."""
        with self.runner.running() as shared:
            return Job(self.runner, req, self.token_budget, shared).run()
