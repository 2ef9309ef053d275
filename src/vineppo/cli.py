"""vineppo: RL fine-tuning of language models on reasoning tasks with VinePPO (Monte Carlo credit assignment;
Kazemnejad et al., arXiv 2410.01679) and the paper's baselines PPO, GRPO, RLOO, RestEM and DPO+, in one
training loop."""

from __future__ import annotations

import argparse
import importlib
import sys

from vineppo.core.errors import UserError

# subcommand -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "inspect-data": ("vineppo.commands.inspect_data", "validate a data set, grade its references, show step splits"),
    "sft": ("vineppo.commands.sft", "supervised fine-tuning on a task's reference solutions"),
    "eval": ("vineppo.commands.eval", "pass@1 and greedy accuracy of a model on a task"),
    "train": ("vineppo.commands.train", "RL training: VinePPO, PPO, GRPO, RLOO, RestEM or DPO+"),
    "analyze-values": ("vineppo.commands.analyze_values", "accuracy of value estimates against Monte Carlo ground truth"),
    "analyze-credit": ("vineppo.commands.analyze_credit", "which tokens each method's advantages blame when one line is wrong"),
    "compare": ("vineppo.commands.compare", "train several algorithms over several seeds and report"),
    "export": ("vineppo.commands.export", "a run's checkpoint as a plain transformers model folder (LoRA adapters merged)"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    """The top-level parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="vineppo", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    module = None
    for name, (mod_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(mod_name)
            module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `vineppo` console script (and `python -m vineppo`)."""
    argv = sys.argv[1:] if argv is None else argv
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        sys.exit(2)
    try:
        code = module.run(args)
    except UserError as e:
        print(f"vineppo {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"vineppo {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
