"""What a task's model may call and what answers it: tools (`--tools FILE.py:fn1,fn2`) and an environment
(`--env FILE.py:Class`), loaded and checked before any model loads. The dialogues themselves run in
vineppo.agents.

**A tool** is a plain Python function with type hints and a docstring whose `Args:` section describes each
argument, as TRL's `tools=` takes it: its JSON schema (transformers' `get_json_schema`) goes into the chat template
(`--tool-format template`) or, for a model whose template knows no tools, into a system text that shows the call
markup (`plain`, e.g. SmolLM2). A call is `OPEN{"name": ..., "arguments": {...}}CLOSE`; its result goes back as
`RESULT_OPEN...RESULT_CLOSE` (`--tool-markup OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE`). A task with one tool of one
argument takes a call that is not JSON as that argument written out (`<calc>347 * 29</calc>`).

**An environment** is a class whose instances answer one dialogue, in one of two forms. vineppo's: `reset(row) ->
str` (the first observation, appended to the prompt; "" for none), then `step(text) -> (observation, done)` or
`(observation, done, reward)` for each of the model's turns. TRL 1.16's `environment_factory` form (`TrlForm`), read
when `reset` takes `**kwargs` or the class has no `step`: `reset(**row)` (its text, when not None, appended to the
last user message as it is), its public methods the model's tools (called on the dialogue's own instance), an
optional `get_reward()` (a reward function of weight 1 named after the class) and reward functions that receive
`environments`, the instances that played each completion; a turn without a call ends the dialogue. VinePPO's
continuations from a turn need the environment as it was there: a class either says `deterministic = True`
(rebuilt from its row and replayed with the dialogue's earlier turns) or has a `copy()` that snapshots an instance.
A class attribute `stop` (a tuple of strings, e.g. `("\n",)` for a game whose moves are one line) ends the model's
turn where it writes one of them, besides its end-of-turn token.

**A call** is found in a turn's text up to its last CLOSE, also when the token that completed CLOSE holds more text
(a tokenizer that merges `><` ends the turn on `</calc><`): that text stays the policy's. A turn whose text opens a
call it does not close is a bad call: counted, and the model is told.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from vineppo.core.errors import UserError
from vineppo.core.rewards import load_function, one_line

MARKUP = "<tool_call>|</tool_call>|<tool_response>|</tool_response>"
FORMATS = ("auto", "template", "plain")


@dataclass(frozen=True)
class Markup:
    """How a call is written and how its result comes back, in the plain format (the template's own otherwise)."""

    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    result_open: str = "<tool_response>"
    result_close: str = "</tool_response>"

    @classmethod
    def parse(cls, text: str) -> Markup:
        """The markup of `--tool-markup OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE`, or a UserError."""
        parts = text.split("|")
        if len(parts) != 4 or not all(p.strip() for p in parts):
            raise UserError(f"--tool-markup {text!r}: expected four non-empty parts, OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE")
        return cls(*parts)


@dataclass
class Tool:
    """A function the model may call, by name, with its JSON schema."""

    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    method: bool = False  # a method of a TRL-form environment: called on the dialogue's own instance

    def parameters(self) -> dict:
        """The arguments' schemas by name."""
        return self.schema["function"].get("parameters", {}).get("properties", {})

    def line(self) -> str:
        """One line for the plain format's system text: name(arg: type, ...): description."""
        params = self.schema["function"].get("parameters", {}).get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in params.items())
        return f"{self.name}({args}): {self.schema['function'].get('description', '')}"


