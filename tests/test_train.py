"""End-to-end training: every algorithm runs, resumes exactly after a kill, and fails clearly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vineppo import config as configs
from vineppo.errors import UserError
from vineppo.train import train

SMALL = dict(prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, mc_k=2, mc_max_states=4, minibatch=8,
             micro_batch=8, eval_problems=4, eval_samples=2, eval_every=1, save_every=1, tensorboard=False)


def _cfg(model: Path, out: Path, **kw) -> configs.TrainConfig:
    return configs.resolve(configs.load_preset("arith-tiny"), {**SMALL, "model": str(model), "out": str(out), **kw})


@pytest.mark.parametrize("algo", ["vineppo", "ppo", "grpo", "rloo"])
def test_two_iterations_of_each_algorithm(tiny_sft, tmp_path, algo):
    torch.set_num_threads(1)
    summary = train(_cfg(tiny_sft, tmp_path / algo, algo=algo, iterations=2))
    out = tmp_path / algo
    assert summary["iterations"] == 2
    saved = json.loads((out / "summary.json").read_text())
    assert set(saved) == {"sft_test_pass@1", "final_test_pass@1", "best_test_pass@1", "iterations", "wall_clock_s"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["episodes"] == 16 and "kl" in rows[1] and "time/update_s" in rows[1]
    assert configs.load(out / "config.yaml").algo == algo
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000002"
    if algo == "vineppo":
        assert rows[1]["mc/states"] > 0 and rows[1]["mc/continuations"] == 2 * rows[1]["mc/states"]
    if algo == "ppo":
        assert "value_loss" in rows[1] and (out / "checkpoints" / "iter-000002" / "critic.pt").exists()


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


def test_every_response_truncated_is_a_clear_error(tiny_sft, tmp_path):
    with pytest.raises(UserError, match="max_new_tokens=1"):
        train(_cfg(tiny_sft, tmp_path / "run", max_new_tokens=1, iterations=1, eval_problems=0))


def test_nan_loss_is_a_clear_error_and_keeps_the_checkpoint(tiny_sft, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_cfg(tiny_sft, out, algo="grpo", iterations=1, eval_problems=0))
    before = _weights(out)
    import vineppo.ppo as ppo

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
