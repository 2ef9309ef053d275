"""The interface every rollout backend implements, and what the backends share.

    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=256, stop=("\\n\\nProblem:",))
    engine = make_engine("native", model, tokenizer, token_budget=65536)    # or "vllm", with model_dir=
    out = engine.generate(prompts, n=8, params=params, generator=g)   # list (per prompt) of list (n) of Sample
    mc  = engine.continuations(Request(sequences, boundaries, k=9, params=params, generator=g, budgets=budgets))
          # mc[i][j] = k Samples continuing sequences[i][:boundaries[i][j]], each with at most
          # budgets[i][j] new tokens (default: params.max_new_tokens)
    mc  = engine.continuations(Request(..., k=3, more=lambda i, j, samples: 6 if undecided(samples) else 0))
          # adaptive: further rounds for the prefixes that ask for them, on the same cached prefix
    SamplingParams(..., entropy=True)   # native engine: each Sample also has .entropies, one per token
    engine.sleep()               # before an update: a backend holding its own memory may free it (GPU vLLM)
    engine.push_weights(model)   # after an update: a backend holding its own copy of the weights reloads it

Prompts and sequences are token ids; every random choice comes from ``generator`` (a torch.Generator).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.6  # 0 means greedy
    top_p: float = 0.9
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, besides the model's end-of-sequence tokens
    entropy: bool = False  # fill Sample.entropies (native engine only; computing them changes no sample)


@dataclass
class Sample:
    token_ids: list[int]  # generated tokens only; includes EOS if emitted, and the token that completed a stop string
    text: str  # tokenizer.decode(token_ids, skip_special_tokens=True)
    logprobs: list[float]  # per token; native: log_softmax(logits / T) before top-p (plain when greedy); vLLM: at T = 1
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    entropies: list[float] | None = None  # per token, with SamplingParams(entropy=True) (native engine only): the
    # entropy in nats of softmax(logits / T), before top-p, of the step that drew it (greedy: of softmax(logits))
    dialogue: Any = None  # a multi-turn dialogue's turns (vineppo.agents.Turns: its masks, messages, reward, what resumes
    # it); None for a single-turn sample


Progress = Callable[[int, int], None]  # (samples finished so far in the job, their tokens), called as they finish
More = Callable[[int, int, list[Sample]], int]  # adaptive rounds: (i, j, samples so far) -> how many more to draw


@dataclass
class Request:
    """What `continuations` samples, the one request every backend takes: `k` continuations of each sequence after
    each of its boundaries (`generate`'s prompts are sequences with one boundary, their end)."""

    sequences: list[list[int]]  # token ids
    boundaries: list[list[int]]  # per sequence, increasing prefix lengths (1 .. len(sequence))
    k: int  # continuations per (sequence, boundary)
    params: SamplingParams
    generator: torch.Generator | None = None  # every random choice
    progress: Progress | None = None  # called as samples finish
    budgets: list[list[int]] | None = None  # per boundary, new tokens at most (None: params.max_new_tokens each)
    more: More | None = None  # adaptive: further rounds for the prefixes that ask for them
    records: list | None = None  # per sequence, what a multi-turn engine resumes it from (its Turns.record)

    def checked(self) -> Request:
        """This request with its budgets filled in, or a ValueError naming what is wrong with it."""
        check_job(self.k, self.params)
        budgets = check_continuations(self.sequences, self.boundaries, self.params, self.budgets)
        return dataclasses.replace(self, sequences=[list(s) for s in self.sequences],
                                   boundaries=[list(b) for b in self.boundaries], budgets=budgets)


class RolloutEngine(Protocol):
    """What train, eval, analyze-values and the benchmark call; both backends implement it."""

    model: torch.nn.Module  # the model it samples from (evaluation reads its context length and device)
    tokenizer: object  # the tokenizer its samples are decoded with
    logprobs_are_the_policys: bool  # Sample.logprobs are log_softmax(logits / T) of `model` itself (PPO's old log-probs)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator | None = None, progress: Progress | None = None,
                 examples: list | None = None) -> list[list[Sample]]:
        """n samples per prompt; `examples` (one per prompt: its task example) are what a multi-turn engine resets its
        environment and tools with, which single-turn backends ignore."""

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """result[i][j]: k samples continuing sequences[i][:boundaries[i][j]], each of at most budgets[i][j] tokens.

        Adaptive sampling: with ``req.more``, once all samples of (i, j) so far have finished, ``more(i, j, samples)``
        says how many to add (0: that prefix is done); the prefix's KV cache is reused, never re-encoded.
        """

    def sleep(self) -> None:
        """Free what the engine holds that an update needs (a no-op where there is nothing to free)."""

    def push_weights(self, model: torch.nn.Module) -> None:
        """Sample from `model`'s current weights from now on (a no-op for an engine that samples from `model`)."""


END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS, known end-of-turn tokens, generation_config's eos ids."""
    eos: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    if tokenizer is not None:
        # A chat model ends a turn with a token that need not be its tokenizer's EOS (SmolLM2: <|endoftext|>
        # besides <|im_end|>): every known end-of-turn token the tokenizer has as a special token stops a row.
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        special |= set(getattr(tokenizer, "added_tokens_encoder", ()))
        eos.update(int(tokenizer.convert_tokens_to_ids(t)) for t in END_OF_TURN if t in special)
    gen_cfg = getattr(model, "generation_config", None)
    g_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if g_eos is not None:
        eos.update(int(e) for e in ([g_eos] if isinstance(g_eos, int) else g_eos))
    return sorted(eos)


def check_job(k: int, params: SamplingParams) -> None:
    """Refuse a job without samples or without room for a token."""
    if k < 1:
        raise ValueError("need at least one sample per prefix")
    if params.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")


def check_prompts(prompts: list[list[int]]) -> None:
    """Refuse an empty prompt (there is nothing to condition the first token on)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")


def check_continuations(sequences: list[list[int]], boundaries: list[list[int]], params: SamplingParams,
                        budgets: list[list[int]] | None) -> list[list[int]]:
    """Refuse bad boundaries or budgets; return the budgets (max_new_tokens for every boundary when not given)."""
    if len(sequences) != len(boundaries):
        raise ValueError("sequences and boundaries differ in length")
    for s, bs in zip(sequences, boundaries):
        prev = 0
        for b in bs:
            if not (prev < b <= len(s)):
                raise ValueError(f"boundaries must be increasing, >= 1 and <= len(sequence): {bs} for length {len(s)}")
            prev = b
    if budgets is None:
        return [[params.max_new_tokens] * len(bs) for bs in boundaries]
    if [len(b) for b in budgets] != [len(b) for b in boundaries]:
        raise ValueError("budgets must have the nesting of boundaries")
    if any(not 1 <= n <= params.max_new_tokens for bs in budgets for n in bs):
        raise ValueError(f"budgets must lie in 1..max_new_tokens={params.max_new_tokens}")
    return [list(b) for b in budgets]
