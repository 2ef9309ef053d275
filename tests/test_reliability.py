"""Reliability: settings checked before any model loads, one run per folder, resume that cannot
silently do the wrong thing, and one-line errors for full disks, damaged files and bad paths.

Tests of bad settings pass a model path that does not exist: a check that ran after a load attempt would
report the missing model instead of the setting.
"""

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from vineppo import cli
from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.models.causal_lm import load_model
from vineppo.training.trainer import train

NO_MODEL = "/no/such/model-folder"
SMALL = dict(algo="grpo", prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, minibatch=8, micro_batch=8,
             eval_problems=0, save_every=1, keep_checkpoints=2, tensorboard=False)

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(model, out, **kw) -> configs.TrainConfig:
    return configs.resolve(configs.load_preset("arith-tiny"), {**SMALL, "model": str(model), "out": str(out), **kw})


def _resumed(run, iterations: int) -> configs.TrainConfig:
    """The run's saved configuration asking for a new total, as `--resume RUN --iterations N` builds it."""
    return dataclasses.replace(configs.load(run / "config.yaml"), iterations=iterations)


def _cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `vineppo ARGV` run in this process."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _fails(capsys, argv: list[str]) -> str:
    """The one-line error of a command that must fail with exit code 2."""
    code, _, err = _cli(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run2(tiny_sft, tmp_path_factory):
    """A finished 2-iteration GRPO run with checkpoints iter-000001 and iter-000002; tests work on copies."""
    out = tmp_path_factory.mktemp("runs") / "run2"
    train(_cfg(tiny_sft, out, iterations=2))
    return out


@pytest.fixture
def run(run2, tmp_path):
    shutil.copytree(run2, tmp_path / "run")
    return tmp_path / "run"


def _iterations(run) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ 1. extend, killed, then a plain --resume


def test_extended_total_survives_a_kill_and_a_plain_resume(run, capsys, monkeypatch):
    import vineppo.training.algorithms as algorithms  # the PPO update is called by the PPO family's registered function

    real, calls = algorithms.ppo_update, []

    def killed_in_iteration_4(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(algorithms, "ppo_update", killed_in_iteration_4)
    code, _, _ = _cli(capsys, ["train", "--resume", str(run), "--iterations", "4"])
    assert code == 130 and (run / "checkpoints" / "latest").read_text().strip() == "iter-000003"
    monkeypatch.setattr(algorithms, "ppo_update", real)
    code, out, _ = _cli(capsys, ["train", "--resume", str(run), "--json"])
    assert code == 0 and json.loads(out)["iterations"] == 4  # the total last asked for, not the original 2
    assert _iterations(run) == [1, 2, 3, 4]


# ------------------------------------------------------------------ 2. one run per folder


@pytest.mark.parametrize("how", ["resume", "out"])
def test_a_run_folder_in_use_is_refused_naming_the_holder(tmp_path, capsys, how):
    out = tmp_path / "run"
    out.mkdir()
    configs.save(_cfg(NO_MODEL, out), out / "config.yaml")
    with open(out / ".lock", "a+") as held:  # another run holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("process 4242 on host elsewhere\n")
        held.flush()
        argv = ["--resume", str(out)] if how == "resume" else ["--out", str(out), "--model", NO_MODEL]
        err = _fails(capsys, ["train", *argv])
    assert "in use by process 4242 on host elsewhere" in err


def test_the_lock_names_this_process_while_the_run_lives(run, monkeypatch):
    import vineppo.training.algorithms as algorithms

    real, seen = algorithms.ppo_update, []
    monkeypatch.setattr(algorithms, "ppo_update",
                        lambda *a, **k: seen.append((run / ".lock").read_text()) or real(*a, **k))
    train(_resumed(run, 3), resume=run)
    assert seen == [f"process {os.getpid()} on host {socket.gethostname()}\n"]
    with open(run / ".lock", "a+") as f:  # released at the end
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ------------------------------------------------------------------ 3. a changed starting model


def test_resume_refuses_a_changed_starting_model(tiny_sft, tmp_path):
    model = tmp_path / "sft"
    shutil.copytree(tiny_sft, model)
    out = tmp_path / "run"
    train(_cfg(model, out, iterations=1))
    weights = load_file(model / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01  # e.g. `vineppo sft` run again into the same folder
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="not the one this run started from") as e:
        train(_resumed(out, 2), resume=out)
    assert "\n" not in str(e.value)
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000001"


# ------------------------------------------------------------------ 4, 6, 7. settings checked before any model loads


@pytest.mark.parametrize("flags,message", [
    # 4: settings that make training learn nothing or compute the wrong thing
    (["--algo", "grpo", "--samples-per-prompt", "1"], "--samples-per-prompt: grpo compares"),
    (["--algo", "rloo", "--samples-per-prompt", "1"], "--samples-per-prompt: rloo compares"),
    (["--temperature", "-1"], "--temperature: must be > 0 and finite"),
    (["--epochs", "0"], "--epochs: must be >= 1, got 0"),
    (["--iterations", "0"], "--iterations: must be >= 1, got 0"),
    (["--iterations", "-3"], "--iterations: must be >= 1, got -3"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
    (["--token-budget", "100"], "--token-budget: smaller than one row"),
    # 6: tracebacks before
    (["--mc-k", "0"], "--mc-k: must be >= 1, got 0"),
    (["--minibatch", "0"], "--minibatch: must be >= 1, got 0"),
    (["--micro-batch", "0"], "--micro-batch: must be >= 1, got 0"),
    (["--lr", "-1"], "--lr: must be > 0 and finite, got -1"),
    (["--lr", "nan"], "--lr: must be > 0 and finite, got nan"),
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
    # 7: misleading messages before
    (["--temperature", "0"], "--temperature: must be > 0 and finite (the update divides the logits by it), got 0"),
    (["--prompts-per-iter", "0"], "--prompts-per-iter: must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
])
def test_bad_setting_is_refused_before_any_model_loads(capsys, tmp_path, flags, message):
    err = _fails(capsys, ["train", "--model", NO_MODEL, "--out", str(tmp_path / "run"), *flags])
    assert err.startswith(f"vineppo train: error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_resume_with_fewer_iterations_than_done_is_refused(run, capsys):
    err = _fails(capsys, ["train", "--resume", str(run), "--iterations", "1"])
    assert "--iterations 1: the run in" in err and "already done 2 iterations" in err


@pytest.mark.parametrize("key", ["kl_coef", "lr"])
def test_yaml_numbers_like_1e_4_are_numbers(tmp_path, key):
    path = tmp_path / "config.yaml"
    path.write_text(f"{key}: 1e-4\n")  # PyYAML reads this as the string '1e-4'
    value = getattr(configs.resolve(configs.load_preset(str(path)), {}), key)
    assert type(value) is float and value == 1e-4


@pytest.mark.parametrize("text,message", [
    ("kl_coef: [1, 2]\n", "kl_coef: expected a number, got [1, 2]"),
    ("iterations: {a: 1}\n", "iterations: expected a number, got {'a': 1}"),
    ("mc_k: 2.5\n", "mc_k: expected a whole number, got 2.5"),
    ("lr: -1.0e-6\n", "lr: must be > 0 and finite, got -1e-06"),
    ("algos: {ppo: {lr: fast}}\n", "algos: ppo: lr: expected a number, got 'fast'"),
])
def test_bad_value_in_a_config_file_names_file_and_key(tmp_path, capsys, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    err = _fails(capsys, ["train", "--config", str(path), "--algo", "ppo", "--model", NO_MODEL])
    assert err == f"vineppo train: error: {path}: {message}"


# ------------------------------------------------------------------ 5. prompts that do not fit the model


@pytest.mark.parametrize("context,max_new,message", [
    (16, 8, "the model's context is 16"),
    (None, 1000, "with --max-new-tokens 1000 it exceeds the model's context (1024)"),
])
def test_prompt_too_long_for_the_context_is_refused(tiny_sft, tmp_path, context, max_new, message):
    model = tmp_path / "sft"
    shutil.copytree(tiny_sft, model)
    if context:
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": context}))
    with pytest.raises(UserError, match="training problem 'arith-train-") as e:
        train(_cfg(model, tmp_path / "run", iterations=1, max_new_tokens=max_new))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ 6. files, folders and disks


def test_truncated_model_weights_are_a_one_line_error(tiny_sft, tmp_path, capsys):
    model = tmp_path / "sft"
    shutil.copytree(tiny_sft, model)
    os.truncate(model / "model.safetensors", (model / "model.safetensors").stat().st_size // 2)
    err = _fails(capsys, ["eval", "--model", str(model), "--limit", "1", "--out", str(tmp_path / "e.jsonl")])
    assert f"cannot load model {model}: its weights are damaged or truncated" in err


def test_out_that_is_a_file_is_refused_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = _fails(capsys, ["train", "--model", NO_MODEL, "--out", str(tmp_path / "file")])
    assert f"--out {tmp_path / 'file'}: cannot write there" in err


def test_read_only_out_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    def read_only(self, *a, **k):  # tests run as root, for whom chmod does not make a folder read-only
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    err = _fails(capsys, ["train", "--model", NO_MODEL, "--out", str(tmp_path / "ro" / "run")])
    assert err.endswith("cannot write there (permission denied)")


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),
])
def test_full_disk_while_saving_a_checkpoint_loses_nothing(run, monkeypatch, failure):
    before = load_file(run / "checkpoints" / "iter-000002" / "model.safetensors")

    def full(*a, **k):
        raise failure

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError, match="cannot save checkpoint iter-000003") as e:
        train(_resumed(run, 3), resume=run)
    assert "nothing was lost: the previous checkpoint" in str(e.value) and "\n" not in str(e.value)
    assert "the disk is full" in str(e.value) or "is the disk full?" in str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000001", "iter-000002", "latest"]
    after = load_file(run / "checkpoints" / "iter-000002" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("code,why", [(errno.ENOSPC, "the disk is full"), (errno.EACCES, "permission denied")])
def test_summary_that_cannot_be_written_is_one_line_and_keeps_the_checkpoints(run, monkeypatch, code, why):
    from pathlib import Path

    real = Path.write_text

    def failing(self, *a, **k):
        if "summary.json" in self.name:
            raise OSError(code, os.strerror(code), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", failing)
    with pytest.raises(UserError, match=f"summary.json: {why}; nothing was lost: the checkpoints in") as e:
        train(_resumed(run, 2), resume=run)  # nothing left to train: only the summary is written
    assert "\n" not in str(e.value) and not list(run.glob(".summary*"))


def test_full_disk_while_logging_metrics_is_one_line_that_says_how_to_resume(run, monkeypatch):
    from pathlib import Path

    real = Path.open

    def failing(self, mode="r", *a, **k):
        if self.name == "metrics.jsonl" and mode == "a":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, mode, *a, **k)

    monkeypatch.setattr(Path, "open", failing)
    with pytest.raises(UserError, match="the disk is full; the checkpoints in") as e:
        train(_resumed(run, 3), resume=run)
    assert f"--resume {run} continues from iter-000002" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ 7. misleading messages


def test_gsm8k_with_data_but_no_eval_data_names_eval_data(tmp_path, capsys, monkeypatch):
    import vineppo.tasks.data as data_mod

    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(data_mod, "reachable", lambda *a, **k: False, raising=False)
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n' * 20)
    monkeypatch.chdir(tmp_path)  # the default run folder, runs/<name>, is made here
    err = _fails(capsys, ["train", "--task", "gsm8k", "--data", str(path), "--model", NO_MODEL])
    assert "cannot reach huggingface.co" in err and "--eval-data PATH" in err and "with --data" not in err
    assert not (tmp_path / "runs").exists()  # the failed run leaves neither its folder nor runs/


def test_resume_of_a_run_without_checkpoint_says_what_to_do(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    configs.save(_cfg(NO_MODEL, out), out / "config.yaml")  # killed before its first checkpoint
    err = _fails(capsys, ["train", "--resume", str(out)])
    assert "no checkpoint" in err and f"--out {out} to restart it" in err


def test_a_run_without_checkpoint_restarts_in_its_folder(tiny_sft, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    configs.save(_cfg(tiny_sft, out), out / "config.yaml")
    (out / "metrics.jsonl").write_text('{"iteration": 1, "stale": true}\n')
    summary = train(_cfg(tiny_sft, out, iterations=1))
    assert summary["iterations"] == 1
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][0].get("stale") is None
    assert configs.load(out / "config.yaml").iterations == 1


# ------------------------------------------------------------------ 8. slow or late failures


def test_hub_model_without_network_fails_fast(monkeypatch, tmp_path):
    import vineppo.models.causal_lm as models_mod

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(models_mod, "reachable", lambda *a, **k: False, raising=False)
    with pytest.raises(UserError, match="not in the local cache and huggingface.co cannot be reached") as e:
        load_model("vineppo-test-org/no-such-model-123")
    assert "\n" not in str(e.value)


def test_truncated_latest_checkpoint_falls_back_to_the_older_one(run, capsys):
    weights = run / "checkpoints" / "iter-000002" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    summary = train(_resumed(run, 3), resume=run)
    err = capsys.readouterr().err
    assert "checkpoint" in err and "iter-000002 is damaged (model.safetensors is truncated)" in err
    assert summary["iterations"] == 3 and _iterations(run) == [1, 2, 3]


def test_damaged_checkpoint_files_are_found_without_loading(run):
    from vineppo.training import runs

    ckpt = run / "checkpoints" / "iter-000002"
    assert runs.damage(ckpt) is None
    os.truncate(ckpt / "optimizer.pt", 1000)
    assert runs.damage(ckpt) == "optimizer.pt is missing or truncated"
    (ckpt / "state.json").write_text("{")
    assert runs.damage(ckpt).startswith("Expecting")


def test_a_weights_only_checkpoint_evaluates_and_refuses_a_resume(tiny_sft, tmp_path, capsys):
    """--save-weights-only true: the model files and tokenizer, no optimiser state; intact for eval and export, and a
    resume says in one line why it cannot go on from it."""
    from vineppo.training import runs

    out = tmp_path / "light"
    train(_cfg(tiny_sft, out, iterations=1, save_weights_only=True))
    ckpt = out / "checkpoints" / "iter-000001"
    assert not (ckpt / "optimizer.pt").exists() and json.loads((ckpt / "state.json").read_text())["weights_only"]
    assert runs.damage(ckpt) is None
    capsys.readouterr()  # the run's own lines
    line = _fails(capsys, ["train", "--resume", str(out), "--iterations", "2"])
    assert "iter-000001 holds the weights alone" in line and "--save-weights-only true" in line
    code, out_text, _ = _cli(capsys, ["eval", "--model", str(ckpt), "--samples", "0", "--limit", "2", "--json"])
    assert code == 0 and json.loads(out_text)["problems"] == 2


def test_data_is_read_before_the_model_loads(tmp_path, capsys):
    err = _fails(capsys, ["train", "--task", "gsm8k", "--data", str(tmp_path / "missing.jsonl"), "--model", NO_MODEL])
    assert f"{tmp_path / 'missing.jsonl'}: no such file" in err


# ------------------------------------------------------------------ the other commands check their flags first


@pytest.mark.parametrize("argv,message", [
    (["sft", "--model", NO_MODEL, "--lr", "-1"], "--lr: must be > 0 and finite, got -1"),
    (["sft", "--model", NO_MODEL, "--warmup", "1.5"], "--warmup: must be >= 0 and < 1, got 1.5"),
    (["eval", "--model", NO_MODEL, "--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
    (["eval", "--model", NO_MODEL, "--temperature", "-1"], "--temperature: must be >= 0 and finite, got -1"),
    (["eval", "--model", NO_MODEL, "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["analyze-values", "--model", NO_MODEL, "--token-budget", "10"], "--token-budget: smaller than one row"),
])
def test_other_commands_check_flags_before_any_model_loads(capsys, argv, message):
    assert _fails(capsys, argv).startswith(f"vineppo {argv[0]}: error: {message}")


def test_eval_out_that_cannot_be_written_fails_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = _fails(capsys, ["eval", "--model", NO_MODEL, "--limit", "1", "--out", str(tmp_path / "file" / "e.jsonl")])
    assert "cannot write there" in err


def test_compare_checks_the_training_flags_first(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text(f"model: {NO_MODEL}\n")
    err = _fails(capsys, ["compare", "--algos", "grpo", "--seeds", "1", "--config", str(preset),
                          "--out", str(tmp_path / "cmp"), "--train-args", "--lr -1"])
    assert "--lr: must be > 0 and finite, got -1" in err
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    """`vineppo COMMAND --help` lists its flags and exits 0 (a `%` in a field comment once crashed train's)."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert "--" in capsys.readouterr().out
