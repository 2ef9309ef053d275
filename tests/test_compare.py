"""`vineppo compare`: the report from synthetic run folders, and which runs are (re)started."""

import json
import sys

import pytest
import yaml

from vineppo.commands.compare import plan, report, train_command
from vineppo.core.errors import UserError


def _write_run(out, name, tests, per_iter_s, train=None, eval_every=2):
    """A fake finished run: test pass@1 at iterations 0, eval_every, 2 * eval_every, ..."""
    d = out / "runs" / name
    d.mkdir(parents=True)
    n = eval_every * (len(tests) - 1)
    train = train or [0.5] * n
    lines = [{"iteration": 0, "test/pass@1": tests[0]}]
    for it in range(1, n + 1):
        m = {"iteration": it, "train/reward": train[it - 1], "time/sampling_s": 1.0, "time/credit_s": 2.0,
             "time/update_s": 3.0, "time/wall_clock_s": per_iter_s * it, "episodes": 128}
        if it % eval_every == 0:
            m["test/pass@1"] = tests[it // eval_every]
        lines.append(m)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (d / "config.yaml").write_text(yaml.safe_dump({"algo": name.split("-")[0]}))
    (d / "summary.json").write_text(json.dumps({"sft_test_pass@1": tests[0], "final_test_pass@1": tests[-1],
                                                "best_test_pass@1": max(tests), "iterations": n,
                                                "wall_clock_s": per_iter_s * n}))


@pytest.fixture
def comparison(tmp_path):
    _write_run(tmp_path, "ppo-s0", [0.2, 0.3, 0.4], 10.0, train=[0.1, 0.3, 0.5, 0.7])
    _write_run(tmp_path, "ppo-s1", [0.2, 0.5, 0.4], 20.0)
    _write_run(tmp_path, "vineppo-s0", [0.2, 0.5, 0.6], 30.0)
    _write_run(tmp_path, "vineppo-s1", [0.2, 0.4, 0.5], 30.0)
    _write_run(tmp_path, "grpo-s0", [0.2, 0.3, 0.3], 5.0)
    (tmp_path / "runs" / "rloo-s0").mkdir()  # killed before finishing: listed, not counted
    return tmp_path


def test_report_only_numbers(comparison):
    s = report(comparison)
    assert s["ppo_best_test_pass@1"] == pytest.approx(0.45)  # mean of the PPO seeds' best (0.4, 0.5)
    ppo, vine, grpo = s["algos"]["ppo"], s["algos"]["vineppo"], s["algos"]["grpo"]
    assert ppo["final_test_pass@1"] == pytest.approx({"mean": 0.4, "std": 0.0})
    assert ppo["best_test_pass@1"]["std"] == pytest.approx(0.0707107, rel=1e-5)
    assert vine["final_test_pass@1"]["mean"] == pytest.approx(0.55)
    assert vine["sft_test_pass@1"] == pytest.approx({"mean": 0.2, "std": 0.0})
    assert ppo["wall_clock_per_iteration_s"] == pytest.approx({"mean": 15.0, "std": 7.0710678})
    assert vine["time/credit_s"] == pytest.approx({"mean": 2.0, "std": 0.0})
    # time to 0.45: PPO s0 never, s1 at iteration 2 (40 s); VinePPO s0 at iteration 2 (60 s), s1 at iteration 4 (120 s)
    assert ppo["time_to_ppo_best_s"]["per_seed"] == [None, 40.0]
    assert ppo["time_to_ppo_best_s"]["mean"] == 40.0 and ppo["time_to_ppo_best_s"]["reached"] == 1
    assert vine["time_to_ppo_best_s"]["mean"] == pytest.approx(90.0)
    assert vine["time_to_ppo_best_s"]["std"] == pytest.approx(42.426407)
    assert grpo["time_to_ppo_best_s"]["mean"] is None and grpo["time_to_ppo_best_s"]["reached"] == 0
    # curves: mean over seeds per evaluated iteration; train reward = mean since the previous evaluation
    c = ppo["curves"]
    assert c["iteration"] == [0, 2, 4]
    assert c["test"] == pytest.approx([0.2, 0.4, 0.4]) and c["test_std"][1] == pytest.approx(0.1414214)
    assert c["wall_clock_s"] == pytest.approx([0.0, 30.0, 60.0])
    assert c["train"][0] is None and c["train"][1:] == pytest.approx([(0.2 + 0.5) / 2, (0.6 + 0.5) / 2])
    for f in ("report.md", "compare.json", "test_vs_iteration.png", "test_vs_wallclock.png", "test_vs_train.png"):
        assert (comparison / f).stat().st_size > 0
    text = (comparison / "report.md").read_text()
    assert "never" in text and "rloo-s0" in text and "| vineppo | 2 | 55.0 ± 7.1 |" in text
    assert json.loads((comparison / "compare.json").read_text())["algos"]["vineppo"]["seeds"] == [0, 1]


def test_cli_report_only_json(comparison, capsys):
    from vineppo.cli import main

    with pytest.raises(SystemExit) as e:
        main(["compare", "--report-only", "--out", str(comparison), "--json"])
    assert e.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["algos"]) == {"ppo", "vineppo", "grpo"}
    assert printed["algos"]["vineppo"]["best_test_pass@1"]["mean"] == pytest.approx(0.55)


def test_report_only_without_runs(tmp_path):
    with pytest.raises(UserError):
        report(tmp_path)


