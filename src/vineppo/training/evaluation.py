"""Evaluation, as `vineppo eval` and the in-run evaluation measure it: pass@1 (the paper's protocol: mean
correctness over 16 samples at T=0.35, top-p 0.9) and greedy accuracy of a model on a task, per problem.

Beside the strict scores (the reward's grader) it reports lenient ones (`grading.lenient_answer`: "the
answer is X", a `\\boxed{}` on GSM8K, the last number). Each response's finish reason ("stop": EOS or a stop
string; "length": cut off at --max-new-tokens) is recorded, and `parsable` is the fraction of responses
(sampled and greedy; `greedy_parsable`: greedy only) in which the task's strict extractor finds an answer,
right or wrong: a model that knows answers but not the format shows up there. `pass@k` is the fraction of
problems that at least one of the k samples solves, `maj@k` the accuracy of their majority answer. A task
that names its behaviours (`Task.behaviour`, e.g. arith's careful and premature solutions) gets each one's
share of the sampled responses and their pass@1 (`behaviours`), and its share of the greedy ones.

For GSM8K-format solutions (`a op b = c` lines, then `#### answer`) `first_error_step` says where a wrong
response first goes wrong: a wrong result on line i, or a wrong number copied into it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any
from fractions import Fraction

from vineppo.core.errors import RolloutFault, UserError
from vineppo.core.grading import outcome_reward, outcome_rewards
from vineppo.engine import SamplingParams
from vineppo.models.causal_lm import context_length, seeded_generator
from vineppo.models.prompts import Prompter
from vineppo.tasks import Example, Task

_LINE = re.compile(r"^\s*(-?\d+)\s*([-+*/x])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
_FINAL = re.compile(r"^\s*####\s*(.*?)\s*$")


def _parse(line: str) -> tuple[int, str, int, int] | None:
    m = _LINE.match(line)
    return (int(m[1]), m[2].replace("x", "*"), int(m[3]), int(m[4])) if m else None


def _apply(a: int, op: str, b: int) -> Fraction:
    return Fraction(a + b if op == "+" else a - b if op == "-" else a * b) if op != "/" else \
        (Fraction(a, b) if b else Fraction(-10**9))


def first_error_step(example: Example, response: str) -> tuple[int, str] | None:
    """(line index, kind) of the first mistake in a GSM8K-format response, or None if it matches the reference.

    kinds: 'arithmetic <op>' (the result of a correct `a op b` is wrong), 'operand' (a wrong number copied
    from the problem or the previous line), 'operator' (wrong operation), 'format' (unparsable line),
    'stopped early', 'extra step', 'answer' (steps right, final answer wrong).
    """
    ref = [_parse(line) for line in example.solution.split("\n") if _parse(line)]
    lines = [line for line in response.strip("\n ").split("\n") if line.strip()]
    steps = [line for line in lines if not _FINAL.match(line)]
    final = next((_FINAL.match(line)[1] for line in lines if _FINAL.match(line)), None)
    for i, (ra, rop, rb, _) in enumerate(ref):
        if i >= len(steps):
            return i, "stopped early"
        got = _parse(steps[i])
        if got is None:
            return i, "format"
        a, op, b, c = got
        if op != rop:
            return i, "operator"
        if (a, b) != (ra, rb):
            return i, "operand"
        if Fraction(c) != _apply(a, op, b):
            return i, f"arithmetic {op}"
    if len(steps) > len(ref):
        return len(ref), "extra step"
    if final is None or final.replace(",", "") != example.answer:
        return len(ref), "answer"
    return None


@dataclass
class EvalSettings:
    """How `evaluate` samples: `samples` draws per problem for pass@1, plus one greedy draw."""

    samples: int = 16  # samples per problem for pass@1 (0: greedy only)
    temperature: float = 0.35  # sampling temperature of the pass@1 draws
    top_p: float = 0.9  # nucleus of the pass@1 draws
    max_new_tokens: int = 256  # response length cap (cut to the model's context)
    seed: int = 0  # the draws' generator seed

    @classmethod
    def of(cls, cfg: Any, seed: int) -> EvalSettings:
        """A training run's evaluation settings (its eval_* fields, top_p, max_new_tokens), with this `seed`."""
        return cls(cfg.eval_samples, cfg.eval_temperature, cfg.top_p, cfg.max_new_tokens, seed)


