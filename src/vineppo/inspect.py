"""`vineppo inspect-data`: load a task's split, grade every reference solution, show how it splits into steps.

A data set whose references do not grade as correct, or whose steps do not join back into the text, would
quietly poison training (the SFT target and the reward disagree), so this is the first thing to run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vineppo.tasks import Example, Task, get_task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `vineppo inspect-data`."""
    parser.add_argument("--task", default="arith", help="task name (default: arith)")
    parser.add_argument("--split", default="test", help="split to load (default: test)")
    parser.add_argument("--data", default=None, metavar="PATH", help="local JSONL file instead of the default source")
    parser.add_argument("--seed", type=int, default=0, help="seed for generated tasks (default: 0)")
    parser.add_argument("--examples", type=int, default=2, help="example step splits to show (default: 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures, nothing else")


def inspect_examples(task: Task, examples: list[Example], progress: bool = False) -> dict:
    """Figures for a loaded split: records, fraction of references graded correct, step statistics, failures."""
    correct, n_steps, failed, not_exact = 0, [], [], []
    start = time.perf_counter()
    with Progress(TextColumn("grading references"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not progress, transient=True) as bar:
        job = bar.add_task("grade", total=len(examples))
        for ex in examples:
            target = task.target(ex)
            if task.grade(target, ex.answer) == 1.0:
                correct += 1
            else:
                failed.append(ex.id)
            steps = task.split_steps(target)
            if "".join(steps) != target:
                not_exact.append(ex.id)
            n_steps.append(len(steps))
            bar.advance(job)
    n = len(examples)
    return {
        "task": task.name,
        "records": n,
        "reference_correct": correct / n if n else 0.0,
        "steps": {"mean": statistics.fmean(n_steps) if n else 0.0,
                  "median": float(statistics.median(n_steps)) if n else 0.0,
                  "max": max(n_steps, default=0)},
        "split_exact": not not_exact,
        "failed_ids": failed[:20],
        "duplicate_ids": len(examples) - len({ex.id for ex in examples}),
        "grading_seconds": round(time.perf_counter() - start, 2),
    }


def run(args: argparse.Namespace) -> int:
    """Load, validate, grade and report (exit code 0: failures are figures to read, not errors)."""
    task = get_task(args.task)
    examples = task.load(args.split, args.data, args.seed)
    console = Console(stderr=False)
    report = inspect_examples(task, examples, progress=not args.json and console.is_terminal)
    report["split"] = args.split
    if args.json:
        print(json.dumps(report))
        return 0

    table = Table(title=f"{task.name} / {args.split}" + (f" ({args.data})" if args.data else ""), show_header=False)
    table.add_row("records", str(report["records"]))
    table.add_row("references graded correct", f"{report['reference_correct']:.4f}")
    s = report["steps"]
    table.add_row("steps per reference", f"mean {s['mean']:.2f}, median {s['median']:.1f}, max {s['max']}")
    table.add_row("steps join back exactly", "yes" if report["split_exact"] else "[red]NO[/red]")
    table.add_row("grading time", f"{report['grading_seconds']} s")
    if report["failed_ids"]:
        table.add_row("[red]failed references[/red]", ", ".join(report["failed_ids"]))
    console.print(table)
    for ex in examples[: args.examples]:
        console.rule(f"{ex.id}  answer: {ex.answer}")
        for i, step in enumerate(task.split_steps(task.target(ex))):
            console.print(f"[bold cyan]{i:>2}[/bold cyan] {escape(repr(step))}", highlight=False, soft_wrap=True)
    return 0
