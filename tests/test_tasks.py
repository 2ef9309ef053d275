"""Task loading: the registry, GSM8K/MATH files, validation carving, strict JSONL errors, offline hub, inspect-data."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vineppo import cli
from vineppo.core.errors import UserError
from vineppo.tasks import DEFAULT_PROMPT, get_task
from vineppo.tasks import data as data_mod
from vineppo.tasks.arith import load_arith

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _path(rel: str) -> str:
    path = DATA / rel
    if not path.exists():
        pytest.skip(f"shared data {path} not present")
    return str(path)


def test_registry_and_prompt():
    for name in ("arith", "gsm8k", "math"):
        assert get_task(name).name == name
    with pytest.raises(UserError, match="known tasks"):
        get_task("nope")
    task = get_task("gsm8k")
    ex = task.load("test", _path("gsm8k/test.jsonl"), 0)[0]
    assert task.prompt(ex) == DEFAULT_PROMPT.format(problem=ex.problem) == f"Problem:\n{ex.problem}\n\nSolution:"


def test_gsm8k_test_file():
    examples = get_task("gsm8k").load("test", _path("gsm8k/test.jsonl"), 0)
    assert len(examples) == 1319
    ex = examples[0]
    assert ex.id == "gsm8k-test-0" and ex.answer == "18"
    assert "<<" not in ex.solution and ex.solution.endswith("#### 18")
    assert ex.solution.startswith("Janet sells 16 - 3 - 4 = 9 duck eggs a day.")
    assert all("<<" not in e.solution and e.solution.rsplit("####", 1)[1].strip() == e.answer for e in examples)
    assert len({e.id for e in examples}) == len(examples)


def test_gsm8k_validation_carved_from_train():
    path = _path("gsm8k/train.jsonl")
    load = get_task("gsm8k").load
    train, val = load("train", path, 0), load("validation", path, 1)
    assert len(val) == 500 and len(train) == 7473 - 500
    assert not {e.id for e in train} & {e.id for e in val}
    assert [e.id for e in load("validation", path, 7)] == [e.id for e in val]  # fixed, whatever the run seed


def test_math_files():
    load = get_task("math").load
    m500 = load("test", _path("math500/test.jsonl"), 0)
    assert len(m500) == 500 and m500[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    full = load("test", _path("math/test.jsonl"), 0)  # no `answer` field: the last \boxed{} of the solution
    assert len(full) == 5000 and all(e.answer for e in full)
    by_problem = {e.problem: e.answer for e in full}
    assert sum(by_problem.get(e.problem) == e.answer for e in m500) >= 495


def test_arith_seeds_and_splits():
    task = get_task("arith")
    a, b = load_arith("test", None, 0, size=200), load_arith("test", None, 0, size=200)
    assert a == b
    assert [e.problem for e in load_arith("test", None, 1, size=200)] != [e.problem for e in a]
    train = load_arith("train", None, 0, size=2000)
    val = load_arith("validation", None, 0, size=200)
    problems = [{e.problem for e in s} for s in (train, val, a)]
    assert not (problems[0] & problems[1] or problems[0] & problems[2] or problems[1] & problems[2])
    clean = [load_arith(split, "premature=0", 0, size=200) for split in ("train", "validation", "test")]
    assert all(task.grade(task.target(e), e.answer) == 1.0 for e in sum(clean, []))


@pytest.mark.parametrize("content,match", [
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": \n', r":2: malformed JSON"),
    ('{"question": "q", "answer": "#### 1"}\n{"answer": "#### 2"}\n', r":2: missing field 'question'"),
    ('{"question": "q", "answer": 5}\n', r":1: field 'answer' must be a string"),
    ('{"question": "q", "answer": "no final line"}\n', r":1: field 'answer' has no final"),
    ('[1, 2]\n', r":1: expected a JSON object"),
    ('{"question": "q", "answer": "#### 1"}\n\n{"question": "q", "answer": "#### 1"}\n', r":2: blank line"),
    ("", r"empty file"),
])
def test_jsonl_errors_name_file_line_field(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=match) as err:
        get_task("gsm8k").load("test", str(path), 0)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_math_jsonl_errors(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"problem": "p", "solution": "no box here"}\n')
    with pytest.raises(UserError, match=r"m.jsonl:1: field 'solution' has no \\boxed"):
        get_task("math").load("test", str(path), 0)
    with pytest.raises(UserError, match="no such file"):
        get_task("math").load("test", str(tmp_path / "missing.jsonl"), 0)


def test_unreachable_hub_fails_fast(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(data_mod, "reachable", lambda *a, **k: False)
    with pytest.raises(UserError, match="--data PATH") as err:
        get_task("gsm8k").load("test", None, 0)
    assert "\n" not in str(err.value)


def test_offline_hub_fails_fast_with_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vineppo", "inspect-data", "--task", "math", "--json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data PATH" in lines[0] and "HuggingFaceH4/MATH-500" in lines[0]


def test_inspect_data_json_end_to_end(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect-data", "--task", "gsm8k", "--data", _path("gsm8k/test.jsonl"), "--json"])
    assert done.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 1319 and report["reference_correct"] == 1.0
    assert report["steps"]["max"] >= report["steps"]["median"] >= 1 and isinstance(report["steps"]["max"], int)


def test_inspect_data_rich_output_and_user_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect-data", "--task", "math", "--data", _path("math500/test.jsonl"), "--examples", "1"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "references graded correct" in out and "[asy]" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect-data", "--task", "gsm8k", "--data", str(bad)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: malformed JSON" in err and "Traceback" not in err


def test_arith_knobs_through_data_flag():
    from vineppo.core.errors import UserError
    from vineppo.tasks.arith import chain_of, load_arith

    hard = load_arith("test", "min_ops=5,max_ops=6,digits=3", size=50)
    assert all(5 <= len(chain_of(ex.problem).ops) <= 6 for ex in hard)
    assert max(int(n) for ex in hard for n in ex.problem.replace(".", " ").split() if n.isdigit()) >= 100
    easy = load_arith("test", size=50)
    assert all(2 <= len(chain_of(ex.problem).ops) <= 4 for ex in easy)
    clean = load_arith("test", "premature=0", size=50)  # every reference careful: a line per operation
    assert all(len(ex.solution.splitlines()) - 1 == len(chain_of(ex.problem).ops) for ex in clean)
    with pytest.raises(UserError, match="knobs"):
        load_arith("test", "digits=big")


def test_arith_test_size_knob_extends_the_default_test_set():
    from vineppo.tasks.arith import load_arith

    default = load_arith("test")
    larger = load_arith("test", "test_size=1200")
    assert len(default) == 500 and len(larger) == 1200
    assert [ex.problem for ex in larger[:500]] == [ex.problem for ex in default]
    assert len(load_arith("train", "test_size=1200", size=30)) == 30  # the other splits keep their sizes
