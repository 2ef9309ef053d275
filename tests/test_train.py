"""End-to-end training: every algorithm runs, resumes exactly after a kill, and fails clearly."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vineppo import cli
from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.core.tracking import Tracker, plan, plot_run
from vineppo.credit import Episode
from vineppo.tasks import TASKS, Example, Task, get_task, register
from vineppo.training import trainer
from vineppo.training.run import RunState
from vineppo.training.trainer import rounded, train

SMALL = dict(prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, mc_k=2, mc_max_states=4, minibatch=8,
             micro_batch=8, eval_problems=4, eval_samples=2, eval_every=1, save_every=1, tensorboard=False)


def _cfg(model: Path, out: Path, **kw) -> configs.TrainConfig:
    return configs.resolve(configs.load_preset("arith-tiny"), {**SMALL, "model": str(model), "out": str(out), **kw})


@pytest.mark.parametrize("algo", ["vineppo", "ppo", "grpo", "rloo"])
def test_two_iterations_of_each_algorithm(tiny_sft, tmp_path, algo, monkeypatch):
    torch.set_num_threads(1)
    trims = []  # each update's freed C-heap pages go back to the system (glibc's malloc_trim, faked here)
    monkeypatch.setattr(trainer, "_MALLOC_TRIM", trims.append)
    summary = train(_cfg(tiny_sft, tmp_path / algo, algo=algo, iterations=2))
    assert trims == [0] * 4  # at each iteration's start and after its update
    out = tmp_path / algo
    assert summary["iterations"] == 2
    saved = json.loads((out / "summary.json").read_text())
    times = ("wall_clock_s", "setup_s", "start_eval_s", "train_s", "eval_s", "save_s")
    assert set(saved) == {"start_test_pass@1", "final_test_pass@1", "best_test_pass@1", "gain", "iterations",
                          *times, "time_budget_reached", "start_test_behaviours", "final_test_behaviours",
                          "sft_test_pass@1", "sft_test_behaviours"}  # sft_*: the start's earlier names, kept
    assert saved["sft_test_pass@1"] == saved["start_test_pass@1"]
    assert saved["sft_test_behaviours"] == saved["start_test_behaviours"]
    assert saved["gain"] == round(saved["final_test_pass@1"] - saved["start_test_pass@1"], 6)  # no 0.0199999...
    for key in ("start_test_behaviours", "final_test_behaviours"):  # arith names its behaviours; shares add up to 1
        assert set(saved[key]) == set(get_task("arith").behaviours) and sum(saved[key].values()) == pytest.approx(1)
    assert (out / "curves.png").stat().st_size > 0  # the run's plot
    assert not saved["time_budget_reached"] and 0 < saved["train_s"] <= saved["wall_clock_s"]
    assert all(saved[k] == round(saved[k], 1) for k in times)
    # the clock counts from the call, so the parts (set-up, the starting model's evaluation, ...) add up to it
    assert saved["setup_s"] > 0 and saved["start_eval_s"] > 0 and saved["eval_s"] > 0
    assert sum(saved[k] for k in times[1:]) == pytest.approx(saved["wall_clock_s"], abs=0.5)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["episodes"] == 16 and "kl" in rows[1] and "time/update_s" in rows[1]
    assert sum(rows[1][f"train/behaviour/{b}"] for b in get_task("arith").behaviours) == pytest.approx(1)
    assert sum(rows[2][f"test/behaviour/{b}"] for b in get_task("arith").behaviours) == pytest.approx(1)
    assert configs.load(out / "config.yaml").algo == algo
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000002"
    assert 0 <= rows[1]["signal/flat_groups"] <= 1 and 0 <= rows[1]["signal/nonzero_tokens"] <= 1
    if algo == "vineppo":
        assert rows[1]["mc/states"] > 0 and rows[1]["mc/continuations"] == 2 * rows[1]["mc/states"]
        assert rows[1]["signal/mixed_states"] == rows[1]["mc/mixed_states"] / rows[1]["mc/states"]
    if algo == "ppo":
        assert "value_loss" in rows[1] and (out / "checkpoints" / "iter-000002" / "critic.pt").exists()


@pytest.mark.parametrize("algo", ["vineppo", "ppo", "grpo", "rloo"])
def test_each_algorithm_raises_a_reward_it_can_learn(tiny_sft, tmp_path, algo):
    """The update climbs the reward: 1 for a response of at most 33 characters (about half of the test model's
    first samples), learnt by stopping sooner. With the advantages' sign flipped the reward fell to 0."""
    torch.set_num_threads(1)
    register(dataclasses.replace(get_task("arith"), name="arith-short", grade=lambda text, answer: float(len(text) <= 33)))
    try:
        train(_cfg(tiny_sft, tmp_path, task="arith-short", algo=algo, iterations=6, samples_per_prompt=8, minibatch=16,
                   micro_batch=16, lr=3e-4, eval_problems=0, eval_every=0, save_every=0))
    finally:
        TASKS.pop("arith-short")
    rewards = [r["train/reward"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert 0.2 < rewards[0] < 0.8, rewards  # both outcomes at the start: something to learn
    assert sum(rewards[-2:]) / 2 >= rewards[0] + 0.3, rewards


def test_the_budget_stops_before_an_iteration_that_would_overshoot():
    from vineppo.training.trainer import budget_spent

    assert not budget_spent(0.0, 1e9, 1e9)  # no budget
    assert not budget_spent(10.0, 7.0, 2.0)  # 7 s spent, iterations of 2 s: one more fits
    assert budget_spent(10.0, 9.0, 2.0)  # it would end at 11 s: stop at 9
    assert budget_spent(10.0, 10.5, 2.0)  # past it already (the first iteration alone took longer)


def test_time_budget_stops_then_evaluates_and_saves(tiny_sft, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "budget"
    summary = train(_cfg(tiny_sft, out, algo="grpo", iterations=5, eval_every=0, save_every=0, time_budget_s=1e-6))
    assert summary["iterations"] == 1 and summary["time_budget_reached"]
    assert "; it ends after 5 iterations or 1e-06 s of training (sampling, credit, updates), whichever comes first" \
        in capsys.readouterr().err  # the plan says what will end the run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and "test/pass@1" in rows[1]  # the final evaluation ran
    assert round(rows[1]["time/train_s"], 1) == summary["train_s"] and rows[1]["time/train_s"] >= 1e-6  # to 0.1 s
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000001"


def _weights(run: Path) -> dict:
    name = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / name / "model.safetensors")


def test_kill_and_resume_matches_uninterrupted(tiny_sft, tmp_path):
    common = ["--model", str(tiny_sft), "--iterations", "4", "--eval-problems", "0"] + \
        [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items() if k not in ("eval_problems",)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, part = tmp_path / "full", tmp_path / "part"
    subprocess.run([sys.executable, "-m", "vineppo", "train", "--out", str(full), *common], check=True, env=env,
                   capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "vineppo", "train", "--out", str(part), *common], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = part / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= "iter-000002"):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = latest.read_text().strip()
    assert "iter-000002" <= done < "iter-000004", f"the run was not killed mid-way ({done})"
    subprocess.run([sys.executable, "-m", "vineppo", "train", "--resume", str(part)], check=True, env=env,
                   capture_output=True)
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(line)["iteration"] for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4]  # no iteration logged twice after the resume
    tables = [json.loads(line)["iteration"] for line in (part / "completions.jsonl").read_text().splitlines()]
    assert tables == [1] * 16 + [4] * 16  # after iteration 1 and the last, each once: 4 prompts x 4 responses


def test_every_response_truncated_is_a_clear_error(tiny_sft, tmp_path):
    with pytest.raises(UserError, match="max_new_tokens=1"):
        train(_cfg(tiny_sft, tmp_path / "run", max_new_tokens=1, iterations=1, eval_problems=0))


def test_nan_loss_is_a_clear_error_and_keeps_the_checkpoint(tiny_sft, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_cfg(tiny_sft, out, algo="grpo", iterations=1, eval_problems=0))
    before = _weights(out)
    import vineppo.training.ppo as ppo

    real = ppo.policy_loss
    monkeypatch.setattr(ppo, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    with pytest.raises(UserError, match="not finite.*iter-000001"):
        train(configs.load(out / "config.yaml").__class__(**{**configs.load(out / "config.yaml").__dict__,
                                                               "iterations": 2}), resume=out)
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000001"
    after = _weights(out)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_out_folder_holding_a_run_is_refused(tiny_sft, tmp_path):
    out = tmp_path / "run"
    train(_cfg(tiny_sft, out, algo="rloo", iterations=1, eval_problems=0))
    with pytest.raises(UserError, match="--resume"):
        train(_cfg(tiny_sft, out, algo="rloo", iterations=1, eval_problems=0))


def test_dropout_off_in_rl_update(tiny_sft, tmp_path, monkeypatch):
    """A model configured with dropout: the first minibatch's ratios are 1 and the first iteration's KL is 0."""
    model = tmp_path / "with-dropout"
    shutil.copytree(tiny_sft, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    import vineppo.training.ppo as ppo

    ratios, real = [], ppo.policy_loss

    def spy(logp, old_logp, ref_logp, advantages, mask, *args, **kw):
        ratios.append(torch.exp(logp - old_logp).detach()[mask.bool()])
        return real(logp, old_logp, ref_logp, advantages, mask, *args, **kw)

    monkeypatch.setattr(ppo, "policy_loss", spy)
    out = tmp_path / "run"  # one optimiser step per iteration, so the logged KL is measured before it
    train(_cfg(model, out, algo="ppo", iterations=1, epochs=1, minibatch=16, micro_batch=8, eval_problems=0))
    off = (torch.cat(ratios[:2]) - 1).abs().max().item()  # the two micro-batches of the first minibatch
    # the old log-probs are the engine's sampling ones: equal to float rounding (dropout 0.1 moves ratios by ~0.1)
    assert off < 1e-4, f"first-minibatch ratios differ from 1 by up to {off}: dropout is on"
    kl = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["kl"]
    assert kl < 1e-6, f"KL to the reference before any step is {kl}: dropout is on"


def _main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code


def test_train_without_config_uses_the_task_preset(tiny_sft, tmp_path, monkeypatch, capsys):
    import vineppo.commands.train as train_mod

    seen = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, resume=None, **kw: seen.append(cfg) or {"out": "x"})
    custom = ["--model", "m", "--reward", "r.py:f", "--device", "cpu"]  # what task custom needs; on a CPU
    for task, preset in (("gsm8k", "gsm8k"), ("math", "math"), ("arith", "arith-tiny"), ("custom", "custom-cpu")):
        assert _main(["train", "--task", task, "--json", *(custom if task == "custom" else [])]) == 0
        need = {"model": "m", "reward": ["r.py:f"]} if task == "custom" else {}
        want, got = configs.resolve(configs.load_preset(preset), need), seen[-1]
        assert (got.task, got.lr, got.max_new_tokens) == (task, want.lr, want.max_new_tokens), \
            f"--task {task} without --config did not run with preset {preset}"
        assert got.preset == preset
    assert _main(["train", "--task", "gsm8k", "--config", "arith-tiny", "--json"]) == 0
    assert (seen[-1].task, seen[-1].lr, seen[-1].preset) == ("gsm8k", 3e-5, "arith-tiny")  # --config wins
    register(Task(name="arith-no-preset", load=get_task("arith").load, grade=get_task("arith").grade,
                  split_steps=get_task("arith").split_steps))
    assert _main(["train", "--task", "arith-no-preset"]) == 2
    assert "--config" in capsys.readouterr().err
    monkeypatch.undo()
    # a real run records the preset in config.yaml and names it in its first line
    out = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**SMALL, "eval_problems": 0}.items()]
    assert _main(["train", "--model", str(tiny_sft), "--out", str(out), "--iterations=1", "--algo=grpo", *flags]) == 0
    assert configs.load(out / "config.yaml").preset == "arith-tiny"
    assert "preset arith-tiny" in capsys.readouterr().err.strip().splitlines()[0]


