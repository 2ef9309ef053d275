"""`custom`: a user's own task from a data set, reward functions in TRL's form and a step splitter; no code here.

**Data** (`--data`, `--eval-data`): a JSONL, JSON (an array of objects), CSV or Parquet file; a Hugging Face Hub
data set `hub:NAME[:CONFIG]`, read by `datasets` (its `train` split for training and validation, the split
asked for otherwise: `--eval-split`, `--split`); or, from Python, a list of dicts or a `datasets.Dataset`. As
for gsm8k, `test` is a whole source and `train`/`validation` are carved from it with a fixed seed.

**Prompt**: the column `--prompt-column` (default `prompt`) holds text, or chat turns (a list of `{role,
content}`), rendered with the tokenizer's chat template (`chat`); `auto` renders text as one user turn of the
chat template too where the tokenizer has one and the model records no format of its own; without
that column, a `messages` column is the prompt and its last assistant turn, if any, the reference completion.
`--completion-column` names the reference completion, what `vineppo sft` trains on. Every other column
reaches the reward functions as a keyword argument (vineppo.core.rewards). `--demo FILE` (`load_demo`) puts a few
worked dialogues, chat messages, before every prompt's own turns (after its system turn): the model reads them, the
reward functions' `prompts` do not hold them.

**Reward**: `--reward FILE.py:FUNCTION` or `package.module:FUNCTION`, repeatable, weighted by
`--reward-weights`; a response is solved (pass@1, pass@k) when its reward is at least `--success-threshold`.
**Steps**: `--steps` (vineppo.core.steps; lines by default). An example's id is where it comes from (`file:line`,
`file[index]`, `hub NAME split record i`, `data[i]`; a CSV row's line is the line it starts on, the header
being line 1): the key of its row, which `score` hands to the reward functions; an example's `answer` is its
`answer` column as text where it has one (what `vineppo eval` records), else "".
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vineppo.core.errors import UserError
from vineppo.core.rewards import ARGUMENTS, CONTEXT, Batch, RewardLog, Rewards, check_signature, load_function
from vineppo.core.steps import STEPS_HELP, make_splitter, token_steps
from vineppo.tasks.agent import FORMATS, MARKUP, AgentSpec, Markup, load_env, load_tools, trl_form, trl_tools
from vineppo.tasks.base import Example, Task, register
from vineppo.tasks.data import carve, load_hub, read_jsonl

PYTHON = "python:"  # --data python:NAME: a data set the Python API passed (vineppo.api)
NO_DATA = "task 'custom' reads its data from --data: a JSONL, JSON, CSV or Parquet file, or hub:NAME[:CONFIG]"


@dataclass(frozen=True)
class Settings:
    """The custom task's settings: the flags of the same names (TrainConfig fields for `vineppo train`)."""

    reward: tuple[str, ...] = ()  # FILE.py:FUNCTION or package.module:FUNCTION, one per function
    reward_weights: tuple[float, ...] | None = None  # one per function (None: 1 each)
    prompt_column: str = "prompt"
    completion_column: str | None = None  # the reference completion (None: none, or a `messages` column's)
    steps: str | None = None  # the step splitter (vineppo.core.steps.make_splitter; None: turns with tools or an
    # environment, else lines)
    success_threshold: float = 1.0  # reward at or above which a response counts as solved
    reward_timeout_s: float = 60.0  # time limit of one reward call, tool call or environment step (0: none)
    tools: tuple[str, ...] = ()  # FILE.py:fn1,fn2 (vineppo.tasks.agent)
    env: str | None = None  # FILE.py:Class: an environment that answers the model's turns
    max_turns: int = 4  # the model's turns per dialogue
    max_total_tokens: int = 0  # the model's tokens in all its turns of a dialogue (0: max_new_tokens x max_turns)
    max_inserted_tokens: int = 0  # tokens tools and the environment insert in a dialogue (0: the context's room)
    tool_format: str = "auto"  # template | plain | auto
    tool_markup: str = MARKUP  # OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE of the plain format
    demo: str | None = None  # a JSON or JSONL file of chat messages: worked dialogues before every prompt

    @classmethod
    def read(cls, source: Any) -> Settings:
        """The settings an object holds under these names (a TrainConfig, a command's flags); unset ones default."""
        given = {k: getattr(source, k) for k in cls.__dataclass_fields__ if getattr(source, k, None) is not None}
        if isinstance(given.get("reward"), str):
            given["reward"] = given["reward"].split(",")
        if isinstance(given.get("reward_weights"), str):
            given["reward_weights"] = given["reward_weights"].split(",")
        weights = given.get("reward_weights")
        if weights is not None:
            try:
                given["reward_weights"] = tuple(float(w) for w in weights)
            except (TypeError, ValueError):
                raise UserError(f"--reward-weights {weights!r}: expected numbers, e.g. 1,0.5") from None
        if isinstance(given.get("tools"), str):
            given["tools"] = [given["tools"]]
        settings = cls(**{**given, "reward": tuple(given.get("reward", ())), "tools": tuple(given.get("tools", ()))})
        if not math.isfinite(settings.success_threshold):
            raise UserError(f"--success-threshold: must be a finite number, got {settings.success_threshold}")
        if not settings.reward_timeout_s >= 0:
            raise UserError(f"--reward-timeout-s: must be >= 0, got {settings.reward_timeout_s}")
        return settings


