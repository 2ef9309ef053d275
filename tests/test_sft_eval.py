"""SFT and eval on tiny models (Llama, GPT-2, Qwen2 configs built locally; nothing downloaded)."""

import dataclasses
import json
import os
import subprocess
import types

import pytest
import torch

from vineppo import cli
from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.engine import Engine
from vineppo.models.causal_lm import load_model
from vineppo.tasks import Example, Task, get_task, register
from vineppo.tasks.arith import load_arith
from vineppo.training.evaluation import EvalSettings, evaluate, first_error_step, majority_vote
from vineppo.training.sft import Muon, SFTConfig, ensure_sft_model, make_optimizers, newton_schulz, run_sft

ARITH = get_task("arith")
MINI = register(Task(name="arith-mini", grade=ARITH.grade, split_steps=ARITH.split_steps, extract=ARITH.extract,
                     load=lambda split, path=None, seed=0: load_arith(split, path, seed, size=256 if split == "train" else 6)))
EMPTY = register(Task(name="arith-empty", grade=ARITH.grade, split_steps=ARITH.split_steps,
                      load=lambda split, path=None, seed=0: []))
SIZE = dict(hidden=32, layers=2)

pytestmark = pytest.mark.usefixtures("one_thread")



def sft(out, arch="llama", steps=6, seed=0, **kw):
    return run_sft(SFTConfig("arith-mini", out=out, arch=arch, max_steps=steps, batch_size=16, seed=seed,
                             device="cpu", log_every=1, progress=False, **SIZE, **kw))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return sft(tmp_path_factory.mktemp("m") / "sft", steps=30)


