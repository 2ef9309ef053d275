"""`vineppo analyze-credit`: the first wrong line of a response, its tokens, and the localisation measure, on
hand-made responses and advantages; then one small run end to end."""

import json

import pytest
import torch

from vineppo.analysis.localisation import line_token_ranges, localisation, mean_se, pick
from vineppo.cli import main
from vineppo.credit import Episode
from vineppo.tasks import Example
from vineppo.tasks.arith import first_wrong_line

# A generated test problem: 46 + 20 = 66, * 11 = 726, - 64 = 662.
PROBLEM = ("Milo has 46 stickers. Then Milo finds 20 more. The number of stickers is multiplied by 11. "
           "Then Milo loses 64 of them. How many stickers does Milo end up with?")
RIGHT = "46 + 20 = 66\n66 * 11 = 726\n726 - 64 = 662\n#### 662"
EX = Example("t", PROBLEM, RIGHT, "662")


@pytest.mark.parametrize("response, expected", [
    (RIGHT, None),
    ("46 + 20 = 66\n66 * 11 = 726\n#### 726", (2, "premature")),              # the last operation left out
    ("46 + 20 = 66\n66 - 64 = 2\n#### 2", (1, "skip")),                        # the * 11 skipped mid-chain
    ("46 + 20 = 66\n66 * 11 = 716\n716 - 64 = 652\n#### 652", (1, "slip")),   # right operation, wrong result
    ("46 + 20 = 66\n67 * 11 = 737\n737 - 64 = 673\n#### 673", (1, "other")),  # a wrong copy of the value
    ("46 + 20 = 66\n66 * 11 = 726\n726 - 64 = 662\n#### 661", (3, "other")),  # right lines, wrong answer
    ("(46 + 20) * 11 = 726\n726 - 64 = 662\n#### 662", (0, "other")),          # fused: not a careful line
    ("46 + 20 = 66\n\n66 * 11 = 726\n#### 726", (2, "premature")),            # blank lines are not lines
    ("46 + 20 = 66\n66 * 11 = 726", (1, "other")),                              # no answer line
])
def test_first_wrong_line(response, expected):
    assert first_wrong_line(EX, response) == expected


def test_every_generated_reference_is_read_as_its_style():
    from vineppo.tasks.arith import load_arith

    for ex in load_arith("test")[:200]:  # careful references are right; premature ones stop before the last line
        got = first_wrong_line(ex, ex.solution)
        assert got is None or got[1] == "premature", (ex.solution, got)


def test_line_token_ranges_follow_the_first_character_of_each_token():
    text = "ab\ncd\n\nef"
    # tokens start at: a(0) b(1) \n(2) c(3) d(4) \n\n(5) e(7) f(8), then EOS past the end (9)
    offsets = [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert line_token_ranges(text, offsets) == [(0, 3), (3, 6), (6, 9)]


def test_localisation_share_and_before_by_hand():
    lines = [(0, 2), (2, 4), (4, 8)]  # three lines, the last one (4 tokens) bad
    adv = torch.tensor([0.0, 0.2, 0.0, 0.0, -0.5, -0.5, -0.3, -0.2])
    got = localisation(adv, lines, bad=2)
    assert got["share"] == pytest.approx(1.0) and got["before"] == pytest.approx((0.1 + 0.0) / 2)
    flat = torch.full((8,), -0.25)  # a group baseline: every token the same advantage
    got = localisation(flat, lines, bad=2)
    assert got["share"] == pytest.approx(4 / 8) and got["before"] == pytest.approx(-0.25)
    mixed = torch.tensor([-1.0, -1.0, 0.0, 0.0, -1.0, -1.0, 0.0, 0.0])
    assert localisation(mixed, lines, bad=2)["share"] == pytest.approx(0.5)
    assert localisation(torch.zeros(8), lines, bad=2)["share"] is None  # no negative mass: nothing to share
    assert localisation(flat, lines, bad=0)["before"] is None  # no line before the first


def test_mean_se_skips_missing_values():
    assert mean_se([None, None]) == {"mean": None, "se": None, "n": 0}
    got = mean_se([1.0, None, 3.0])
    assert got["mean"] == 2.0 and got["n"] == 2 and got["se"] == pytest.approx(1.0)


def _episode(text: str, reward: float, group: int) -> Episode:
    return Episode([1], [2, 3], text, reward, group, Example("e", "", "", "662"), [(0, 2)])


def test_pick_labels_first_errors_and_spreads_over_problems():
    right = RIGHT
    premature, slip = "46 + 20 = 66\n66 * 11 = 726\n#### 726", "46 + 20 = 66\n66 * 11 = 716\n716 - 64 = 652\n#### 652"
    episodes = [_episode(t, r, g) for g in (0, 1) for t, r in ((premature, 0.0), (premature, 0.0), (right, 1.0),
                                                              (slip, 0.0))]
    chosen, kinds = pick(episodes, [EX] * len(episodes), per_label=2)
    assert kinds == {"premature": 4, "slip": 2}
    behaviour = [c["episode"] for c in chosen if c["label"] == "behaviour"]
    assert behaviour == [0, 4]  # the first response of each problem before the second of either
    assert [c["episode"] for c in chosen if c["label"] == "slip"] == [3, 7]
    assert all(c["bad_line"] == (2 if c["kind"] == "premature" else 1) for c in chosen)


def test_analyze_credit_end_to_end(tiny_sft, tmp_path, capsys):
    out = tmp_path / "credit"
    with pytest.raises(SystemExit) as done:
        main(["analyze-credit", "--model", str(tiny_sft), "--data", "premature=0.5", "--problems", "6",
              "--samples", "4", "--responses", "4", "--gt-k", "8", "--device", "cpu", "--out", str(out), "--json"])
    assert done.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["summary"]) == {"behaviour", "slip"} and summary["responses"] == 24
    saved = json.loads((out / "credit.json").read_text())
    assert set(saved["methods"]) == {"grpo", "rloo", "tempo", "vineppo_k1", "vineppo_k3", "vineppo_k9",
                                     "vineppo_adaptive", "truth"}
    for row in saved["rows"]:  # group methods blame every token alike: their share is the line's token share
        if row["grpo"]["share"] is not None:
            assert row["grpo"]["share"] == pytest.approx(row["bad_line_token_share"], abs=1e-5)
    assert (out / "credit.png").stat().st_size > 0 and (out / "credit.md").read_text().startswith("| first error")


def test_analyze_credit_refuses_other_tasks(capsys):
    with pytest.raises(SystemExit) as done:
        main(["analyze-credit", "--task", "gsm8k"])
    assert done.value.code != 0
    assert "only --task arith" in capsys.readouterr().err