@dataclass
class Row:
    """What a reward function gets of one example: its prompt and its other columns."""

    prompt: str | list[dict]  # text, or chat turns
    columns: dict[str, Any]


@dataclass(frozen=True)
class CustomTask(Task):
    """A Task whose data, reward and steps come from the user (`Settings`); `data` holds the rows it loaded."""

    settings: Settings = Settings()
    data: Data | None = None
    demo: tuple[dict, ...] = ()  # worked dialogues before every prompt's own turns (--demo)

    def configured(self, settings: Any) -> CustomTask:
        """A fresh custom task for the settings `settings` holds (vineppo.tasks.base.Task.configured)."""
        return make_task(Settings.read(settings))

    def chat_turns(self, example: Example) -> list[dict] | None:
        """The prompt's chat turns when the data gives them or a demo goes before them (a text prompt is then one
        user turn): its system turn, the demo's messages, its other turns."""
        prompt = self.data.rows[example.id].prompt
        if not self.demo:
            return prompt if isinstance(prompt, list) else None
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        system = turns[:1] if turns[0]["role"] == "system" else []
        return system + [dict(m) for m in self.demo] + turns[len(system):]

    def auto_format(self, recorded: str | None) -> str | None:
        """chat for data whose prompts are chat turns, or with a demo; for text prompts the model's recorded format,
        else None: chat when the tokenizer has a chat template (the text as one user turn), else plain (as it is)."""
        return "chat" if self.data.format == "chat" or self.demo else recorded

    def reward_log(self) -> RewardLog | None:
        """What the reward functions log (vineppo.core.rewards.RewardLog): their values per call, log_metric, log_extra."""
        self.data.functions()
        return self.data.rewards.log

    def row(self, example: Example) -> dict:
        """The example's row as the data gives it: its prompt and every other column (an environment's reset reads it)."""
        row = self.data.rows[example.id]
        return {"prompt": row.prompt, **row.columns}

    def score(self, examples: list[Example], texts: list[str], token_ids: list[list[int]]) -> list[float | None]:
        """The rewards of completions `texts` of `examples`: one call of each reward function (vineppo.core.rewards)."""
        return self.data.batch([ex.id for ex in examples], texts, token_ids)

    def solved(self, reward: float | None) -> bool:
        """Reward at least --success-threshold."""
        return reward is not None and reward >= self.settings.success_threshold

    def prompt(self, example: Example) -> str:
        """The prompt text as the data gives it."""
        return example.problem

    def target(self, example: Example) -> str:
        """The reference completion as the data gives it (TRL's standard format joins prompt and completion)."""
        return example.solution