def test_train_command_skips_resumes_and_restarts(tmp_path, comparison):
    done = comparison / "runs" / "ppo-s0"
    assert train_command(done, "ppo", 0, None, "arith-tiny", []) is None
    assert train_command(done, "ppo", 0, 4, "arith-tiny", []) is None
    with pytest.raises(UserError):  # more iterations asked, no checkpoint: refuse rather than delete a finished run
        train_command(done, "ppo", 0, 8, "arith-tiny", [])
    assert (done / "summary.json").exists()
    (done / "checkpoints").mkdir()
    (done / "checkpoints" / "latest").write_text("iter-000004\n")
    more = train_command(done, "ppo", 0, 8, "arith-tiny", [])  # asked for more iterations: continue it
    assert more[1:] == ["-m", "vineppo", "train", "--resume", str(done), "--iterations", "8", "--json"]
    budgeted = json.loads((done / "summary.json").read_text()) | {"time_budget_reached": True}
    (done / "summary.json").write_text(json.dumps(budgeted))
    assert train_command(done, "ppo", 0, 8, "arith-tiny", []) is None  # stopped by its time budget: finished
    half = tmp_path / "half"
    (half / "checkpoints").mkdir(parents=True)
    (half / "checkpoints" / "latest").write_text("iter-000002\n")
    assert "--resume" in train_command(half, "vineppo", 1, None, "arith-tiny", [])
    killed = tmp_path / "vineppo-s2"  # no checkpoint yet: started again from scratch
    killed.mkdir()
    (killed / "config.yaml").write_text("algo: vineppo\n")
    cmd = train_command(killed, "vineppo", 2, 3, "arith-tiny", ["--device", "cpu"])
    assert not killed.exists()
    assert cmd == [sys.executable, "-m", "vineppo", "train", "--config", "arith-tiny", "--algo", "vineppo", "--seed",
                   "2", "--out", str(killed), "--iterations", "3", "--device", "cpu", "--json"]


def test_plan_checks_budgets(tmp_path):
    plan(["vineppo", "ppo", "grpo", "rloo"], 3, "arith-tiny")
    plan(["vineppo", "ppo", "grpo", "rloo", "restem", "dpo-positive"], 3, "arith-tiny")
    preset = tmp_path / "p.yaml"
    preset.write_text("task: arith\nalgos:\n  grpo:\n    samples_per_prompt: 4\n")
    with pytest.raises(UserError):
        plan(["vineppo", "grpo"], 1, str(preset))
    with pytest.raises(UserError):
        plan(["nope"], 1, "arith-tiny")
    with pytest.raises(UserError):
        plan(["ppo"], 0, "arith-tiny")


def test_run_all_runs_jobs_in_parallel_and_reports_failures(tmp_path, monkeypatch):
    import vineppo.commands.compare as compare

    def fake_command(run_dir, algo, seed, iterations, preset, extra):
        if algo == "rloo":  # a run that crashes
            return [sys.executable, "-c", "import sys; sys.exit(3)"]
        code = (f"import json, os, pathlib; d = pathlib.Path({str(run_dir)!r}); d.mkdir(parents=True); "
                f"assert os.environ['OMP_NUM_THREADS'] == str(max(1, (os.cpu_count() or 1) // 2)); "
                f"(d / 'metrics.jsonl').write_text(json.dumps({{'iteration': 0, 'test/pass@1': 0.5}}) + '\\n'); "
                f"(d / 'summary.json').write_text(json.dumps({{'sft_test_pass@1': 0.5, 'final_test_pass@1': 0.5, "
                f"'best_test_pass@1': 0.5, 'iterations': 1, 'wall_clock_s': 1.0}}))")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(compare, "train_command", fake_command)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    failed = compare.run_all(tmp_path, ["ppo", "rloo"], 2, 1, "arith-tiny", jobs=2, extra=[])
    assert sorted(failed) == ["rloo-s0", "rloo-s1"]
    assert (tmp_path / "runs" / "ppo-s1" / "summary.json").exists() and (tmp_path / "logs" / "rloo-s0.log").exists()
    assert compare.report(tmp_path)["algos"]["ppo"]["time_to_ppo_best_s"]["mean"] == 0.0


def test_cpu_threads_follow_omp_num_threads_when_set(monkeypatch):
    import os

    import vineppo.commands.compare as compare

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. a compare that shares the machine with another job
    assert compare.cpu_threads() == 1
    for unset in ("", "0", "two"):  # unset or not a positive count: every core
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert compare.cpu_threads() == (os.cpu_count() or 1)


def test_report_lists_restem_and_dpo_positive_with_the_validation_pick(comparison):
    _write_run(comparison, "restem-s0", [0.2, 0.5, 0.3], 4.0)
    _write_run(comparison, "dpo-positive-s0", [0.2, 0.3, 0.4], 4.0)
    summary_path = comparison / "runs" / "restem-s0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update({"best_val_iteration": 2, "best_val_pass@1": 0.6, "test_at_best_val_pass@1": 0.5})
    summary_path.write_text(json.dumps(summary))
    s = report(comparison)
    assert list(s["algos"]) == ["vineppo", "ppo", "grpo", "restem", "dpo-positive"]  # the paper's baselines last
    assert s["algos"]["restem"]["test_at_best_val_pass@1"] == {"mean": 0.5, "std": 0.0}
    assert s["algos"]["dpo-positive"]["final_test_pass@1"]["mean"] == pytest.approx(0.4)
    text = (comparison / "report.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["restem"].startswith("| restem | 1 | 30.0 ± 0.0 |") and rows["restem"].endswith("| 50.0 ± 0.0 |")
    assert rows["dpo-positive"].startswith("| dpo-positive | 1 | 40.0 ± 0.0 |")
    assert rows["dpo-positive"].endswith("| n/a |") and rows["ppo"].endswith("| n/a |")  # no validation split
