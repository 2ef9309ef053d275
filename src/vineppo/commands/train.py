"""`vineppo train`: RL training as a preset (or YAML file) and flags configure it (the loop: vineppo.training.trainer)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError
from vineppo.core.tracking import process_start
from vineppo.tasks import TASKS
from vineppo.training.trainer import train


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo train`: --config, --resume, --json, and one flag per TrainConfig field."""
    presets = "; ".join(f"{t.preset or 'none'} for {t.name}" + (f" ({t.cpu_preset} on a CPU)" if t.cpu_preset else "")
                        for t in TASKS.values() if t.preset is not None)
    p.add_argument("--config", default=None, help=f"preset name or YAML file (default: the task's preset: {presets})")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR from its last checkpoint")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    configs.add_config_arguments(p)


def task_preset(task: str, device: str = "auto") -> str | None:
    """The preset a run of `task` on `device` (a --device value) uses without --config (Task.preset_on: custom's
    CPU preset on a CPU; None: TrainConfig's defaults alone)."""
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; known tasks: {', '.join(sorted(TASKS))}")
    preset = TASKS[task].preset_on(dist.pick_device(device).type)
    if preset is None:
        raise UserError(f"task {task!r} has no preset of its own; pass --config PRESET|FILE.yaml")
    return preset or None


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo train`."""
    overrides = configs.overrides_from(args)
    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.exists():
            raise UserError(f"--resume {args.resume}: no config.yaml there (not a run folder)")
        extra = [k for k in overrides if k != "iterations"]
        if extra:
            raise UserError(f"--resume takes only --iterations besides the run folder (got {', '.join(extra)})")
        cfg = configs.load(saved, overrides)
    else:
        preset = args.config or task_preset(overrides.get("task", TrainConfig.task), overrides.get("device", "auto"))
        cfg = configs.resolve(configs.load_preset(preset) if preset else {}, overrides, source=preset or "defaults")
        cfg.preset = preset
    try:
        summary = train(cfg, Path(args.resume) if args.resume else None, started=process_start())
        main = dist.is_main()
        dist.barrier()  # leave together (not after an error: a peer may be gone): see distributed.shutdown
    finally:
        dist.shutdown()
    if main:
        print(json.dumps(summary) if args.json else f"run folder: {summary['out']}\n{json.dumps(summary, indent=2)}")
    return 0
