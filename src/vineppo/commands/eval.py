"""`vineppo eval`: pass@1 (the paper's protocol), greedy accuracy, pass@k, maj@k and lenient scores of a model on a
task, with per-problem results in a JSONL file (what each score means: vineppo.training.evaluation)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vineppo import agents
from vineppo.core import config as configs
from vineppo.core.config import ENGINES, check_engine
from vineppo.core.errors import RolloutFault, UserError
from vineppo.core.tracking import Meter
from vineppo.engine.loading import LoadSpec, load
from vineppo.models.prompts import HELP, check_format
from vineppo.tasks import DATA_HELP, custom, get_task
from vineppo.training.evaluation import EvalSettings, error_histogram, evaluate
from vineppo.training.runs import output_folder
from vineppo.training.sft import SHIPPED, default_model

# Flag rules, checked before any model or data loads.
RULES = dict(samples=configs.AT_LEAST_0, temperature=configs.NON_NEGATIVE, top_p=configs.TOP_P,
             limit=configs.AT_LEAST_1, max_new_tokens=configs.AT_LEAST_1, token_budget=configs.AT_LEAST_1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo eval`."""
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: the task's SFT model: arith's shipped one, else runs/sft-<task>)")
    p.add_argument("--task", default="arith", help="task name (default: arith)")
    p.add_argument("--prompt-format", default=None, help=HELP)
    p.add_argument("--split", default="test")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--samples", type=int, default=16, help="samples per problem for pass@1 (default 16)")
    p.add_argument("--temperature", type=float, default=0.35)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of generated test sets (arith) and of the few-shot "
                   "draw, as train's --data-seed: 0 scores the problems a run's in-run evaluation scored (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the dtype a run's checkpoint "
                   "trained in, recorded in its vineppo.json, else float32)")
    p.add_argument("--engine", default="native", help=f"rollout backend: {' or '.join(ENGINES)} (default native)")
    p.add_argument("--token-budget", type=int, default=65536,
                   help="engine: max rows x tokens in one decode batch (vllm: tokens its KV cache holds)")
    p.add_argument("--out", default=None, help="per-problem JSONL (default: <model>/eval-<task>-<split>.jsonl, or "
                                                "runs/<model name>/... when the model is not a saved folder)")
    p.add_argument("--errors", action="store_true", help="print where wrong responses first go wrong")
    p.add_argument("--json", action="store_true", help="print one JSON object with the scores")
    custom.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run `vineppo eval` from parsed flags."""
    configs.check_flags(vars(args), RULES)
    check_format(args.prompt_format or "auto")
    check_engine(args.engine)
    custom.check_reward(args)  # before the model loads, as train's config does
    task = get_task(args.task, args)
    examples = task.load(args.split, args.data, args.data_seed)[: args.limit]
    if not examples:
        raise UserError(f"task {args.task!r} split {args.split!r}: the data set is empty")
    name = args.model or str(default_model(args.task, args.data))
    # results go beside a saved model, except the one shipped inside the package, and models not saved here
    saved = Path(name) if (Path(name) / "config.json").is_file() and Path(name).resolve() != SHIPPED.resolve() else \
        Path("runs") / (Path(name).name.removesuffix(".gguf") if Path(name).exists() else name.replace("/", "--"))
    out = Path(args.out) if args.out else saved / f"eval-{args.task}-{args.split}.jsonl"
    with output_folder(out.parent, f"--out {out}"):  # an unwritable --out fails before a slow model load
        got = load(LoadSpec(name, task, args.prompt_format, args.data, args.data_seed, args.device, args.dtype,
                            args.engine, args.token_budget))
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        total = len(examples) * (args.samples + 1)
        job = bar.add_task("eval", total=total)

        def show(text: str) -> None:  # a terminal redraws its bar; a log gets a line every 10 s
            if console.is_terminal:
                bar.update(job, description=text, completed=meter.done)
            else:
                console.print(text, highlight=False)

        meter = Meter("eval", total, show, every=0.5 if console.is_terminal else None)
        start = time.perf_counter()
        settings = EvalSettings(args.samples, args.temperature, args.top_p, args.max_new_tokens, args.seed)
        timeout = args.reward_timeout_s if args.reward_timeout_s is not None else 60.0
        engine = agents.for_task(got.engine, task, got.prompter, timeout, resume=False)
        try:
            res = evaluate(engine, task, examples, settings, got.prompter, progress=meter)
        except RolloutFault as fault:  # what finished before an environment's fault is written, then it stops
            out.write_text("".join(json.dumps(r) + "\n" for r in fault.rows))
            done = sum(r["samples"] + (r["greedy_text"] is not None) for r in fault.rows)
            raise RolloutFault(f"{fault}; the {done} samples finished before it are in {out}") from None
        res["tokens_per_s"] = res["tokens"] / (time.perf_counter() - start)  # generated tokens, sampled and greedy
    out.write_text("".join(json.dumps(r) + "\n" for r in res["results"]))
    summary = {k: v for k, v in res.items() if k != "results"}
    if args.json:
        print(json.dumps(summary))
        return 0
    show(summary, args)
    print(f"per-problem results: {out}", file=sys.stderr)
    if args.errors:
        show_errors(error_histogram(examples, res["results"]))
    return 0


def show(summary: dict, args: argparse.Namespace) -> None:
    """The scores as a few lines of text."""
    f = {k: "n/a" if v is None else f"{v:.4f}" for k, v in summary.items() if isinstance(v, float) or v is None}
    print(f"{args.task}/{args.split}: pass@1 {f['pass@1']} ({args.samples} samples, T={args.temperature}, "
          f"top-p {args.top_p})  greedy {f['greedy']}  pass@{args.samples} {f['pass@k']}  maj@{args.samples} "
          f"{f['maj@k']}  problems {summary['problems']}")
    print(f"  mean reward {f['reward']};  lenient: pass@1 {f['lenient_pass@1']}  greedy {f['lenient_greedy']};  "
          f"parsable (strict grader): "
          f"all {f['parsable']}  greedy {f['greedy_parsable']};  prompt format {summary['prompt_format']}, "
          f"{summary['tokens_per_s']:.1f} generated tokens/s")
    if "behaviours" in summary:
        for key, what in (("behaviours", "sampled"), ("greedy_behaviours", "greedy")):
            print(f"  behaviours ({what}): " + ",  ".join(f"{name} {v['share']:.3f} (right {v['pass@1']:.3f})"
                                                         for name, v in summary[key].items() if v["share"]))


def show_errors(hist: dict) -> None:
    """Where wrong responses first go wrong, by kind and by line."""
    total = sum(hist["kind"].values())
    print(f"first error of {total} wrong responses, by kind:")
    for kind, n in hist["kind"].most_common():
        print(f"  {kind:<20} {n:6d}  {n / max(total, 1):6.1%}")
    print("by line (0 = first step):")
    for line, n in sorted(hist["line"].items()):
        print(f"  line {line:<3} {n:6d}  {n / max(total, 1):6.1%}")