class Data:
    """A custom task's rows by example key, whether its prompts are text or chat turns, and its reward."""

    def __init__(self, settings: Settings, objects: dict[str, Any], agent: AgentSpec | None = None):
        self.settings, self.objects, self.agent = settings, objects, agent
        self.rows: dict[str, Row] = {}
        self.format: str | None = None  # plain (text prompts) or chat, once a source is loaded
        self.rewards: Rewards | None = None  # made when the first source is loaded (its columns are checked)

    def load(self, split: str, path: str | None, seed: int = 0) -> list[Example]:
        """The examples of `split` from `path` (a source as --data takes it); `seed` is unused (the carve is fixed)."""
        if path is None:
            raise UserError(NO_DATA)
        records, where = self.read(path, split)
        pairs = carve(records, split) if split in ("train", "validation") else list(enumerate(records))
        examples = [self.example(records[i], where[i]) for i, _ in pairs]
        if not examples:
            return examples
        columns = list(self.rows[examples[0].id].columns)
        for ex in examples:
            missing = [c for c in columns if c not in self.rows[ex.id].columns]
            extra = [c for c in self.rows[ex.id].columns if c not in columns]
            if missing or extra:
                raise UserError(f"{ex.id}: " + (f"missing column {missing[0]!r}" if missing else f"column {extra[0]!r}")
                                + f", unlike {examples[0].id}; every record needs the same columns")
        for name, fn in self.functions():
            check_signature(name, fn, columns + (["environments"] if self.trl() else []))
        return examples

    def trl(self) -> bool:
        """Whether the environment is in TRL's form: its reward functions also get `environments`."""
        return self.agent is not None and self.agent.trl is not None

    def read(self, path: str, split: str) -> tuple[list[dict], list[str]]:
        """The records of a source and where each one is."""
        if path.startswith(PYTHON):
            name = path[len(PYTHON):]
            if name not in self.objects:
                raise UserError(f"{path}: no such data set (python:NAME names one the Python API was given)")
            records = [dict(r) if hasattr(r, "keys") else r for r in self.objects[name]]
            where = [f"{name}[{i}]" for i in range(len(records))]
        elif path.startswith("hub:"):
            repo, _, config = path[4:].partition(":")
            hub_split = "train" if split in ("train", "validation") else split
            records = load_hub(repo, config or None, hub_split, task="custom", required=())
            where = [f"hub {repo} {hub_split} record {i}" for i in range(len(records))]
        else:
            records, where = read_file(path)
        if not records:
            raise UserError(f"{path}: no records (empty data set)")
        bad = next((w for r, w in zip(records, where) if not isinstance(r, dict)), None)
        if bad:
            raise UserError(f"{bad}: expected a record of named columns (a JSON object, a dict)")
        return records, where

    def example(self, record: dict, where: str) -> Example:
        """One record as an Example (its id: where it is) and its Row; a UserError names where and column."""
        source, reference = self.settings.prompt_column, None
        if source not in record and source == "prompt" and "messages" in record:
            source = "messages"
        if source not in record:
            raise UserError(f"{where}: no column {source!r} (columns: {', '.join(record)}); name the prompt's "
                            f"column with --prompt-column")
        prompt = record[source]
        if turns(prompt) and prompt and prompt[-1]["role"] == "assistant":  # a reference answer, not the prompt
            prompt, reference = prompt[:-1], prompt[-1]["content"]
        kind = "plain" if isinstance(prompt, str) else "chat" if turns(prompt) and prompt else None
        if kind is None or not (prompt if kind == "plain" else prompt[-1]["content"]).strip():
            raise UserError(f"{where}: column {source!r} must be non-empty text or a list of {{role, content}} chat "
                            f"turns, got {str(prompt)[:60]!r}")
        if self.format not in (None, kind):
            raise UserError(f"{where}: the prompt is {'text' if kind == 'plain' else 'chat turns'} but the earlier "
                            f"records' are not; a data set's prompts are all text or all chat turns")
        self.format = kind
        if self.settings.completion_column is not None:
            reference = completion_text(record, self.settings.completion_column, where)
        columns = {k: v for k, v in record.items() if k != source}
        reserved = [k for k in columns if k in ARGUMENTS + CONTEXT]
        if reserved:
            raise UserError(f"{where}: column {reserved[0]!r} has the name of an argument every reward call passes; "
                            f"rename it")
        if self.trl() and "environments" in columns:
            raise UserError(f"{where}: column 'environments' has the name of the argument TRL's environments pass "
                            f"to the reward functions; rename it")
        self.rows[where] = Row(prompt, columns)
        text = prompt if kind == "plain" else prompt[-1]["content"]
        answer = columns.get("answer")
        return Example(id=where, problem=text, solution=reference or "",
                       answer=str(answer) if isinstance(answer, (str, int, float)) else "")

    def functions(self) -> list[tuple[str, Callable]]:
        """The reward functions, loaded once (the Python API's callables, or --reward's names)."""
        if self.rewards is None:
            given = self.objects.get("reward")
            functions = [(getattr(f, "__name__", "reward"), f) for f in given] if given else \
                [load_function(spec) for spec in self.settings.reward]
            weights = self.settings.reward_weights
            if self.trl() and self.agent.trl.rewards:  # TRL: get_reward() is one more function, of weight 1
                functions.append(self.agent.trl.reward_function(self.agent.env))
                weights = (*(weights or [1.0] * (len(functions) - 1)), 1.0)
            self.rewards = Rewards(functions, weights, self.settings.reward_timeout_s)
        return self.rewards.functions

    def batch(self, keys: list[str], texts: list[str], token_ids: list[list[int]]) -> list[float | None]:
        """The rewards of completions `texts` of the examples `keys` (one call of each reward function)."""
        if not self.functions():
            raise UserError("task 'custom' has no reward function: pass --reward FILE.py:FUNCTION")
        rows = [self.rows[k] for k in keys]
        names = list(rows[0].columns)
        for row, key in zip(rows, keys):
            if set(row.columns) != set(names):
                raise UserError(f"{key}: its columns ({', '.join(row.columns)}) are not those of {keys[0]} "
                                f"({', '.join(names)}), which it is scored with")
        # a dialogue's completion is its messages (TRL's conversational form); a chat reply one assistant message
        chat = [t if isinstance(t, list) else [{"role": "assistant", "content": t}] for t in texts]
        columns = {c: [r.columns[c] for r in rows] for c in names}
        if self.trl():  # TRL's reward functions read the environment instance that played each completion
            columns["environments"] = [getattr(t, "env", None) for t in texts]
        return self.rewards(Batch(prompts=[r.prompt for r in rows], completions=chat if self.format == "chat" else
                                  list(texts), completion_ids=[list(ids) for ids in token_ids],
                                  columns=columns, where=list(keys)))


