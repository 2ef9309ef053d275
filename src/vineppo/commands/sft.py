"""`vineppo sft`: supervised fine-tuning on a task's reference solutions, the starting point of RL (vineppo.training.sft)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from vineppo.models.prompts import HELP
from vineppo.tasks import DATA_HELP, custom
from vineppo.training.sft import PRETRAINED_DEFAULTS, TINY_DEFAULTS, SFTConfig, run_sft


def _defaults(key: str) -> str:
    """' (tiny: X, pretrained: Y)' for a --help text, read from the defaults themselves so it cannot go stale."""
    return f" (tiny: {TINY_DEFAULTS[key]:g}, pretrained: {PRETRAINED_DEFAULTS[key]:g})" if key != "optimizer" else \
        f" (tiny: {TINY_DEFAULTS[key]}, pretrained: {PRETRAINED_DEFAULTS[key]})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo sft`."""
    p.add_argument("--task", default="arith", help="task name (default: arith)")
    p.add_argument("--model", default="tiny",
                   help="hub id, local folder, .gguf file, or 'tiny' to build the small CPU model")
    p.add_argument("--prompt-format", default=None, help=HELP)
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--out", default=None, help="output folder (default: runs/sft-<task>)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the data" + _defaults("epochs"))
    p.add_argument("--lr", type=float, default=None, help="peak learning rate" + _defaults("lr"))
    p.add_argument("--optimizer", default=None,
                   help="muon: Muon on the weight matrices, AdamW on the rest; adamw: AdamW throughout" +
                   _defaults("optimizer"))
    p.add_argument("--batch-size", type=int, default=None, help="examples per step" + _defaults("batch_size"))
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    p.add_argument("--warmup", type=float, default=None, help="warmup fraction of the steps" + _defaults("warmup"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (default: on for CUDA GPUs that support it)")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "gpt2"], help="tiny model architecture")
    p.add_argument("--hidden", type=int, default=None, help="tiny model width")
    p.add_argument("--layers", type=int, default=None, help="tiny model depth")
    p.add_argument("--grad-checkpointing", action="store_true", help="trade compute for memory (large models)")
    custom.add_arguments(p, scoring=False)


def run(args: argparse.Namespace) -> int:
    """Run `vineppo sft` from parsed flags."""
    out = run_sft(SFTConfig(**{f.name: getattr(args, f.name) for f in fields(SFTConfig) if hasattr(args, f.name)}))
    print(f"saved SFT model to {out}")
    return 0
