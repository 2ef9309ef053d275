"""`vineppo inspect-data`: load a task's split, grade every reference solution, show how it splits into steps.

A data set whose references do not grade as correct, or whose steps do not join back into the text, would
quietly poison training (the SFT target and the reward disagree), so this is the first thing to run. With
`--model`, it also shows three prompts as that model sees them (its tokenizer and prompt format). On a
`custom` task it lists the columns the reward functions receive, and scores the reference completions with
`--reward` when the data has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vineppo.core.steps import every_n_tokens
from vineppo.models.prompts import HELP, Prompter
from vineppo.tasks import Example, Task, custom, get_task
from vineppo.tasks.agent import first_observation
from vineppo.tasks.custom import CustomTask

CHUNK = 64  # references graded per call (one call of a custom task's reward functions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `vineppo inspect-data`."""
    parser.add_argument("--task", default="arith", help="task name (default: arith)")
    parser.add_argument("--split", default="test", help="split to load (default: test; with a --data file: test is "
                                                         "every record of it, train and validation the parts carved "
                                                         "from it for training)")
    parser.add_argument("--data", default=None, metavar="PATH", help="local data file instead of the default source")
    parser.add_argument("--seed", type=int, default=0, help="seed for generated tasks (default: 0)")
    parser.add_argument("--examples", type=int, default=2, help="example step splits to show (default: 2)")
    parser.add_argument("--model", default=None, help="show three prompts as this model sees them (its tokenizer "
                                                      "and prompt format); token steps need it")
    parser.add_argument("--prompt-format", default=None, help=HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures, nothing else")
    custom.add_arguments(parser)


def inspect_examples(task: Task, examples: list[Example], progress: bool = False, tokenizer=None) -> dict:
    """Figures for a loaded split: records, share of references solved, their mean reward, step statistics, failures.

    A custom task without --reward, or without reference completions, grades nothing (reference_correct None)."""
    targets = [task.target(ex) for ex in examples]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] if tokenizer else [] for t in targets]
    scored = any(targets) and (not isinstance(task, CustomTask) or bool(task.settings.reward))
    rewards: list[float | None] = []
    start = time.perf_counter()
    with Progress(TextColumn("grading references"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not (progress and scored), transient=True) as bar:
        job = bar.add_task("grade", total=len(examples))
        for a in range(0, len(examples) if scored else 0, CHUNK):
            rewards += task.score(examples[a:a + CHUNK], targets[a:a + CHUNK], ids[a:a + CHUNK])
            bar.advance(job, len(rewards) - a)
    failed = [ex.id for ex, r in zip(examples, rewards) if not task.solved(r)]
    n_steps, not_exact = [], []
    for ex, target, tokens in zip(examples, targets, ids):
        steps = task.split_steps(target)
        if "".join(steps) != target:
            not_exact.append(ex.id)
        n_steps.append(len(every_n_tokens(len(tokens), task.step_tokens)) if task.step_tokens and tokenizer else
                       len(steps))
    n, known = len(examples), [r for r in rewards if r is not None]
    return {
        "task": task.name,
        "records": n,
        "reference_correct": (1 - len(failed) / n if n else 0.0) if scored else None,
        "reference_reward": statistics.fmean(known) if known else None,
        "steps": {"mean": statistics.fmean(n_steps) if n else 0.0,
                  "median": float(statistics.median(n_steps)) if n else 0.0,
                  "max": max(n_steps, default=0)},
        "split_exact": not not_exact,
        "failed_ids": failed[:20],
        "duplicate_ids": len(examples) - len({ex.id for ex in examples}),
        "grading_seconds": round(time.perf_counter() - start, 2),
    }


def source_label(task: Task, split: str, data: str | None) -> str:
    """What was read, in words: a file's records (all of them for test, else the part carved out), or task / split."""
    if data and (Path(data).is_file() or data.startswith("hub:")):
        return f"{task.name}: {data}, " + ("every record" if split == "test" else f"the {split} part carved from it")
    return f"{task.name} / {split}" + (f" ({data})" if data else "")


def ungraded(task: Task, examples: list[Example], reward: list | None) -> str | None:
    """Why the references are not graded, naming the flag that fixes it (None: they are)."""
    if not isinstance(task, CustomTask):
        return None
    if not reward and task.agent is not None and task.agent.env is not None:
        return ("the environment gives the reward, in a dialogue a reference does not play (pass --reward "
                "FILE.py:FUNCTION to score the references' text)")
    if not reward:
        return "no reward function: pass --reward FILE.py:FUNCTION"
    if not any(task.target(ex) for ex in examples):
        columns = ", ".join(task.data.rows[examples[0].id].columns) if examples else "none"
        return (f"the records have no reference completion: name its column with --completion-column (columns: "
                f"{columns})")
    return None


def shown_steps(task: Task, ex: Example, tokenizer) -> list[str]:
    """The steps of an example's reference as training cuts them (runs of N tokens with --steps tokens:N)."""
    if not (task.step_tokens and tokenizer):
        return task.split_steps(task.target(ex))
    ids = tokenizer(task.target(ex), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[a:b]) for a, b in every_n_tokens(len(ids), task.step_tokens)]


