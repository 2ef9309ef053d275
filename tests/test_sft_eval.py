"""SFT and eval on tiny models (Llama, GPT-2, Qwen2 configs built locally; nothing downloaded)."""

import json

import pytest
import torch

from vineppo import cli
from vineppo.errors import UserError
from vineppo.evaluate import evaluate, first_error_step
from vineppo.models import load_model
from vineppo.sft import ensure_sft_model, run_sft
from vineppo.tasks import Example, Task, get_task, register
from vineppo.tasks.arith import load_arith

ARITH = get_task("arith")
MINI = register(Task(name="arith-mini", grade=ARITH.grade, split_steps=ARITH.split_steps,
                     load=lambda split, path=None, seed=0: load_arith(split, path, seed, size=256 if split == "train" else 6)))
EMPTY = register(Task(name="arith-empty", grade=ARITH.grade, split_steps=ARITH.split_steps,
                      load=lambda split, path=None, seed=0: []))
SIZE = dict(hidden=32, layers=2)

pytestmark = pytest.mark.usefixtures("one_thread")



def sft(out, arch="llama", steps=6, seed=0, **kw):
    return run_sft("arith-mini", out=out, arch=arch, max_steps=steps, batch_size=16, seed=seed, device="cpu",
                   log_every=1, progress=False, **SIZE, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return sft(tmp_path_factory.mktemp("m") / "sft", steps=30)


def test_sft_lowers_loss_and_writes_atomically(tiny):
    rows = [json.loads(line) for line in (tiny / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 1.0
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    assert json.loads((tiny / "sft_config.json").read_text())["steps"] == 30
    assert ensure_sft_model("arith-mini", out=tiny) == tiny  # present: not retrained


def test_same_seed_same_model(tmp_path):
    a, _ = load_model(sft(tmp_path / "a", seed=3), verbose=False)
    b, _ = load_model(sft(tmp_path / "b", seed=3), verbose=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_evaluate_is_seeded(tiny):
    model, tok = load_model(tiny, verbose=False)
    exs = MINI.load("test", None, 0)
    r1 = evaluate(model, tok, MINI, exs, samples=3, max_new_tokens=24, seed=5)
    r2 = evaluate(model, tok, MINI, exs, samples=3, max_new_tokens=24, seed=5)
    assert r1 == r2
    assert r1["problems"] == 6 and r1["samples"] == 3 and 0 <= r1["pass@1"] <= 1 and 0 <= r1["greedy"] <= 1
    assert len(r1["results"][0]["sample_texts"]) == 3


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures_sft_and_eval(tmp_path, arch):
    out = sft(tmp_path / arch, arch=arch, steps=3)
    model, tok = load_model(out, verbose=False)
    assert model.config.model_type == arch
    res = evaluate(model, tok, MINI, MINI.load("test", None, 0)[:3], samples=2, max_new_tokens=12, seed=0)
    assert res["problems"] == 3


def test_bad_input_one_line_errors(tiny, tmp_path):
    model, tok = load_model(tiny, verbose=False)
    with pytest.raises(UserError, match="unknown task"):
        run_sft("no-such-task", out=tmp_path / "x")
    with pytest.raises(UserError, match="empty"):
        evaluate(model, tok, MINI, [])
    with pytest.raises(UserError, match="empty"):
        run_sft("arith-empty", out=tmp_path / "e", progress=False, **SIZE)
    model.config.max_position_embeddings = 20
    with pytest.raises(UserError, match="context is 20"):
        evaluate(model, tok, MINI, MINI.load("test", None, 0)[:1], samples=1)


@pytest.mark.parametrize("argv,msg", [
    (["eval", "--model", "/no/such/model-folder"], "not found"),
    (["eval", "--task", "nope"], "unknown task"),
    (["eval", "--task", "arith-empty", "--model", "x"], "empty"),
    (["sft", "--task", "nope"], "unknown task"),
])
def test_cli_prints_one_line_error(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and "Traceback" not in err


def test_cli_eval_json(tiny, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(tiny), "--task", "arith-mini", "--samples", "2", "--limit", "2",
                  "--max-new-tokens", "16", "--out", str(tmp_path / "r.jsonl"), "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"pass@1", "greedy", "lenient_pass@1", "lenient_greedy", "parsable", "greedy_parsable",
                        "problems", "samples", "prompt_format", "tokens", "tokens_per_s"} and out["problems"] == 2
    assert out["prompt_format"] == "plain"  # the tiny tokenizer has no chat template
    assert out["lenient_pass@1"] >= out["pass@1"] and 0 <= out["parsable"] <= 1
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


def test_first_error_step():
    ex = Example(id="e", problem="", solution="12 + 5 = 17\n17 * 3 = 51\n#### 51", answer="51")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 3 = 51\n#### 51") is None
    assert first_error_step(ex, " 12 + 5 = 18\n18 * 3 = 54\n#### 54") == (0, "arithmetic +")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 4 = 68\n#### 68") == (1, "operand")
    assert first_error_step(ex, " 12 + 5 = 17\n17 - 3 = 14\n#### 14") == (1, "operator")
    assert first_error_step(ex, " 12 + 5 = 17\n#### 17") == (1, "stopped early")
    assert first_error_step(ex, " 12 + 5 = 17\n17 * 3 = 51\n#### 50") == (2, "answer")