def test_batch_without_signal_warns_once(tiny_sft, tmp_path, capsys):
    arith = get_task("arith")
    register(Task(name="arith-never-right", load=arith.load, grade=lambda text, answer: 0.0,
                  split_steps=arith.split_steps))
    out = tmp_path / "run"
    train(_cfg(tiny_sft, out, task="arith-never-right", algo="grpo", iterations=4, eval_problems=0))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/mixed_prompts"] for r in rows] == [0.0] * 4
    err = capsys.readouterr().err
    assert err.count("warning:") == 1  # once per run, after NO_SIGNAL_ITERATIONS iterations
    line = next(ln for ln in err.splitlines() if "warning:" in ln)
    assert "grader" in line and "--max-new-tokens" in line
    # and the fraction itself: prompt 0 mixed, prompt 1 all right, prompt 2 all wrong
    from vineppo.training.trainer import _mixed_prompts

    eps = [Episode([1], [2], "", r, g, Example("e", "", "", "7"), [(0, 1)]) for g, r in ((0, 1.0), (0, 0.0), (1, 1.0), (1, 1.0), (2, 0.0))]
    assert _mixed_prompts(eps) == 1


def _group_ep(group: int, reward: float) -> Episode:
    return Episode([1], [2], "", reward, group, Example("e", "", "", "1"), [(0, 1)])


