"""`math`: competition problems (MATH, Hendrycks et al., 2021); answers are the last `\\boxed{}` of a solution.

Source: a local JSONL with fields `problem`, `solution` and optionally `answer` (`--data PATH`; MATH500
and the full MATH test both fit), else the Hugging Face Hub: `test` is MATH500 (`HuggingFaceH4/MATH-500`,
the 500-problem test subset of "Let's Verify Step by Step" that the VinePPO paper evaluates on), `train`
is the MATH train split (`DigitalLearningGmbH/MATH-lighteval`, 7500 problems, none in MATH500) less a
fixed-seed validation carve of 500. Given a local file, `test` is the whole file and `train`/`validation`
are carved from it. When a record has no `answer`, the answer is the solution's last `\\boxed{}`.
"""

from __future__ import annotations

from vineppo.core.errors import UserError
from vineppo.core.grading import extract_math, grade_math, last_boxed, lenient_math
from vineppo.core.steps import split_math
from vineppo.tasks.base import BOXED_ANSWER, Example, Task, register
from vineppo.tasks.data import check_split, load_examples

HUB_TEST = ("HuggingFaceH4/MATH-500", None, "test")
HUB_TRAIN = ("DigitalLearningGmbH/MATH-lighteval", None, "train")
SPLITS = ("train", "validation", "test")


def parse_record(record: dict, where: str) -> tuple[str, str, str]:
    """(problem, solution, final answer) of one MATH record; the answer falls back to the last `\\boxed{}`."""
    answer = record.get("answer")
    if answer is None:
        answer = last_boxed(record["solution"])
        if answer is None:
            raise UserError(f"{where}: field 'solution' has no \\boxed{{...}} answer and there is no 'answer' field")
    if not answer.strip():
        raise UserError(f"{where}: field 'answer' is empty")
    return record["problem"].strip(), record["solution"].strip(), answer.strip()


def load_math(split: str, path: str | None = None, seed: int = 0) -> list[Example]:
    """MATH problems of `split` from `path` (JSONL) or the hub; `seed` is unused (the validation carve is fixed)."""
    check_split("math", split, SPLITS)
    hub = HUB_TEST if split == "test" else HUB_TRAIN
    return load_examples("math", split, path, hub, parse_record, required=("problem", "solution"), optional=("answer",))


register(Task(name="math", preset="math", load=load_math, grade=grade_math, split_steps=split_math, splits=SPLITS,
              instruction=BOXED_ANSWER, extract=extract_math, lenient=lenient_math))
