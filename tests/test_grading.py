"""Graders: GSM8K number matching, MATH boxed extraction + math-verify, and the hard time limit."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vineppo.core.grading import (MATH_TIMEOUT, extract_gsm8k, grade_gsm8k, grade_math, last_boxed, lenient_answer,
                                  lenient_gsm8k, lenient_math, math_equal)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _jsonl(rel):
    path = DATA / rel
    if not path.exists():
        pytest.skip(f"shared data {path} not present")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("completion,answer,want", [
    ("so 18\n#### 18", "18", 1.0),
    ("#### 1,000.", "1000", 1.0),
    ("#### $18", "18", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 12.0", "12", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("#### 25%", "25", 1.0),
    ("#### 5\n#### 7", "7", 1.0),  # the last `####` counts
    ("#### 7\n#### 5", "7", 0.0),
    ("the answer is 18", "18", 0.0),  # no `####` line: incorrect
    ("####\n18", "18", 0.0),
    ("#### 18 + 2 = 20", "20", 0.0),  # a second clause is not an answer
    ("#### 1,00", "100", 0.0),
    ("#### inf", "inf", 0.0),
    ("#### nan", "nan", 0.0),
    ("#### 5", "-5", 0.0),
])
def test_grade_gsm8k_edge_cases(completion, answer, want):
    assert grade_gsm8k(completion, answer) == want


def test_gsm8k_references_correct_and_shifted_wrong():
    rows = _jsonl("gsm8k/test.jsonl")
    answers = [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    assert all(grade_gsm8k(r["answer"], a) == 1.0 for r, a in zip(rows, answers))
    # A false positive is a pass against a *different* answer; equal neighbours (15 pairs of 1319) are right.
    false_pos = sum(grade_gsm8k(r["answer"], answers[(i + 1) % len(rows)]) == 1.0 and a != answers[(i + 1) % len(rows)]
                    for i, (r, a) in enumerate(zip(rows, answers)))
    assert false_pos / len(rows) < 0.01


@pytest.mark.parametrize("text,want", [
    (r"so $\boxed{5}$.", "5"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\fbox{x+1}", "x+1"),
    (r"$\boxed 7$", "7"),
    (r"\boxed {3}", "3"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}.", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize("pred,gold,want", [
    (r"\dfrac{1}{2}", r"\frac12", True),
    ("0.5", r"\frac{1}{2}", True),
    ("1,000", "1000", True),
    (r"90^\circ", "90", True),
    (r"\left(1,2\right)", "(1, 2)", True),
    ("2", "3", False),
    ("x+1", "1+x", True),
])
def test_math_equal(pred, gold, want):
    assert math_equal(pred, gold) is want


def test_grade_math_needs_a_box_and_never_raises():
    assert grade_math("the answer is 5", "5") == 0.0
    assert grade_math(None, "5") == 0.0  # type: ignore[arg-type]
    assert grade_math(r"\boxed{5}", "5") == 1.0


def test_math500_references_correct_and_shifted_wrong():
    rows = _jsonl("math500/test.jsonl")
    correct = sum(grade_math(r["solution"], r["answer"]) for r in rows)
    assert correct / len(rows) >= 0.99
    nxt = [rows[(i + 1) % len(rows)]["answer"] for i in range(len(rows))]
    false_pos = sum(grade_math(r["solution"], b) == 1.0 and r["answer"] != b for r, b in zip(rows, nxt))
    assert false_pos / len(rows) < 0.01


@pytest.mark.parametrize("completion", [
    r"\boxed{9^{9^{9^{9}}}}",
    "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "\\boxed{" + "{" * 600 + "1" + "}" * 600 + "}",  # short enough to reach math-verify
    "\\boxed{" + "1+" * 500_000 + "1}",  # a 1 MB answer
    "x" * 1_000_000 + r"\boxed{2}",
    "\\boxed{" * 100_000,
], ids=["power-tower", "5000-nested-braces", "600-nested-braces", "1MB-answer", "1MB-text", "100k-unclosed"])
def test_malicious_inputs_return_within_the_limit(completion):
    grade_math(r"\boxed{x}", "y")  # warm the worker: its startup is not part of a call's limit
    start = time.perf_counter()
    assert grade_math(completion, "5") == 0.0
    assert time.perf_counter() - start < MATH_TIMEOUT + 1.0


def test_timeout_kills_the_worker_and_the_next_call_works():
    grade_math(r"\boxed{x}", "y")
    start = time.perf_counter()
    assert grade_math(r"\boxed{9^{9^{9^{9}}}}", "5", timeout=0.3) == 0.0
    assert time.perf_counter() - start < 1.3
    assert grade_math(r"\boxed{\frac{2}{4}}", "0.5") == 1.0


def test_grade_math_from_threads():
    # math-verify's own signal-based timeout fails outside the main thread; the worker process does not care.
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda a: grade_math(rf"\boxed{{{a}}}", "x+1"), ["1+x", "x+2", "x+1", "2x"]))
    assert got == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("completion,answer,strict,lenient,parsable", [
    ("so 18\n#### 18", "18", 1.0, 1.0, True),  # the strict reading counts for lenient too
    ("Natalia sold 72 clips. The answer is 72.", "72", 0.0, 1.0, False),
    ("The answer is: $1,000 in total", "1000", 0.0, 1.0, False),
    ("She has \\boxed{18} apples left.", "18", 0.0, 1.0, False),
    ("48 / 2 = 24\n48 + 24 = 72", "72", 0.0, 1.0, False),  # the last number
    ("The answer is 72.\n#### 70", "72", 0.0, 0.0, True),  # a `####` line wins over any other reading
    ("#### The total is 72", "72", 0.0, 1.0, False),  # strict wants the number first on the `####` line
    ("no digits at all", "72", 0.0, 0.0, False),
])
def test_lenient_gsm8k_reads_what_strict_does_not(completion, answer, strict, lenient, parsable):
    assert grade_gsm8k(completion, answer) == strict
    assert lenient_gsm8k(completion, answer) == lenient
    assert (extract_gsm8k(completion) is not None) == parsable


def test_lenient_math():
    assert lenient_math("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}") == 1.0
    assert grade_math("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}") == 0.0
    assert lenient_math("so x = 3 and \\boxed{4}", "4") == 1.0
    assert lenient_math("we get 12 and then 7", "7") == 1.0
    assert lenient_math("nothing here", "7") == 0.0 and lenient_answer("nothing here") is None

