"""What a command samples from, loaded one way: the model, its tokenizer, its prompter and its rollout engine.

`vineppo eval`, `analyze-values`, `analyze-credit`, the Python API's `evaluate` and the trainer all load through
`load`, so a model's dtype, prompt format and few-shot draw are chosen by the same rules everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vineppo.engine import RolloutEngine, make_engine
from vineppo.models.causal_lm import load_model
from vineppo.models.prompts import Prompter, saved_dtype
from vineppo.tasks import Task


@dataclass
class LoadSpec:
    """Which model to load, how, and what to build around it."""

    model: str  # a model folder, .gguf file, hub id or pkg:NAME
    task: Task  # whose prompts the prompter encodes
    prompt_format: str | None = None  # plain | chat | fewshot:N | auto (None: auto)
    data: str | None = None  # the source few-shot examples are drawn from (the task's --data)
    data_seed: int = 0  # the draw of those examples (and of generated data sets): not the sampling seed
    device: str | None = None  # cpu, cuda, cuda:N (None: cuda if available)
    dtype: str | None = None  # the weights' dtype (None: the one a run's checkpoint trained in, else float32)
    engine: str | None = "native"  # rollout backend (config.ENGINES); None: no engine
    token_budget: int = 65536  # engine: max rows x tokens in one decode batch
    cuda_graphs: bool = True  # native engine on CUDA: decode steps replayed as CUDA graphs
    verbose: bool = True  # print one line about the loaded model


@dataclass
class Loaded:
    """A loaded model and what samples from it."""

    model: Any
    tokenizer: Any
    prompter: Prompter
    engine: RolloutEngine | None


def load(spec: LoadSpec) -> Loaded:
    """The model `spec` names, its tokenizer, a prompter in its prompt format and (unless spec.engine is None) an engine."""
    dtype = spec.dtype or saved_dtype(spec.model)
    model, tokenizer = load_model(spec.model, device=spec.device, dtype=dtype, verbose=spec.verbose)
    prompter = Prompter(spec.task, tokenizer, spec.prompt_format, model=spec.model, data=spec.data, seed=spec.data_seed)
    engine = None if spec.engine is None else make_engine(spec.engine, model, tokenizer, model_dir=spec.model,
                                                           token_budget=spec.token_budget,
                                                           cuda_graphs=spec.cuda_graphs)
    return Loaded(model, tokenizer, prompter, engine)