def test_oversampling_keeps_prompts_with_mixed_outcomes_first():
    from vineppo.training.trainer import _informative

    # 5 drawn prompts, 2 responses each: prompts 1 and 3 are mixed, 0, 2 and 4 are not.
    rewards = {0: (1, 1), 1: (0, 1), 2: (0, 0), 3: (1, 0), 4: (1, 1)}
    episodes = [_group_ep(g, r) for g, pair in rewards.items() for r in pair]
    kept = _informative(episodes, 3)
    # mixed prompts 1 and 3 first, then the first uniform one (0), renumbered 0, 1, 2 in that order
    assert [(ep.group, ep.reward) for ep in kept] == [(2, 1), (2, 1), (0, 0), (0, 1), (1, 1), (1, 0)]
    assert len(_informative(episodes, 1)) == 2 and {ep.group for ep in _informative(episodes, 1)} == {0}


def test_oversampled_run_updates_on_the_kept_prompts(tiny_sft, tmp_path):
    torch.set_num_threads(1)
    train(_cfg(tiny_sft, tmp_path / "run", iterations=1, oversample=3, eval_problems=0))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["episodes"] == 3 * 16  # every drawn prompt's responses are sampled and graded ...
    assert row["mc/states_shared"] <= 16 * SMALL["mc_max_states"]  # ... the Monte Carlo runs on the 4 kept prompts
    assert 0.0 <= row["train/kept_mixed_prompts"] <= 1.0


