"""`gsm8k`: grade-school word problems (Cobbe et al., 2021); answers are the number after `####`.

Source: a local JSONL with fields `question` and `answer` (`--data PATH`), else the Hugging Face Hub
data set `openai/gsm8k` (config `main`). The hub has train and test; validation is 500 train problems
chosen by a fixed seed (the same for every run), and train is the rest. Given a local file, `test` is the
whole file and `train`/`validation` are carved from it the same way. Ids are `gsm8k-<source>-<index>`,
the index of the record in its source file, so a problem keeps its id whichever split it lands in.
"""

from __future__ import annotations

import re

from vineppo.core.errors import UserError
from vineppo.core.grading import extract_gsm8k, grade_gsm8k
from vineppo.core.steps import split_newlines
from vineppo.tasks.base import Example, Task, register
from vineppo.tasks.data import check_split, load_examples

HUB = ("openai/gsm8k", "main")
SPLITS = ("train", "validation", "test")
_CALC = re.compile(r"<<[^<>]*>>")  # calculator annotations: `48/2 = <<48/2=24>>24` -> `48/2 = 24`


def parse_record(record: dict, where: str) -> tuple[str, str, str]:
    """(problem, solution without calculator annotations, final answer) of one GSM8K record."""
    solution = _CALC.sub("", record["answer"]).strip()
    if "####" not in solution:
        raise UserError(f"{where}: field 'answer' has no final '#### <answer>' line")
    answer = solution.rsplit("####", 1)[1].strip()
    if not answer:
        raise UserError(f"{where}: field 'answer' has an empty '####' line")
    return record["question"].strip(), solution, answer


def load_gsm8k(split: str, path: str | None = None, seed: int = 0) -> list[Example]:
    """GSM8K problems of `split` from `path` (JSONL) or the hub; `seed` is unused (the validation carve is fixed)."""
    check_split("gsm8k", split, SPLITS)
    hub = (*HUB, "test" if split == "test" else "train")
    return load_examples("gsm8k", split, path, hub, parse_record, required=("question", "answer"))


register(Task(name="gsm8k", preset="gsm8k", load=load_gsm8k, grade=grade_gsm8k, split_steps=split_newlines, splits=SPLITS,
              extract=extract_gsm8k))
