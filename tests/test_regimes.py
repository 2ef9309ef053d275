"""The regimes study's statistics (results/regimes/report.py) on planted runs: the normalisation rule that sets the
defaults, test pass@1 at a matched training accuracy, and the flat-group correlation."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report():
    """results/regimes/report.py as a module (it imports results/studies.py beside it)."""
    sys.path.insert(0, str(ROOT / "results"))
    spec = importlib.util.spec_from_file_location("regimes_report", ROOT / "results/regimes/report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(root: Path, condition: str, name: str, final: float, rewards=(), evals=()) -> None:
    """A finished run: its summary's final test pass@1 and metrics rows (train/reward per iteration, evaluations)."""
    folder = root / condition / name
    folder.mkdir(parents=True)
    rows = [{"iteration": i + 1, "train/reward": r} for i, r in enumerate(rewards)]
    for it, test in evals:
        rows.append({"iteration": it, "test/pass@1": test, "time/train_s": float(it)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"final_test_pass@1": final, "iterations": len(rewards),
                                                     "train_s": 90.0}))


@pytest.mark.parametrize("whitened_lead, default", [(0.05, "whiten"), (0.0, "scale"), (-0.05, "scale")])
def test_the_default_normalisation_is_scale_unless_whitening_is_shown_better(tmp_path, whitened_lead, default):
    report = _report()
    for c, base in (("hard", 0.30), ("cutoff", 0.40)):
        for s, noise in enumerate((0.0, 0.004, -0.003)):
            _run(tmp_path, c, f"vineppo-s{s}", base + whitened_lead + noise)
            _run(tmp_path, c, f"vineppo-scale-s{s}", base - noise / 2)
    rule = report.normalisation(tmp_path)["vineppo-scale - vineppo"]
    assert rule["pairs"] == 6 and rule["default"] == default
    assert set(rule["per_condition"]) == {"hard", "cutoff"}


def test_test_pass_at_a_matched_training_accuracy_is_read_between_the_evaluations_around_its_first_crossing():
    report = _report()
    points = [(0.2, 0.30), (0.4, 0.50), (0.3, 0.10), (0.6, 0.70)]
    assert report.at_accuracy(points, 0.3) == pytest.approx(0.40)  # the first crossing, not the later one
    assert report.at_accuracy(points, 0.9) is None
    run = {"rows": [{"iteration": i, "train/reward": r} for i, r in enumerate((0.1, 0.2, 0.3, 0.4, 0.5), 1)],
           "evals": [(0, 0.0, 0.1), (5, 5.0, 0.6)]}
    assert report.accuracy_points(run) == [(pytest.approx(0.3), 0.6)]  # the start is no point; 5 iterations' mean


def test_a_condition_report_pairs_the_seeds_and_reads_every_run_at_the_accuracy_and_iteration_all_reached(tmp_path):
    report = _report()
    for s in range(3):
        _run(tmp_path, "groups-2", f"vineppo-scale-s{s}", 0.5 + 0.01 * s, rewards=[0.2] * 5 + [0.6] * 5,
             evals=[(0, 0.1), (5, 0.3), (10, 0.6), (14, 0.7)])
        _run(tmp_path, "groups-2", f"grpo-s{s}", 0.4 + 0.02 * s, rewards=[0.2] * 5 + [0.4] * 5,
             evals=[(0, 0.1), (5, 0.2), (10, 0.4), (12, 0.45)])
    r = report.condition_report("groups-2", report.load_all(tmp_path, "groups-2"))
    d = r["differences"]["vineppo-scale - grpo"]
    assert d["values"] == pytest.approx([0.1, 0.09, 0.08]) and d["seeds"] == [0, 1, 2] and d["verdict"] == "shown"
    assert r["matched_accuracy"] == pytest.approx(0.4)  # grpo's best: every run reached it
    assert r["pass@1_at_matched_accuracy"]["grpo"]["mean"] == pytest.approx(0.4)
    assert r["pass@1_at_matched_accuracy"]["vineppo-scale"]["mean"] == pytest.approx(0.3 + 0.3 * 0.2 / 0.4)
    assert r["equal_iterations"] == 10  # the last iteration every run evaluated (grpo's last is 12)
    assert r["pass@1_at_equal_iterations"]["vineppo-scale"]["mean"] == pytest.approx(0.6)
    assert "signal/flat_groups" not in r["signals"]["grpo"]  # a metric no run has is left out, not NaN


def test_spearman_is_one_for_a_monotone_relation_and_minus_one_for_its_reverse():
    report = _report()
    assert report.spearman([0.1, 0.5, 0.9], [1.0, 2.0, 5.0]) == pytest.approx(1.0)
    assert report.spearman([0.1, 0.5, 0.9], [5.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert report.spearman([0.1, 0.5], [1.0, 2.0]) is None