def test_a_run_in_a_log_file_says_its_plan_and_every_phase_and_writes_its_completions(tiny_sft, tmp_path, capsys):
    """Outside a terminal (here: pytest's captured stderr) a run prints its plan first, then a line per phase, so a
    log file is never silent for a whole iteration; completions.jsonl holds what the model wrote."""
    torch.set_num_threads(1)
    out = tmp_path / "run"
    train(_cfg(tiny_sft, out, algo="grpo", iterations=2, completions_every=2))
    err = capsys.readouterr().err
    assert "plan: 2 iterations x 4 prompts x 4 responses x at most 64 tokens; no Monte Carlo; 3 evaluations of 4 " \
           "problems x 2 samples" in err and "warning" not in err
    for line in ("evaluating the starting model (", "iter 1/2 sampling (", "iter 1/2 grading (",
                 "iter 1/2 updating (", "iter 1/2 evaluating (", "iter 2/2 saving (", "iter 2/2 reward "):
        assert line in err, line
    assert err.index("plan:") < err.index("evaluating the starting model")
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1] * 16 + [2] * 16
    assert {"example", "prompt", "completion", "reward", "finish"} <= set(rows[0])
    assert rows[0]["prompt"] and rows[0]["prompt"] in {ex.problem for ex in get_task("arith").load("train", None, 0)}
    assert all(r["finish"] in ("stop", "length") and isinstance(r["completion"], str) for r in rows)