@dataclass
class AgentSpec:
    """The tools and environment of a task, and how its dialogues run."""

    tools: dict[str, Tool] = field(default_factory=dict)
    env: type | None = None  # instantiated once per dialogue
    max_turns: int = 4  # the model's turns per dialogue; a dialogue still going after them is cut off (reward 0)
    max_total_tokens: int = 0  # the model's tokens in all its turns (0: max_new_tokens x max_turns)
    format: str = "auto"  # template (the chat template's tools=) | plain (the markup in a system text) | auto
    markup: Markup = Markup()
    max_inserted_tokens: int = 0  # tokens tools and the environment insert (0: what the model's context leaves)
    trl: TrlForm | None = None  # the environment in TRL's environment_factory form (None: vineppo's, or none)

    def system_text(self) -> str:
        """The plain format's instruction: the tools and how to call them."""
        if not self.tools:
            return ""
        first = next(iter(self.tools.values()))
        example = json.dumps({"name": first.name, "arguments": {k: "..." for k in
                                                                first.schema["function"]["parameters"]["properties"]}})
        return ("You can call these tools:\n" + "\n".join(t.line() for t in self.tools.values()) +
                f"\nTo call one, write {self.markup.call_open}{example}{self.markup.call_close} and stop; the result "
                f"comes back as {self.markup.result_open}...{self.markup.result_close}.")

    def single(self) -> str | None:
        """The name of the only tool when it takes one argument (a call may then hold the argument alone), else None."""
        if len(self.tools) != 1:
            return None
        name, tool = next(iter(self.tools.items()))
        return name if len(tool.parameters()) == 1 else None

    def call(self, text: str) -> tuple[str, dict] | str:
        """The (name, arguments) of the last call written in `text` (up to its last CLOSE; what follows is not read),
        or an error message for the model."""
        end = text.rfind(self.markup.call_close)
        text = text[:end] if end >= 0 else text
        at = text.rfind(self.markup.call_open)
        if at < 0:
            return f"error: no {self.markup.call_open} before {self.markup.call_close}"
        body = text[at + len(self.markup.call_open):].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            if self.single() is not None:  # one tool of one argument: the body is that argument, as it is written
                return self.single(), {next(iter(self.tools[self.single()].parameters())): body}
            return f"error: the call is not JSON ({e.msg}); write {{\"name\": ..., \"arguments\": {{...}}}}"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not isinstance(call.get("arguments", {}), dict):
            return "error: a call is {\"name\": TOOL, \"arguments\": {...}}"
        if call["name"] not in self.tools:
            return f"error: no tool {call['name']!r}; the tools are {', '.join(self.tools)}"
        return call["name"], call.get("arguments", {})

    def unclosed(self, text: str) -> str | None:
        """The message for a turn that opens a call after its last CLOSE and never closes it, else None."""
        m = self.markup
        if text.rfind(m.call_open) > text.rfind(m.call_close):
            return (f"error: the call is not closed; write {m.call_open}...{m.call_close} and stop there, the result "
                    f"comes back as {m.result_open}...{m.result_close}")
        return None


@dataclass(frozen=True)
class TrlForm:
    """An environment class in TRL 1.16's `environment_factory` form: `reset(**row)`, public methods as tools, an
    optional `get_reward()`."""

    methods: tuple[str, ...]  # the public methods the model may call
    rewards: bool  # it has get_reward(): a reward function of weight 1 named after the class

    def reward_function(self, cls: type) -> tuple[str, Callable]:
        """(the class's name, a reward function in TRL's form that reads each completion's `get_reward()`)."""
        def get_reward(environments, **kwargs):
            return [e.get_reward() if e is not None else None for e in environments]
        return cls.__name__, get_reward


SKIPPED = ("reset", "get_reward", "copy")  # TRL's two, and vineppo's snapshot of an instance (VinePPO)


def trl_form(cls: type) -> bool:
    """Whether an environment class is in TRL's form: `reset` takes **kwargs, or the class has no `step`."""
    try:
        params = inspect.signature(cls.reset).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD for p in params) or not callable(getattr(cls, "step", None))


def public_methods(cls: type) -> tuple[str, ...]:
    """A TRL-form class's tools, by name: its functions not named with `_` nor in SKIPPED (TRL's rule)."""
    return tuple(n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if not n.startswith("_") and n not in SKIPPED)


def trl_tools(cls: type, where: str) -> tuple[TrlForm, dict[str, Tool]]:
    """The TRL-form class's description and its public methods as tools (schemas from a probe instance's bound
    methods, as TRL reads them), or a UserError naming `where`."""
    try:
        probe = cls()
    except Exception as e:  # noqa: BLE001 - a user's class: one line naming it
        raise UserError(f"{where}: making an instance failed ({one_line(e)}); TRL's environment_factory form takes a "
                        f"class made without arguments") from None
    names = public_methods(cls)
    tools = {}
    for name in names:
        tool = tool_of(getattr(probe, name), f"{where}: method {name}")
        tools[name] = Tool(name, tool.fn, tool.schema, method=True)
    return TrlForm(names, callable(getattr(cls, "get_reward", None))), tools