def add_arguments(parser: argparse.ArgumentParser, scoring: bool = True) -> None:
    """The custom task's flags for `eval`, `sft` (`scoring` False: no reward) and `inspect-data`; `train` has them as
    TrainConfig fields."""
    group = parser.add_argument_group("--task custom (vineppo.tasks.custom)")
    group.add_argument("--prompt-column", default=None, help="the prompt's column, text or chat turns (default: "
                       "prompt, else a messages column)")
    group.add_argument("--completion-column", default=None, help="the reference completion's column")
    if not scoring:
        return
    group.add_argument("--reward", action="append", default=None, metavar="FILE.py:FUNCTION",
                       help="a reward function in TRL's form, FILE.py:FUNCTION or package.module:FUNCTION (repeatable)")
    group.add_argument("--reward-weights", default=None,
                       help="one weight per --reward, comma-separated (default: 1 each)")
    group.add_argument("--steps", default=None, help=f"VinePPO's steps: {STEPS_HELP} (default: turns with tools or "
                       f"an environment, else lines)")
    group.add_argument("--success-threshold", type=float, default=None,
                       help="reward at or above which a response counts as solved (default: 1.0)")
    group.add_argument("--reward-timeout-s", type=float, default=None,
                       help="seconds one reward call, tool call or environment step may take (default: 60; 0: no limit)")
    group.add_argument("--tools", action="append", default=None, metavar="FILE.py:FN1,FN2",
                       help="functions the model may call (type hints and an Args: docstring; repeatable)")
    group.add_argument("--env", default=None, metavar="FILE.py:CLASS",
                       help="an environment that answers the model's turns: reset(row), step(text)")
    group.add_argument("--max-turns", type=int, default=None, help="the model's turns per dialogue (default 4)")
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="the model's tokens in all its turns of a dialogue (default: --max-new-tokens x --max-turns)")
    group.add_argument("--max-inserted-tokens", type=int, default=None,
                       help="tokens tools and the environment insert in a dialogue (default: what the model's context "
                            "leaves)")
    group.add_argument("--tool-format", default=None, help="template, plain or auto (default: auto)")
    group.add_argument("--tool-markup", default=None, help=f"the plain format's markup (default: {MARKUP})")
    group.add_argument("--demo", default=None, metavar="FILE", help="worked dialogues before every prompt: a JSON "
                       "array of chat messages, or a JSONL file of one message per line")


