"""The `arith` generator's behaviours: the same problems under every mix, each style at its share, its references
right or wrong by construction, and the classifier that labels a response's behaviour."""

import math
from collections import Counter

import pytest

from vineppo.core.errors import UserError
from vineppo.tasks import get_task
from vineppo.tasks.arith import BEHAVIOURS, Example, behaviour, chain_of, load_arith, parse_knobs, solution, style_of

MIX = "premature=0.2,skip=0.2,fused=0.2,bare=0.2"


def test_every_mix_has_the_same_problems_and_answers():
    base = load_arith("train", "premature=0", size=3000)
    for data in (None, MIX, "skip=1", "premature=1", "bare=0.5,fused=0.5"):
        other = load_arith("train", data, size=3000)
        assert [(e.id, e.problem, e.answer) for e in other] == [(e.id, e.problem, e.answer) for e in base]
    assert all(behaviour(e, e.solution) == "careful" for e in base)


def test_the_default_mix_is_premature_at_its_share_within_sampling_error():
    train = load_arith("train")
    assert len(train) == 20000
    share = Counter(behaviour(e, e.solution) for e in train)
    assert set(share) == {"premature", "careful"}
    se = math.sqrt(0.6 * 0.4 / len(train))
    assert abs(share["premature"] / len(train) - 0.6) < 4 * se


def test_each_style_is_drawn_at_its_share_and_written_as_labelled():
    knobs = parse_knobs(MIX)
    train = load_arith("train", MIX, size=6000)
    drawn = Counter(style_of(e.problem, knobs.mix) for e in train)
    for style in ("careful", "premature", "skip", "fused", "bare"):
        assert abs(drawn[style] / len(train) - 0.2) < 4 * math.sqrt(0.16 / len(train)), style
    for e in train:
        style, label = style_of(e.problem, knobs.mix), behaviour(e, e.solution)
        # a skip that cannot apply (no "Then" operation before the last, or an inexact division) is written carefully;
        # one that leaves out an operation equal to the last one reads as (and is the same text as) a premature answer
        reads_as = {"careful", "premature"} if e.solution == solution(chain_of(e.problem), "premature") else {"careful"}
        assert label == style or (style == "skip" and label in reads_as), (style, label, e.solution)
    applied = sum(behaviour(e, e.solution) == "skip" for e in train) / drawn["skip"]
    assert 0.3 < applied < 0.6  # measured 0.44: about half the problems have a "Then" operation before the last


def test_unreliable_references_are_wrong_and_the_others_right():
    grade = get_task("arith").grade
    lucky, unreliable = 0, 0
    for e in load_arith("train", MIX, size=3000):
        right = grade(" " + e.solution, e.answer)
        if behaviour(e, e.solution) in ("careful", "fused", "bare"):
            assert right == 1.0, e.solution
        else:  # right only by luck: 0 before a product, or left-out operations that cancel (- 6, + 6)
            lucky, unreliable = lucky + right, unreliable + 1
    assert lucky < 0.02 * unreliable  # measured 16 of 1,118


def test_skip_leaves_out_then_operations_but_never_the_last():
    skipped = [e for e in load_arith("train", "skip=1", size=2000) if behaviour(e, e.solution) == "skip"]
    assert skipped
    for e in skipped:
        chain = chain_of(e.problem)
        lines = e.solution.splitlines()[:-1]
        kept = [(op, n) for i, (op, n, then) in enumerate(chain.ops) if not (then and i < len(chain.ops) - 1)]
        assert [(ln.split()[1], int(ln.split()[2])) for ln in lines] == kept


PROBLEM = ("Ava has 12 apples. Ava gets 5 more apples. Then Ava ends up with 3 times as many. Ava sells 7 apples. "
           "How many apples does Ava have now?")


@pytest.mark.parametrize("response,label", [
    ("12 + 5 = 17\n17 * 3 = 51\n51 - 7 = 44\n#### 44", "careful"),
    ("12 + 5 = 17\n17 * 3 = 41\n41 - 7 = 34\n#### 34", "careful"),  # an arithmetic slip is still the careful way
    (" 12 + 5 = 17\n17 x 3 = 51\n\n51 - 7 = 44\n#### 44\n", "careful"),  # spacing, blank lines, x for times
    ("12 + 5 = 17\n17 * 3 = 51\n#### 51", "premature"),
    ("12 + 5 = 17\n#### 17", "premature"),
    ("12 + 5 = 17\n17 - 7 = 10\n#### 10", "skip"),
    ("12 * 3 = 36\n36 - 7 = 29\n#### 29", "skip"),
    ("(12 + 5) * 3 = 51\n51 - 7 = 44\n#### 44", "fused"),
    ("#### 44", "bare"),
    ("12 + 5 = 17\n17 * 4 = 68\n68 - 7 = 61\n#### 61", "other"),  # a wrong operand
    ("12 + 5 = 17\n17 * 3 = 51\n51 - 7 = 44", "other"),  # no answer line
    ("12 + 5 = 17\nso that is 17\n#### 17", "other"),  # a line that is not an operation
    ("12 + 5 = 17\n17 * 3 = 51\n51 - 7 = 44\n#### 44\n44 + 1 = 45", "other"),  # work after the answer
    ("(12 + 5) * 3 = 51\n#### 51", "other"),  # fused, and then stopped early
])
def test_behaviour_of_hand_written_responses(response, label):
    assert behaviour(Example("x", PROBLEM, "", "44"), response) == label


def test_behaviour_of_a_problem_that_is_not_arith_is_other():
    assert behaviour(Example("x", "What is 2 + 2?", "", "4"), "2 + 2 = 4\n#### 4") == "other"
    assert set(get_task("arith").behaviours) == set(BEHAVIOURS)


@pytest.mark.parametrize("data,match", [
    ("premature=1.5", "knobs"), ("skip=x", "knobs"), ("careful=0.5", "knobs"),
    ("premature=0.7,skip=0.5", "add up to 1.2"), ("max_ops=13", "max_ops <= 12"),
])
def test_bad_knobs_are_refused_in_one_line(data, match):
    with pytest.raises(UserError, match=match):
        load_arith("test", data)