def test_sft_lowers_loss_and_writes_atomically(tiny):
    rows = [json.loads(line) for line in (tiny / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    # Muon (the default) steps at AdamW's steady-state size (0.2 lr per entry), so on this 32-wide model it starts
    # slower than AdamW: 6.18 -> 5.71 in 30 steps (AdamW 6.18 -> 3.57, the optimizer test below)
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 0.3
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    assert json.loads((tiny / "sft_config.json").read_text())["steps"] == 30
    assert ensure_sft_model("arith-mini", out=tiny) == tiny  # present: not retrained


def test_same_seed_same_model(tmp_path):
    a, _ = load_model(sft(tmp_path / "a", seed=3), verbose=False)
    b, _ = load_model(sft(tmp_path / "b", seed=3), verbose=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest(tiny):
    model, _ = load_model(tiny, verbose=False)
    muon, adamw = make_optimizers(model, "muon", 1e-3)
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    matrices = [p for g in muon.param_groups for p in g["params"]]
    rest = [p for g in adamw.param_groups for p in g["params"]]
    assert matrices and rest and all(p.ndim == 2 for p in matrices) and all(p.ndim != 2 for p in rest)
    assert {id(p) for p in matrices + rest} == {id(p) for p in model.parameters()}  # each parameter once
    assert len(matrices) + len(rest) == len(list(model.parameters()))
    (only,) = make_optimizers(model, "adamw", 1e-3)
    assert type(only) is torch.optim.AdamW


def test_the_optimizer_flag_changes_the_training_and_is_recorded(tiny, tmp_path):
    adamw = sft(tmp_path / "adamw", steps=30, optimizer="adamw")
    assert json.loads((adamw / "sft_config.json").read_text())["optimizer"] == "adamw"
    assert json.loads((tiny / "sft_config.json").read_text())["optimizer"] == "muon"  # the tiny model's default
    a, _ = load_model(adamw, verbose=False)
    b, _ = load_model(tiny, verbose=False)
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    rows = [json.loads(line) for line in (adamw / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 2.0  # it trains


def test_muon_steps_as_torch_muon_does_but_in_float32_on_cpu():
    """The same step as torch.optim.Muon (match_rms_adamw), whose Newton-Schulz runs in bfloat16: equal to bf16's
    precision; and the orthogonalisation itself is float32 on a CPU (bf16 matmuls are ~40x slower there)."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(48, 96, bias=False), torch.nn.Linear(48, 96, bias=False)
    theirs.load_state_dict(ours.state_dict())
    a = Muon(ours.parameters(), lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs.parameters(), lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    start = ours.weight.detach().clone()
    for _ in range(3):
        x = torch.randn(256, 48)  # full-rank gradients: bf16's rounding in a null space would grow in Newton-Schulz
        for net, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    ours_step, theirs_step = ours.weight.detach() - start, theirs.weight.detach() - start
    assert (ours_step - theirs_step).norm() < 0.03 * theirs_step.norm()  # measured 0.8% (bf16's rounding)
    assert newton_schulz(torch.randn(96, 48)).dtype == torch.float32
    s = torch.linalg.svdvals(newton_schulz(torch.randn(96, 48)))
    assert 0.5 < s.min() and s.max() < 1.5  # nearly orthogonal, as the quintic iteration promises


def test_evaluate_is_seeded(tiny):
    model, tok = load_model(tiny, verbose=False)
    exs = MINI.load("test", None, 0)
    r1 = evaluate(Engine(model, tok), MINI, exs, EvalSettings(samples=3, max_new_tokens=24, seed=5))
    r2 = evaluate(Engine(model, tok), MINI, exs, EvalSettings(samples=3, max_new_tokens=24, seed=5))
    assert r1 == r2
    assert r1["problems"] == 6 and r1["samples"] == 3 and 0 <= r1["pass@1"] <= 1 and 0 <= r1["greedy"] <= 1
    assert len(r1["results"][0]["sample_texts"]) == 3


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures_sft_and_eval(tmp_path, arch):
    out = sft(tmp_path / arch, arch=arch, steps=3)
    model, tok = load_model(out, verbose=False)
    assert model.config.model_type == arch
    res = evaluate(Engine(model, tok), MINI, MINI.load("test", None, 0)[:3],
                   EvalSettings(samples=2, max_new_tokens=12, seed=0))
    assert res["problems"] == 3


def test_bad_input_one_line_errors(tiny, tmp_path):
    model, tok = load_model(tiny, verbose=False)
    with pytest.raises(UserError, match="unknown task"):
        run_sft(SFTConfig("no-such-task", out=tmp_path / "x"))
    with pytest.raises(UserError, match="empty"):
        evaluate(Engine(model, tok), MINI, [])
    with pytest.raises(UserError, match="empty"):
        run_sft(SFTConfig("arith-empty", out=tmp_path / "e", progress=False, **SIZE))
    with pytest.raises(UserError, match="optimizer.*must be one of muon, adamw"):
        run_sft(SFTConfig("arith-mini", out=tmp_path / "o", optimizer="sgd"))
    model.config.max_position_embeddings = 20
    with pytest.raises(UserError, match="context is 20"):
        evaluate(Engine(model, tok), MINI, MINI.load("test", None, 0)[:1], EvalSettings(samples=1))


@pytest.mark.parametrize("argv,msg", [
    (["eval", "--model", "/no/such/model-folder"], "not found"),
    (["eval", "--task", "nope"], "unknown task"),
    (["eval", "--task", "arith-empty", "--model", "x"], "empty"),
    (["sft", "--task", "nope"], "unknown task"),
    (["sft", "--optimizer", "sgd"], "--optimizer: must be one of muon, adamw"),
])
def test_cli_prints_one_line_error(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["eval", "analyze-values"])
def test_a_missing_model_leaves_no_output_folder_behind(capsys, tmp_path, monkeypatch, command):
    """The default output folder (runs/<name>) is made before the model loads; a failed load removes it, and
    runs/ too when the command made it (the test suite left an empty runs/ in the checkout)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli.main([command, "--model", "/no/such/model-folder"])
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "kept").mkdir(parents=True)  # a runs/ that holds other runs stays
    with pytest.raises(SystemExit):
        cli.main([command, "--model", "/no/such/model-folder"])
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["kept"]



def test_cli_eval_json(tiny, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(tiny), "--task", "arith-mini", "--samples", "2", "--limit", "2",
                  "--max-new-tokens", "16", "--out", str(tmp_path / "r.jsonl"), "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"pass@1", "greedy", "pass@k", "maj@k", "lenient_pass@1", "lenient_greedy", "parsable",
                        "greedy_parsable", "reward", "problems", "samples", "prompt_format", "tokens", "tokens_per_s"}
    assert out["problems"] == 2 and out["reward"] == out["pass@1"]  # a 0/1 reward: its mean is pass@1
    assert out["prompt_format"] == "plain"  # the tiny tokenizer has no chat template
    assert out["lenient_pass@1"] >= out["pass@1"] and 0 <= out["parsable"] <= 1
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


def test_cli_eval_outside_a_terminal_prints_its_progress(tiny, capsys, tmp_path, monkeypatch):
    from vineppo.core import tracking

    monkeypatch.setattr(tracking, "PROGRESS_EVERY", 0.0)  # a line at every report (the default: every 10 s)
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(tiny), "--task", "arith-mini", "--samples", "2", "--limit", "2",
                  "--max-new-tokens", "16", "--out", str(tmp_path / "r.jsonl"), "--json"])
    assert e.value.code == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("eval: ")]
    assert lines and lines[-1].startswith("eval: 6/6 samples, ") and lines[-1].endswith("tokens/s")


def test_pass_at_k_and_majority_vote():
    """pass@k: any sample right; maj@k: the mark of the most common extracted answer, the first-seen on ties."""
    S = lambda text: types.SimpleNamespace(text=text)
    texts = ["#### 7", "#### 8", "no answer", "#### 8", "#### 7"]
    marks = [1.0, 0.0, 0.0, 0.0, 1.0]
    assert majority_vote(ARITH, [S(t) for t in texts], marks) == 1.0  # 7 and 8 tie at two votes: 7 came first
    assert majority_vote(ARITH, [S(t) for t in texts[1:]], marks[1:]) == 0.0  # 8 first, then tied
    assert majority_vote(ARITH, [S(t) for t in texts + ["#### 8"]], marks + [0.0]) == 0.0  # 8 wins outright
    assert majority_vote(ARITH, [S("none")], [0.0]) == 0.0 and majority_vote(ARITH, [], []) is None
    assert majority_vote(dataclasses.replace(ARITH, extract=None), [S("#### 7")], [1.0]) is None


def test_eval_reports_pass_at_k_and_majority_from_its_samples(tiny_sft):
    model, tok = load_model(tiny_sft, verbose=False)
    res = evaluate(Engine(model, tok), ARITH, ARITH.load("test", None, 0)[:8], EvalSettings(samples=4, seed=1))
    rows = res["results"]
    assert [r["pass@k"] for r in rows] == [float(r["correct"] > 0) for r in rows]
    assert res["pass@k"] == sum(r["pass@k"] for r in rows) / len(rows) >= res["pass@1"]
    assert res["maj@k"] == sum(r["maj@k"] for r in rows) / len(rows)


def test_first_error_step():
    ex = Example(id="e", problem="", solution="12 + 5 = 17\n17 * 3 = 51\n#### 51", answer="51")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 3 = 51\n#### 51") is None
    assert first_error_step(ex, " 12 + 5 = 18\n18 * 3 = 54\n#### 54") == (0, "arithmetic +")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 4 = 68\n#### 68") == (1, "operand")
    assert first_error_step(ex, " 12 + 5 = 17\n17 - 3 = 14\n#### 14") == (1, "operator")
    assert first_error_step(ex, " 12 + 5 = 17\n#### 17") == (1, "stopped early")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 3 = 51\n#### 50") == (2, "answer")


def test_eval_records_finish_reason_and_parsable(tiny_sft):
    model, tok = load_model(tiny_sft, verbose=False)
    exs = ARITH.load("test", None, 0)[:6]
    too_short = EvalSettings(samples=2, max_new_tokens=3, seed=1)  # too short for any answer line
    cut = evaluate(Engine(model, tok), ARITH, exs, too_short)
    for row in cut["results"]:
        assert row["sample_finish"] == ["length", "length"] and row["greedy_finish"] == "length"
    assert cut["parsable"] == 0.0
    res = evaluate(Engine(model, tok), ARITH, exs, EvalSettings(samples=3, max_new_tokens=64, seed=1))
    reasons = [f for row in res["results"] for f in row["sample_finish"] + [row["greedy_finish"]]]
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons
    for row in res["results"]:
        assert len(row["sample_finish"]) == 3
        assert all(not ok for ok, f in zip(row["sample_correct"], row["sample_finish"]) if f == "length")
    texts = [t for row in res["results"] for t in row["sample_texts"] + [row["greedy_text"]]]
    assert res["parsable"] == sum(ARITH.extract(t) is not None for t in texts) / len(texts) > 0


def test_strict_extractors():
    from vineppo.core.grading import extract_gsm8k, extract_math

    assert extract_gsm8k("12 + 3 = 15\n#### 15") == "15" and extract_gsm8k("#### $1,000.") == "$1,000."
    assert extract_gsm8k("#### 2\n#### fifteen") is None and extract_gsm8k("15") is None
    assert extract_math("so $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert extract_math("\\boxed{}") is None and extract_math("\\boxed{3") is None and extract_math("3") is None
    assert get_task("gsm8k").extract is extract_gsm8k and get_task("math").extract is extract_math


def test_generators_on_model_device(tiny, monkeypatch):
    """evaluate samples with generators made on the model's device (a CPU generator would send GPU
    probabilities to the host every step)."""
    from vineppo.engine import Engine

    model, tok = load_model(tiny, verbose=False)
    made, used, real_generator, real_generate = [], [], torch.Generator, Engine.generate

    def spy(*args, **kw):
        made.append(kw.get("device", args[0] if args else None))
        return real_generator(*args, **kw)

    def generate(self, prompts, n, params, generator=None, progress=None, examples=None):
        used.append(generator.device)
        return real_generate(self, prompts, n, params, generator, progress, examples=examples)

    monkeypatch.setattr(torch, "Generator", spy)
    monkeypatch.setattr(Engine, "generate", generate)
    evaluate(Engine(model, tok), MINI, MINI.load("test", None, 0)[:2], EvalSettings(samples=2, max_new_tokens=8))
    assert len(made) == 2 and all(d is not None and torch.device(d) == model.device for d in made), \
        f"generators made with device={made}, not the model's {model.device}"
    assert used == [model.device] * 2


def test_sft_help_states_current_defaults(capsys):
    import re

    from vineppo.training.sft import PRETRAINED_DEFAULTS, TINY_DEFAULTS

    with pytest.raises(SystemExit):
        cli.main(["sft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, key in (("--epochs", "epochs"), ("--lr", "lr"), ("--batch-size", "batch_size"), ("--warmup", "warmup")):
        m = re.search(re.escape(flag) + r" [A-Z_]+ [^()]*\(tiny: ([^,]+), pretrained: ([^)]+)\)", text)
        assert m, f"{flag}: no defaults in the help text"
        assert (float(m[1]), float(m[2])) == (TINY_DEFAULTS[key], PRETRAINED_DEFAULTS[key]), flag


def test_sft_prints_progress_lines_when_output_is_not_a_terminal(tmp_path, capsys):
    run_sft(SFTConfig("arith-mini", out=tmp_path / "m", max_steps=40, batch_size=16, device="cpu", progress=True, **SIZE))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("sft: step")]
    assert len(lines) == 20 and lines[-1].startswith("sft: step 40/40 (100%)")
    assert "tok/s" in lines[0] and "left" in lines[0]


def test_sft_removes_the_temp_folder_a_killed_run_left(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs, as after a SIGKILL
    stale, live = tmp_path / f".m.tmp-{dead.pid}", tmp_path / f".m.tmp-{os.getppid()}"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    sft(tmp_path / "m", steps=2)
    assert not stale.exists() and live.exists()  # a running process's folder is left alone


@pytest.mark.parametrize("seed", [0, 1])
def test_eval_scores_the_problems_a_run_evaluated_whatever_its_sampling_seed(tiny, tmp_path, seed):
    # --seed is the sampling's; the generated test set comes from --data-seed (0), as in a run's in-run evaluation
    from vineppo.training.run import load_data

    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(tiny), "--task", "arith", "--samples", "1", "--limit", "4", "--seed",
                  str(seed), "--max-new-tokens", "8", "--out", str(tmp_path / "r.jsonl"), "--json"])
    assert e.value.code == 0
    scored = [(r["id"], r["answer"]) for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())]
    in_run = load_data(configs.TrainConfig(seed=seed, eval_problems=4), get_task("arith")).test
    assert scored == [(ex.id, ex.answer) for ex in in_run]


BREAKS_ON = '''
class Once:
    """Ends the game after the model's first turn with reward 1; its step raises on the row whose `answer` is "boom"."""

    deterministic = True

    def reset(self, row):
        self.row = row
        return ""

    def step(self, text):
        if self.row["answer"] == "boom":
            raise ValueError("the board is gone")
        return "", True, 1.0
'''


def test_eval_writes_the_samples_finished_before_an_environments_fault_and_the_answer_column(tiny_sft, tmp_path,
                                                                                               capsys):
    """An environment that raises on the third row: the first two rows' samples are written to --out (their `answer`
    column recorded), then eval stops with the row's id. Before, every finished sample was lost."""
    problems = ARITH.load("test", "premature=0", 0)[:4]
    rows = [{"prompt": ARITH.prompt(ex), "answer": a} for ex, a in zip(problems, ("5", "7", "boom", "9"))]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "game.py").write_text(BREAKS_ON)
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(tiny_sft), "--task", "custom", "--data", str(tmp_path / "d.jsonl"), "--env",
                  f"{tmp_path / 'game.py'}:Once", "--samples", "2", "--max-new-tokens", "96", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "d.jsonl:3: the environment's step raised ValueError: the board is gone" in err
    assert f"the 4 samples finished before it are in {out}" in err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"].rsplit(":", 1)[1], r["answer"], r["samples"], r["greedy_text"]) for r in written] == [
        ("1", "5", 2, None), ("2", "7", 2, None)]
    assert all(r["sample_reward"] == [1.0, 1.0] for r in written)