def evaluate(engine, task: Task, examples: list[Example], settings: EvalSettings = EvalSettings(),
             prompter: Prompter | None = None, progress=None) -> dict:
    """{'pass@1', 'greedy', their lenient twins, 'parsable', 'results': per-problem rows, ...} for `examples` (seeded).

    `engine`: a vineppo.engine backend; it holds the model and tokenizer evaluated."""
    model, tokenizer = engine.model, engine.tokenizer
    samples, max_new_tokens, seed = settings.samples, settings.max_new_tokens, settings.seed
    if not examples:
        raise UserError(f"task {task.name!r}: no problems to evaluate (empty data set)")
    if samples < 0 or max_new_tokens < 1:
        raise UserError("--samples must be >= 0 and --max-new-tokens >= 1")
    prompter = prompter or Prompter(task, tokenizer)
    prompts = [prompter.prompt(ex) for ex in examples]
    ctx = context_length(model)
    for ex, p in zip(examples, prompts):
        if len(p) >= ctx:
            raise UserError(f"prompt of problem {ex.id!r} is {len(p)} tokens; the model's context is {ctx}")
    max_new_tokens = min(max_new_tokens, ctx - max(len(p) for p in prompts))
    was_training = model.training
    model.eval()
    sampled, greedy = [[] for _ in prompts], [[] for _ in prompts]
    try:
        if samples > 0:
            params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                    max_new_tokens=max_new_tokens, stop=task.stop)
            sampled = engine.generate(prompts, n=samples, params=params, generator=seeded_generator(model, seed),
                                      progress=progress, examples=examples)
        greedy_params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, stop=task.stop)
        greedy = engine.generate(prompts, n=1, params=greedy_params, generator=seeded_generator(model, seed),
                                 progress=progress, examples=examples)
    except RolloutFault as fault:  # an environment failed: the samples finished before it become rows, then it stops
        if any(sampled):
            greedy = fault.finished
        else:
            sampled = fault.finished
        fault.rows = [row for row in scored_rows(task, examples, sampled, greedy) if row["samples"] or
                      row["greedy_text"] is not None]
        raise
    finally:
        model.train(was_training)
    rows = scored_rows(task, examples, sampled, greedy)
    parsable = [p for r in rows for p in r["sample_parsable"] + [r["greedy_parsable"]] if p is not None]
    return {"pass@1": _mean([r["pass@1"] for r in rows if r["samples"]]),
            "greedy": _mean([r["greedy"] for r in rows]),
            "pass@k": _mean([r["pass@k"] for r in rows if r["samples"]]),
            "maj@k": _mean([r["maj@k"] for r in rows if r["maj@k"] is not None]),
            "lenient_pass@1": _mean([r["lenient_pass@1"] for r in rows if r["samples"]]),
            "lenient_greedy": _mean([r["greedy_lenient"] for r in rows]),
            "parsable": _mean(parsable),
            "greedy_parsable": _mean([r["greedy_parsable"] for r in rows if r["greedy_parsable"] is not None]),
            **({"behaviours": behaviour_table(task, behaviour_counts(task, rows)),
                "greedy_behaviours": behaviour_table(task, behaviour_counts(task, rows, greedy=True))}
               if task.behaviour else {}),
            "reward": _mean([r for row in rows for r in row["sample_reward"] if r is not None]),
            "problems": len(rows), "samples": samples, "prompt_format": prompter.format,
            "tokens": sum(len(s.token_ids) for outs in sampled + greedy for s in outs), "results": rows}


def scored_rows(task: Task, examples: list[Example], sampled: list[list], greedy: list[list]) -> list[dict]:
    """Each problem's row, its samples scored in two batches (sampled, greedy); a response counts as solved by the
    task's rule (Task.solved). A problem may lack its greedy sample (an evaluation stopped by a fault)."""
    flat = [(ex, s) for ex, outs in zip(examples, sampled) for s in outs]
    rewards = outcome_rewards(task.score, [ex for ex, _ in flat], [s for _, s in flat])
    have = [(ex, g[0]) for ex, g in zip(examples, greedy) if g]
    greedy_rewards = dict(zip([ex.id for ex, _ in have], outcome_rewards(task.score, [ex for ex, _ in have],
                                                                          [g for _, g in have])))
    rows, at = [], 0
    for ex, outs, g in zip(examples, sampled, greedy):
        rows.append(_row(task, ex, outs, g[0] if g else None, rewards[at:at + len(outs)], greedy_rewards.get(ex.id)))
        at += len(outs)
    return rows