def check_reward(args: argparse.Namespace) -> None:
    """A command's flags, before any model loads: task custom needs a reward function or an environment that gives the
    reward (`add_arguments`' --reward, --env)."""
    if args.task == "custom" and not getattr(args, "reward", None) and not getattr(args, "env", None):
        raise UserError("task custom needs a reward function: --reward FILE.py:FUNCTION (or package.module:FUNCTION), "
                        "or an environment that gives the reward (--env)")


def turns(value: Any) -> bool:
    """True for a list of chat messages: dicts with a role and text content."""
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
                                           for m in value)


def completion_text(record: dict, column: str, where: str) -> str:
    """The reference completion in `column`: text, or the content of the last chat turn."""
    if column not in record:
        raise UserError(f"{where}: no column {column!r} (--completion-column; columns: {', '.join(record)})")
    value = record[column]
    if isinstance(value, str):
        return value
    if turns(value) and value:
        return value[-1]["content"]
    raise UserError(f"{where}: column {column!r} must be text or chat turns, got {type(value).__name__}")


def read_file(path: str) -> tuple[list[Any], list[str]]:
    """The records of a JSONL, JSON, CSV or Parquet file and where each one is (file:line, or file[index])."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such file")
    kind = file.suffix.lower()
    if kind == ".jsonl":
        records = read_jsonl(file, required=())
        return records, [f"{path}:{i + 1}" for i in range(len(records))]  # read_jsonl skips no line
    if kind == ".json":
        try:
            records = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read it as JSON: {e}") from None
        if not isinstance(records, list):
            raise UserError(f"{path}: expected a JSON array of objects, got {type(records).__name__}")
        return records, [f"{path}[{i}]" for i in range(len(records))]
    if kind == ".csv":
        return read_csv(file, path)
    if kind == ".parquet":
        import pyarrow.parquet as pq  # installed with `datasets`; only Parquet files need it

        try:
            records = pq.read_table(file).to_pylist()
        except Exception as e:  # noqa: BLE001 - whatever pyarrow says of a bad file becomes one line naming it
            raise UserError(f"{path}: cannot read it as Parquet: {str(e).splitlines()[0][:200]}") from None
        return records, [f"{path}[{i}]" for i in range(len(records))]
    raise UserError(f"{path}: unknown file type {kind or '(none)'!r}; use .jsonl, .json, .csv or .parquet, or "
                    f"hub:NAME[:CONFIG]")


def read_csv(file: Path, path: str) -> tuple[list[dict], list[str]]:
    """The rows of a CSV file with a header line, as text, each named by the line it starts on (the header is line 1,
    so the first row is FILE:2); a row with more or fewer fields names its line."""
    records, where = [], []
    try:
        with open(file, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            start = reader.line_num + 1  # a quoted field may span lines: a row is where it starts
            for row in reader:
                line, start = start, reader.line_num + 1
                if not row:  # a blank line
                    continue
                if len(row) != len(header):
                    raise UserError(f"{path}:{line}: {len(row)} fields where the header has {len(header)}")
                records.append(dict(zip(header, row)))
                where.append(f"{path}:{line}")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path}: cannot read it as CSV: {e}") from None
    return records, where


def make_task(settings: Settings, objects: dict[str, Any] | None = None) -> CustomTask:
    """The custom task for `settings`; `objects` holds what the Python API passes (data sets, reward callables,
    tools, an environment class)."""
    objects = objects or {}
    agent = agent_of(settings, objects)
    data = Data(settings, objects, agent)
    if agent is not None and agent.trl is not None and not agent.trl.rewards and \
            not (objects.get("reward") or settings.reward):
        raise UserError(f"environment {agent.env.__name__} (TRL's form) has no get_reward(): pass a reward function "
                        f"(--reward FILE.py:FUNCTION; it may take `environments`), or give the class get_reward()")
    steps = settings.steps or ("turns" if agent else "lines")
    return CustomTask(name="custom", preset="", cpu_preset="custom-cpu", load=data.load, grade=None,
                      split_steps=make_splitter(steps), prompt_template="{problem}", instruction="", stop=(),
                      lenient=None, step_tokens=token_steps(steps), step_turns=steps == "turns", agent=agent,
                      settings=settings, data=data, demo=tuple(load_demo(settings.demo)) if settings.demo else ())


def agent_of(settings: Settings, objects: dict[str, Any]) -> AgentSpec | None:
    """The tools and environment the settings (or the Python API's objects) name, loaded and checked; None: none. A
    TRL-form environment's public methods join the tools."""
    tools = load_tools(list(objects.get("tools") or settings.tools))
    spec = objects.get("env") or settings.env
    if not tools and spec is None:
        return None
    if settings.tool_format not in FORMATS:
        raise UserError(f"--tool-format {settings.tool_format!r}: choose one of {', '.join(FORMATS)}")
    if settings.max_turns < 1 or settings.max_total_tokens < 0 or settings.max_inserted_tokens < 0:
        raise UserError("--max-turns must be >= 1, --max-total-tokens and --max-inserted-tokens >= 0")
    env = load_env(spec) if spec is not None else None
    trl = None
    if env is not None and trl_form(env):
        trl, methods = trl_tools(env, f"--env {spec}" if isinstance(spec, str) else f"env={env.__name__}")
        clash = [n for n in methods if n in tools]
        if clash:
            raise UserError(f"--env {spec}: its method {clash[0]!r} has the name of a --tools function")
        tools.update(methods)
    return AgentSpec(tools, env, settings.max_turns, settings.max_total_tokens, settings.tool_format,
                     Markup.parse(settings.tool_markup), settings.max_inserted_tokens, trl)


ROLES = ("user", "assistant", "tool")  # what a demo's messages may be (a system text goes in the data's prompt)


def load_demo(path: str) -> list[dict]:
    """The messages of `--demo FILE`: a JSON array of {role, content} chat messages, or a JSONL file of one message
    per line; user, assistant and tool messages, ending with the assistant's. A UserError names the file and line."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--demo {path}: no such file")
    if file.suffix.lower() == ".jsonl":
        messages, where = read_jsonl(file, required=()), None
    else:
        try:
            messages = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"--demo {path}: cannot read it as JSON: {e}") from None
        if not isinstance(messages, list):
            raise UserError(f"--demo {path}: expected a JSON array of chat messages, got {type(messages).__name__}")
        where = "[{}]"
    for i, m in enumerate(messages):
        at = f"{path}{where.format(i)}" if where else f"{path}:{i + 1}"
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise UserError(f"{at}: a demo message is {{\"role\": {' | '.join(ROLES)}, \"content\": text}}, got "
                            f"{str(m)[:80]!r}")
    if not messages or messages[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in messages):
        raise UserError(f"--demo {path}: a demo is a worked dialogue: a user message, then the assistant's turns (and "
                        f"tool results), ending with the assistant's answer")
    return [{k: v for k, v in m.items() if k in ("role", "content", "name")} for m in messages]


register(make_task(Settings()))