def tool_of(fn: Callable, where: str) -> Tool:
    """A Tool from a function with type hints and an Args: docstring, or a UserError naming `where`."""
    from transformers.utils import get_json_schema  # transformers: only when tools are given

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' reasons (no hints, no docstring) become one line
        raise UserError(f"{where}: a tool needs type hints and a docstring with an Args: section describing each "
                        f"argument ({one_line(e)})") from None
    return Tool(fn.__name__, fn, schema)


def load_tools(specs: list) -> dict[str, Tool]:
    """The tools of `--tools FILE.py:fn1,fn2` (repeatable) or the Python API's functions, by name."""
    tools: dict[str, Tool] = {}
    source = ""
    for spec in specs:
        if callable(spec):
            found = [(spec.__name__, spec, f"tools=[{spec.__name__}]")]
        else:  # FILE.py:fn1,fn2, which a list setting may have cut at its commas: a bare name is the last file's
            source, _, names = str(spec).rpartition(":") if ":" in str(spec) else (source, ":", str(spec))
            if not source or not names:
                raise UserError(f"--tools {spec!r}: expected FILE.py:FUNCTION[,FUNCTION...]")
            found = [(*load_function(f"{source}:{n.strip()}", flag="--tools"), f"--tools {source}:{n.strip()}")
                     for n in names.split(",") if n.strip()]
        for name, fn, where in found:
            if name in tools:
                raise UserError(f"{where}: a second tool named {name!r}")
            tools[name] = tool_of(fn, where)
    return tools


def load_env(spec: Any) -> type:
    """The environment class `--env FILE.py:Class` names (or the Python API's class), its methods checked (either
    form: `trl_form`)."""
    if isinstance(spec, type):
        cls, where = spec, f"env={spec.__name__}"
    else:
        _, cls = load_function(str(spec), flag="--env", kind="class")
        where = f"--env {spec}"
    if not isinstance(cls, type):
        raise UserError(f"{where}: expected a class, got a {type(cls).__name__}")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"{where}: an environment needs reset(self, row) (vineppo's form) or reset(self, **kwargs) "
                        f"(TRL's environment_factory form)")
    if trl_form(cls) and not public_methods(cls):
        raise UserError(f"{where}: an environment needs step(self, text) (vineppo's form) or public methods the model "
                        f"calls as tools (TRL's environment_factory form)")
    if not trl_form(cls):
        for method, arg in (("reset", "row"), ("step", "text")):
            if len(inspect.signature(getattr(cls, method)).parameters) < 2:
                raise UserError(f"{where}: an environment needs {method}(self, {arg})")
    stop = getattr(cls, "stop", ())
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise UserError(f"{where}: `stop` must be a tuple of non-empty strings that end the model's turn, got {stop!r}")
    return cls


def first_observation(spec: AgentSpec, row: dict, where: str) -> tuple[str, str | None]:
    """What a fresh environment's reset says for `row` (`where`: its id), and how it joins the prompt (None: the
    prompt format's rule; "": as it is, TRL's); ("", None) without an environment. What reset raises is one line."""
    if spec.env is None:
        return "", None
    try:
        env = spec.env()
        first = env.reset(**row) if spec.trl else env.reset(row)
    except Exception as e:  # noqa: BLE001 - a user's environment: one line naming the row
        raise UserError(f"{where}: the environment's reset raised {one_line(e)}") from None
    return ("" if first is None else str(first)), ("" if spec.trl else None)


def env_stop(env: type | None) -> tuple[str, ...]:
    """The strings that end the model's turn in a dialogue with `env` (its `stop` attribute), besides EOS."""
    return tuple(getattr(env, "stop", ()))  # None (no environment) has none


def resumable(env: type | None) -> bool:
    """Whether dialogues with `env` can be continued from a turn: no environment, a deterministic one, or copy()."""
    return env is None or getattr(env, "deterministic", False) is True or callable(getattr(env, "copy", None))