def test_gpu_sized_settings_on_a_cpu_are_warned_with_the_preset_to_use():
    paper = configs.resolve({}, {"task": "custom", "model": "m", "reward": ["r.py:f"]})  # TrainConfig's defaults
    line, warning = plan(paper, "cpu", 0, 100)
    assert line.startswith("plan: 1000 iterations x 64 prompts x 8 responses x at most 1024 tokens; Monte Carlo: "
                           "K = 9 continuations from each of at most 25 states per response; 101 evaluations of 100")
    assert warning.startswith("warning: GPU-sized settings on a CPU") and "--config custom-cpu" in warning
    assert plan(paper, "cuda", 0, 100)[1] is None  # the same settings are a GPU's
    small = configs.resolve(configs.load_preset("custom-cpu"), {"model": "m", "reward": ["r.py:f"]})
    assert plan(small, "cpu", 0, 61) == ("plan: 10 iterations x 8 prompts x 8 responses x at most 48 tokens; Monte "
                                         "Carlo: K = 3 continuations from each of the states budget:2 picks per "
                                         "response (at most 25); 3 evaluations of 61 problems x 2 samples", None)
    assert "--config arith-tiny" in plan(configs.resolve({}, {}), "cpu", 0, 500)[1]
    assert plan(small, "cpu", 5, 61)[0].startswith("plan: 5 iterations")  # a resume plans what is left
    assert plan(configs.resolve({}, {"eval_problems": 0}), "cpu", 0, 0)[0].endswith("no evaluation")


def test_the_summary_rounds_and_reads_states_saved_before_the_rename():
    assert rounded({"gain": 0.46125 - 0.44125, "wall_clock_s": 722.04817, "shares": {"a": 1 / 3}, "n": 7}) == \
        {"gain": 0.02, "wall_clock_s": 722.0, "shares": {"a": 0.333333}, "n": 7}
    state = RunState.from_json({"iteration": 3, "sft_test_pass@1": 0.25, "sft_test_behaviours": {"careful": 1.0},
                                "wall_clock_s": 9.0})
    assert (state.start_test_pass1, state.start_test_behaviours, state.setup_s) == (0.25, {"careful": 1.0}, 0.0)