def _row(task: Task, ex: Example, outs: list, g, rewards: list[float | None], greedy_reward: float | None) -> dict:
    """One problem's line of results: its samples' rewards, marks (solved or not), lenient marks, texts, finishes (its
    greedy fields None when `g` is)."""
    if g is None:
        row = _row(task, ex, outs, _NONE, rewards, None)
        return {**row, **{k: None for k in GREEDY if k in row}}
    marks = [float(task.solved(r)) for r in rewards]
    lenient = [outcome_reward(task.lenient, s.text, ex.answer, s.finish_reason) for s in outs] if task.lenient \
        else marks
    greedy = float(task.solved(greedy_reward))
    return dict(id=ex.id, answer=ex.answer, **{"pass@1": _mean(marks), "lenient_pass@1": _mean(lenient)},
                correct=int(sum(marks)), samples=len(marks), **{"pass@k": float(any(marks)) if marks else None,
                                                                "maj@k": majority_vote(task, outs, marks)},
                greedy=greedy, greedy_lenient=outcome_reward(task.lenient, g.text, ex.answer, g.finish_reason)
                if task.lenient else greedy, greedy_parsable=_parsable(task, g.text), greedy_text=g.text,
                greedy_finish=g.finish_reason, greedy_reward=greedy_reward, sample_texts=[s.text for s in outs],
                sample_correct=marks, sample_reward=rewards, sample_lenient=lenient,
                sample_parsable=[_parsable(task, s.text) for s in outs], sample_finish=[s.finish_reason for s in outs],
                **({"sample_behaviour": [task.behaviour(ex, s.text) for s in outs],
                    "greedy_behaviour": task.behaviour(ex, g.text)} if task.behaviour else {}))


GREEDY = ("greedy", "greedy_lenient", "greedy_parsable", "greedy_text", "greedy_finish", "greedy_reward",
          "greedy_behaviour")  # a row's greedy fields


class _Missing:
    """A stand-in for a greedy sample that never finished (its row's greedy fields are then None)."""

    text, finish_reason, token_ids, dialogue = "", "length", [], None


_NONE = _Missing()


def behaviour_counts(task: Task, rows: list[dict], greedy: bool = False) -> list[float]:
    """[responses, correct] per behaviour of `task` (in `task.behaviours` order), flat: sums across ranks add up."""
    counts = {name: [0.0, 0.0] for name in task.behaviours}
    for r in rows:
        pairs = [(r["greedy_behaviour"], r["greedy"])] if greedy else zip(r["sample_behaviour"], r["sample_correct"])
        for name, mark in pairs:
            counts[name][0] += 1
            counts[name][1] += mark
    return [x for name in task.behaviours for x in counts[name]]


def behaviour_table(task: Task, flat: list[float]) -> dict[str, dict[str, float | None]]:
    """{behaviour: {"share", "pass@1"}} from `behaviour_counts` (pass@1 None for a behaviour never seen)."""
    total = sum(flat[0::2]) or 1.0
    return {name: {"share": n / total, "pass@1": right / n if n else None}
            for name, n, right in zip(task.behaviours, flat[0::2], flat[1::2])}


def majority_vote(task: Task, samples: list, marks: list[float]) -> float | None:
    """The mark of the answer most samples give (ties: the one given first); None without samples or extractor.

    With pass@k (any sample right) it brackets what RL can gain: sharpening the sampled distribution moves
    pass@1 towards the majority's answer, and only learning moves it beyond."""
    if not task.extract or not samples:
        return None
    answers = [task.extract(s.text) for s in samples]
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = votes.most_common(1)[0][0]  # most_common keeps first-seen order among equal counts
    return marks[answers.index(top)]


def _parsable(task: Task, text: str) -> bool | None:
    """Whether the task's strict extractor finds an answer in `text` (None: the task has no extractor)."""
    return task.extract(text) is not None if task.extract else None


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def error_histogram(examples: list[Example], rows: list[dict]) -> dict[str, Counter]:
    """Counters of first-error kind and first-error line over every wrong sampled (or greedy) response."""
    kinds, lines = Counter(), Counter()
    for ex, row in zip(examples, rows):
        texts = list(zip(row["sample_texts"], row["sample_correct"])) or [(row["greedy_text"], row["greedy"])]
        for text, ok in texts:
            if ok:
                continue
            err = first_error_step(ex, text)
            kind, line = ("right answer, graded wrong (truncated?)", -1) if err is None else (err[1], err[0])
            kinds[kind] += 1
            lines[line] += 1
    return {"kind": kinds, "line": lines}