def describe(task: Task, examples: list[Example], prompter: Prompter | None) -> dict:
    """What a model would see: the prompt format, three prompts (an environment's first observation in them, as
    reset gives it for the row) and, for a custom task, the reward's columns."""
    prompts = [shown_prompt(task, ex, prompter) for ex in examples[:3]]
    out = {"prompt_format": prompter.format if prompter else task.auto_format(None), "prompts": prompts}
    if isinstance(task, CustomTask) and examples:
        out["columns"] = list(task.data.rows[examples[0].id].columns)
    return out


def shown_prompt(task: Task, ex: Example, prompter: Prompter | None) -> str | list[dict]:
    """The prompt of `ex` as the model reads it (text, or without a model the data's text or chat turns), with what an
    environment's reset adds for its row."""
    extra, join = first_observation(task.agent, task.row(ex), ex.id) if task.agent is not None else ("", None)
    if prompter is not None:
        return prompter.text(ex, extra, join)
    prompt = task.chat_turns(ex) or task.prompt(ex)
    if not extra:
        return prompt
    sep = ("\n\n" if isinstance(prompt, list) else "\n") if join is None else join
    if isinstance(prompt, str):
        return prompt + sep + extra
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + sep + extra}]


def run(args: argparse.Namespace) -> int:
    """Load, validate, grade and report (exit code 0: failures are figures to read, not errors)."""
    task = get_task(args.task, args)
    examples = task.load(args.split, args.data, args.seed)
    tokenizer = None
    if args.model:
        from vineppo.models.causal_lm import load_model  # torch and transformers: only for a model's prompts

        tokenizer = load_model(args.model, device="cpu", verbose=False)[1]
    prompter = Prompter(task, tokenizer, args.prompt_format, model=args.model, data=args.data, seed=args.seed) \
        if tokenizer else None
    console = Console(stderr=False)
    report = inspect_examples(task, examples, progress=not args.json and console.is_terminal, tokenizer=tokenizer)
    report.update(split=args.split, source=source_label(task, args.split, args.data),
                  not_graded=ungraded(task, examples, args.reward), **describe(task, examples, prompter))
    if args.json:
        print(json.dumps(report))
        return 0
    show(report, task, examples, args, tokenizer, console)
    return 0


def show(report: dict, task: Task, examples: list[Example], args: argparse.Namespace, tokenizer,
         console: Console) -> None:
    """The report as a table, the prompts, then the step splits of the first examples."""
    table = Table(title=report["source"], show_header=False)
    table.add_row("records", str(report["records"]))
    if "columns" in report:
        table.add_row("columns the reward receives", ", ".join(report["columns"]) or "none")
    table.add_row("prompt format", str(report["prompt_format"]) + ("" if args.model else " (pass --model to see "
                                                                                        "the model's prompts)"))
    graded = report["reference_correct"]
    table.add_row("references graded correct", f"not graded: {report['not_graded']}" if graded is None else
                  f"{graded:.4f}" + (f" (mean reward {report['reference_reward']:.4f})"
                                     if report["reference_reward"] is not None else ""))
    s = report["steps"]
    table.add_row("steps per reference", f"mean {s['mean']:.2f}, median {s['median']:.1f}, max {s['max']}")
    table.add_row("steps join back exactly", "yes" if report["split_exact"] else "[red]NO[/red]")
    table.add_row("grading time", f"{report['grading_seconds']} s")
    if report["failed_ids"]:
        table.add_row("[red]failed references[/red]", ", ".join(report["failed_ids"]))
    console.print(table)
    for ex, prompt in zip(examples, report["prompts"]):
        console.rule(f"{ex.id}: the prompt")
        console.print(escape(prompt if isinstance(prompt, str) else json.dumps(prompt)), highlight=False,
                      soft_wrap=True)
    if examples[: args.examples]:
        console.print(f"The reference solutions of the first {min(args.examples, len(examples))} records cut into "
                      f"steps as VinePPO cuts a response (a Monte Carlo value is estimated at the start of each): the "
                      f"step's number, then its text as a Python string (\\n: a newline).", highlight=False,
                      soft_wrap=True)
    for ex in examples[: args.examples]:
        console.rule(f"{ex.id}: the reference's steps" + (f"  answer: {ex.answer}" if ex.answer else ""))
        for i, step in enumerate(shown_steps(task, ex, tokenizer)):
            console.print(f"[bold cyan]{i:>2}[/bold cyan] {escape(repr(step))}", highlight=False, soft_wrap=True)