def test_curves_show_the_training_reward_of_a_run_without_evaluations(tmp_path):
    rows = [{"iteration": i, "train/reward": 0.1 * i, "time/train_s": 2.0 * i} for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run(tmp_path) == tmp_path / "curves.png" and (tmp_path / "curves.png").stat().st_size > 0


def test_the_algo_flag_s_help_names_the_algorithms(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at hyphens (grpo-trl) in a narrow terminal
    assert _main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "ALGOS" not in text
    assert "one of " + ", ".join(configs.ALGOS) + ": picks the update" in text


def test_a_completions_table_goes_to_its_jsonl_and_to_tensorboard_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional: TensorBoard

    tracker = Tracker(tmp_path, tensorboard=True)
    tracker.table(3, [{"prompt": [{"role": "user", "content": "a | b"}], "completion": "x\ny", "reward": 1.0}])
    tracker.close()
    assert json.loads((tmp_path / "completions.jsonl").read_text()) == \
        {"iteration": 3, "prompt": [{"role": "user", "content": "a | b"}], "completion": "x\ny", "reward": 1.0}
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    text = events.Tensors("completions/text_summary")[0]
    assert text.step == 3 and b"x<br>y" in text.tensor_proto.string_val[0]


def test_entropy_states_choose_fewer_states_from_the_samplers_entropies(tiny_sft, tmp_path):
    torch.set_num_threads(1)
    rows = {}
    for mode in ("all", "entropy:1"):
        train(_cfg(tiny_sft, tmp_path / mode, algo="vineppo", iterations=1, eval_problems=0, mc_max_states=25,
                   mc_states=mode))
        rows[mode] = json.loads((tmp_path / mode / "metrics.jsonl").read_text().splitlines()[-1])
    # the same samples (the entropies change no draw): at most 2 states a response against every step start
    assert rows["entropy:1"]["train/reward"] == rows["all"]["train/reward"]
    assert rows["entropy:1"]["mc/states_shared"] <= 2 * rows["all"]["episodes"] < rows["all"]["mc/states_shared"]
    with pytest.raises(UserError, match="--mc-states: entropy:M reads the sampler's per-token entropies"):
        configs.resolve(configs.load_preset("arith-tiny"), {"mc_states": "entropy:2", "engine": "vllm"})


def test_train_ids_choose_the_training_prompts(tiny_sft, tmp_path):
    from vineppo.training.run import load_data

    ids = tmp_path / "ids.txt"
    ids.write_text("# prompts the start model solves 5-30% of the time\narith-train-7\n\narith-train-3  # and this one\n")
    data = load_data(configs.TrainConfig(train_ids=str(ids)), get_task("arith"))
    assert [ex.id for ex in data.train] == ["arith-train-7", "arith-train-3"]
    ids.write_text("arith-train-7\narith-train-x\n")
    with pytest.raises(UserError, match=r"--train-ids .*ids.txt:2: no training example 'arith-train-x'"):
        load_data(configs.TrainConfig(train_ids=str(ids)), get_task("arith"))


def test_the_pace_line_counts_what_is_left_from_the_first_iteration():
    from vineppo.training.run import RunState
    from vineppo.training.trainer import pace

    state = RunState(train_s=30.0, start_eval_s=12.0)
    cfg = configs.TrainConfig(iterations=10, eval_every=5, eval_problems=100)
    assert pace(cfg, 1, 30.0, state) == ("pace: iteration 1 took 30 s and an evaluation 12 s: about 5 minutes more "
                                         "(9 iterations, 2 evaluations; checkpoints not counted)")  # 270 + 24 s
    budget = configs.TrainConfig(iterations=1000, eval_every=5, eval_problems=100, time_budget_s=120.0)
    assert "(3 iterations, 1 evaluation;" in pace(budget, 1, 30.0, state)  # the budget ends it after 3 more


def test_a_meter_counts_over_a_phases_jobs_and_shows_at_most_every_so_often(monkeypatch):
    from vineppo.core import tracking

    shown = []
    meter = tracking.Meter("evaluating test", 12, shown.append, every=0.0)
    meter(3, 30)
    meter(8, 80)  # the sampled job goes on
    meter(2, 10)  # the greedy job starts from 0 again: 8 + 2 done
    assert meter.done == 10 and shown[-1].startswith("evaluating test: 10/12 samples, ") and "tokens/s" in shown[-1]
    quiet = tracking.Meter("sampling", None, shown.append, every=3600.0)
    quiet(5, 50)
    assert len(shown) == 3 and quiet.text().startswith("sampling: 5 samples")  # nothing shown within the hour


def test_long_phases_say_how_far_they_are_and_the_start_score_comes_at_once(tiny_sft, tmp_path, capsys,
                                                                             monkeypatch):
    from vineppo.core import tracking

    torch.set_num_threads(1)
    monkeypatch.setattr(tracking, "PROGRESS_EVERY", 0.0)  # a line at every report (the default: every 10 s)
    train(_cfg(tiny_sft, tmp_path / "r", algo="vineppo", iterations=2))
    err = capsys.readouterr().err
    assert "start: test/pass@1 0." in err and err.index("start: test/pass@1") < err.index("iter 1/2 sampling")
    assert err.count("pace: iteration 1 took ") == 1 and "1 iteration, 1 evaluation" in err
    for line in ("evaluating test: ", "iter 1/2 sampling: ", "iter 1/2 credit assignment: ",
                 "iter 1/2 evaluating test: "):
        assert line in err, line
    assert err.index("evaluating test: ") < err.index("iter 1/2 sampling")  # the start's evaluation too
    assert "sampling: 16/16 samples, " in err and "/12 samples, " in err and " continuations, " in err
