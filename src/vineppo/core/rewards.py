"""Reward functions in TRL's form: found by name, checked against the data's columns, called in batches.

A reward function is `f(prompts, completions, **kwargs) -> list[float | None]`, the signature of TRL's
GRPOTrainer: one call scores a batch of completions. `prompts` and `completions` are strings, or for chat data
lists of `{role, content}` messages (the prompt's turns; one assistant message per completion); the keyword
arguments are `completion_ids` (each completion's token ids) and every column of the data but the prompt's,
one entry per completion. A function written for TRL runs unchanged, `async def` ones included.

As TRL's GRPOTrainer does, a call also passes `trainer_state` (`TrainerState`: `global_step`, `max_steps`,
`epoch`), `log_metric(name, value)` (a scalar, averaged per iteration into the run's metrics as `metric/NAME`)
and `log_extra(column, values)` (a column of the run's completions table, one value per completion), to the
functions that name them or take **kwargs; a function that takes neither does not get them (`RewardLog`).

Several functions add up, each times its weight (`--reward-weights`, 1 each by default). A function's None
for a completion leaves that function out of its sum (TRL's rule for rewards that apply to some rows only);
a completion that every function leaves out has no reward: the trainer leaves it out of the loss and counts it.

Whatever goes wrong stops the run with one line naming the function: an exception (with the batch's first
example), anything but one finite number or None per completion, or a call longer than `--reward-timeout-s`.
"""

from __future__ import annotations

import _thread
import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import signal
import sys
import threading
import traceback
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from vineppo.core.errors import RewardError, UserError

ARGUMENTS = ("prompts", "completions", "completion_ids")  # what every call passes besides the columns
CONTEXT = ("trainer_state", "log_metric", "log_extra")  # what TRL passes too, to the functions that take them
SPEC_HELP = "FILE.py:FUNCTION or package.module:FUNCTION"


@dataclass
class Batch:
    """One call's inputs: a list entry per completion."""

    prompts: list  # the prompt column's values: text, or chat turns
    completions: list  # text, or [{"role": "assistant", "content": text}] for chat data
    completion_ids: list[list[int]]
    columns: dict[str, list]  # every other column of the data
    where: list[str]  # each completion's example (file:line), for error messages


@dataclass
class TrainerState:
    """The training progress a reward function reads as `trainer_state` (the fields of TRL's TrainerState it uses)."""

    global_step: int = 0  # iterations done before the current one
    max_steps: int = 0  # the run's iterations
    epoch: float = 0.0  # passes over the training prompts so far (iterations done x prompts per iteration / prompts)


@dataclass
class Call:
    """One call of the reward functions on a batch: each function's values and the columns it logged."""

    values: dict[str, list[float | None]]  # function name -> its value per completion (before weighting)
    extra: dict[str, list]  # log_extra's columns, one value per completion


@dataclass(eq=False)  # two recordings are two, whatever they hold (RewardLog.open removes this one)
class Recording:
    """What the reward functions logged while it was open (`RewardLog.recording`): their calls and log_metric's
    scalars, oldest first."""

    calls: list[Call] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def sums(self) -> dict[str, tuple[float, int]]:
        """The logged scalars as (sum, count) per name."""
        return {k: (sum(v), len(v)) for k, v in self.metrics.items() if v}


@dataclass
class RewardLog:
    """What the reward functions give besides the weighted sum: `trainer_state`, and, to the recordings open while
    they run, the scalars of `log_metric` and their calls (each function's values, `log_extra`'s columns)."""

    state: TrainerState = field(default_factory=TrainerState)
    extra: dict[str, list] = field(default_factory=dict)  # the current call's log_extra columns
    open: list[Recording] = field(default_factory=list)  # the recordings under way (nested: each gets everything)

    def log_metric(self, name: str, value: float) -> None:
        """A reward function's scalar (TRL's `log_metric`): averaged per iteration into the metrics as metric/NAME."""
        if not isinstance(name, str) or not name:
            raise RewardError(f"log_metric: the name must be text, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"log_metric({name!r}, {value!r}): the value must be a finite number")
        for rec in self.open:
            rec.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """A column of the completions table (TRL's `log_extra`): one value per completion of the current batch."""
        if not isinstance(column, str) or not column:
            raise RewardError(f"log_extra: the column name must be text, got {column!r}")
        self.extra.setdefault(column, []).extend(values.tolist() if hasattr(values, "tolist") else list(values))

    def called(self, call: Call) -> None:
        """One call of the reward functions, handed to every open recording."""
        for rec in self.open:
            rec.calls.append(call)

    @contextmanager
    def recording(self) -> Iterator[Recording]:
        """A Recording of what the reward functions log until the block ends."""
        rec = Recording()
        self.open.append(rec)
        try:
            yield rec
        finally:
            self.open.remove(rec)


@contextmanager
def recording(log: RewardLog | None) -> Iterator[Recording]:
    """`log.recording()`, or an empty Recording for a task whose rewards log nothing (None)."""
    if log is None:
        yield Recording()
        return
    with log.recording() as rec:
        yield rec


def load_function(spec: str, flag: str = "--reward", kind: str = "function") -> tuple[str, Callable]:
    """(name, function) that `--reward FILE.py:FUNCTION` or `--reward package.module:FUNCTION` names (`flag`: the
    flag errors name: --reward, --tools, --env; `kind`: what the name must be, "function" or "class", which a
    missing name's message lists)."""
    source, _, name = spec.rpartition(":")
    if source == "python":  # recorded in config.yaml by the Python API, which passes the function itself
        raise UserError(f"{flag} {spec}: a function given to the Python API (vineppo.api), which only Python can "
                        f"pass again: train(config, reward=...)")
    if not source or not name.isidentifier():
        raise UserError(f"{flag} {spec!r}: expected {SPEC_HELP}")
    where = f"{flag} {spec}"
    module = _import_file(source, where) if source.endswith(".py") else _import_module(source, where)
    fn = getattr(module, name, None)
    if fn is None:
        test = inspect.isclass if kind == "class" else inspect.isfunction
        defined = sorted(k for k, v in vars(module).items() if test(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)  # its own, not what it imports
        raise UserError(f"{flag} {spec}: {source} has no {kind} {name!r}" +
                        (f" (it defines {', '.join(defined)})" if defined else f" (it defines no {kind})"))
    if not callable(fn):
        raise UserError(f"{flag} {spec}: {name} is a {type(fn).__name__}, not a {kind}")
    return name, fn


def _import_file(path: str, where: str):
    """The module of a Python file, run afresh; its folder joins sys.path, as for a script run beside it."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{where}: no such file {path}")
    name = "vineppo_reward_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    found = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # dataclasses and pickling look a module up here
    if str(file.resolve().parent) not in sys.path:
        sys.path.append(str(file.resolve().parent))
    try:
        found.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever a user's file raises becomes one line naming it
        del sys.modules[name]
        raise UserError(f"{where}: importing {path} failed: {one_line(e, file)}") from None
    return module


def _import_module(dotted: str, where: str):
    """An installed module by its dotted name."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        raise UserError(f"{where}: no module named {e.name!r} (a file must end in .py)") from None
    except Exception as e:  # noqa: BLE001 - as for a file
        raise UserError(f"{where}: importing {dotted} failed: {one_line(e)}") from None


def one_line(e: BaseException, file: Path | None = None) -> str:
    """'Type: message' of an exception, with the line of `file` (or of the innermost frame) it came from."""
    text = (str(e).strip().splitlines() or [""])[0][:300]
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if file is None or Path(f.filename).resolve() == file.resolve()]
    if isinstance(e, SyntaxError):  # str(e) ends in "(file, line N)": the message alone, and the line once
        text, line = (e.msg or text)[:300], e.lineno
    else:
        line = mine[-1].lineno if mine else None
    at = f" (line {line})" if line else ""
    return f"{type(e).__name__}: {text}{at}" if text else f"{type(e).__name__}{at}"


def accepted_context(fn: Callable) -> tuple[str, ...]:
    """The names of CONTEXT that `fn` takes: all of them with **kwargs, else those it names (none for a function
    whose signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return CONTEXT
    return tuple(p.name for p in params if p.name in CONTEXT and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_signature(name: str, fn: Callable, columns: list[str]) -> None:
    """A UserError unless `fn` takes what every call passes by name (prompts, completions, completion_ids and the
    columns; TRL's form takes what it does not name with **kwargs) and needs nothing else."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: its first call will tell
        return
    passed = [*ARGUMENTS, *columns]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    needed = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p for p in needed if p not in CONTEXT and (p not in passed or p not in named)]
    if missing:
        raise UserError(f"reward function {name}: its argument(s) {', '.join(missing)} are not columns of the data "
                        f"(columns: {', '.join(columns) or 'none'}) nor {', '.join(ARGUMENTS + CONTEXT)} passed by "
                        f"name")
    if not any(p.kind == p.VAR_KEYWORD for p in params) and (extra := [k for k in passed if k not in named]):
        raise UserError(f"reward function {name} does not take {', '.join(extra)}, which every call passes by name; "
                        f"add **kwargs to its arguments (TRL's form: def {name}(prompts, completions, **kwargs))")


class Rewards:
    """The weighted sum of reward functions, called on batches with a time limit per call."""

    def __init__(self, functions: list[tuple[str, Callable]], weights: list[float] | None = None,
                 timeout_s: float = 0.0):
        self.functions = functions
        self.weights = list(weights) if weights else [1.0] * len(functions)
        if len(self.weights) != len(functions):
            raise UserError(f"--reward-weights: {len(self.weights)} weights for {len(functions)} reward functions")
        self.timeout_s = timeout_s
        self.log = RewardLog()
        self.context = {name: accepted_context(fn) for name, fn in functions}

    def __call__(self, batch: Batch) -> list[float | None]:
        """Each completion's reward: the weighted sum of the numbers its functions gave, None when they gave none.
        Each function's values and the columns of `log_extra` are kept in `log` as one `Call`."""
        n = len(batch.completions)
        total: list[float | None] = [None] * n
        values: dict[str, list[float | None]] = {}
        self.log.extra = {}
        for (name, fn), weight in zip(self.functions, self.weights):
            values[name] = self._call(name, fn, batch)
            for i, value in enumerate(values[name]):
                if value is not None:
                    total[i] = (total[i] or 0.0) + weight * value
        for column, logged in self.log.extra.items():
            if len(logged) != n:
                raise RewardError(f"log_extra({column!r}, ...) got {len(logged)} values for a batch of {n} completions "
                                  f"(one per completion; batch from {batch.where[0]})")
        self.log.called(Call(values, self.log.extra))
        return total

    def _call(self, name: str, fn: Callable, batch: Batch) -> list[float | None]:
        n = len(batch.completions)
        given = {"trainer_state": self.log.state, "log_metric": self.log.log_metric, "log_extra": self.log.log_extra}
        try:
            with time_limit(self.timeout_s):
                out = fn(prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids,
                         **batch.columns, **{k: given[k] for k in self.context[name]})
                if inspect.isawaitable(out):  # an `async def` reward, as TRL allows
                    out = asyncio.run(out)
        except TimeoutError:
            raise RewardError(f"reward function {name} took more than {self.timeout_s:g} s on a batch of {n} "
                              f"completions (--reward-timeout-s)") from None
        except Exception as e:  # noqa: BLE001 - a user's function: any exception becomes one line naming it
            raise RewardError(f"reward function {name} raised {one_line(e)} on a batch of {n} completions whose first "
                              f"example is {batch.where[0]}") from None
        return checked(name, out, batch)


def checked(name: str, out: Any, batch: Batch) -> list[float | None]:
    """A function's result as floats and Nones, or a RewardError naming it and the first bad completion."""
    n = len(batch.completions)
    values = out.tolist() if hasattr(out, "tolist") else out  # numpy arrays and tensors, as TRL accepts
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name} returned a {type(out).__name__}, not a list of {n} rewards "
                          f"(one number or None per completion)")
    if len(values) != n:
        raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions (one per "
                          f"completion; batch from {batch.where[0]})")
    for value, where in zip(values, batch.where):
        if value is not None and not isinstance(value, numbers.Real):  # bools count, as in TRL
            raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}) for a completion "
                              f"of {where}; a reward is a number or None")
        if value is not None and not math.isfinite(value):
            raise RewardError(f"reward function {name} returned {value} for a completion of {where}; a reward must "
                              f"be finite")
    return [None if v is None else float(v) for v in values]


class _Expired(BaseException):
    """The time limit's own interrupt: a BaseException, so a reward's `except Exception` does not swallow it."""


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the block once `seconds` pass (0, or outside the main thread: no limit).

    A timer thread sends the main thread SIGINT, which wakes a sleeping call, so the user's own SIGALRM timers
    (math-verify's) are left alone; C code that never returns to Python runs on. The block has its own SIGINT
    handler: a process started with SIGINT ignored (a background job of a script, some job schedulers) would
    otherwise never see the timer's signal. A real Ctrl-C in the block does what the previous handler does."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    fired, lock, armed = threading.Event(), threading.Lock(), [True]
    previous = signal.getsignal(signal.SIGINT)

    def fire() -> None:
        with lock:
            if armed[0]:
                fired.set()
                if hasattr(signal, "pthread_kill"):
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                else:  # Windows: calls the handler below at the main thread's next bytecode
                    _thread.interrupt_main()

    def on_sigint(signum: int, frame) -> None:
        if fired.is_set():
            if armed[0]:  # a signal that lands after the block ended is dropped: the call made it in time
                raise _Expired
        elif callable(previous):
            previous(signum, frame)  # Python's default handler raises KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        timer.start()
        try:
            yield
        finally:
            with lock:
                armed[0] = False
            timer.cancel()
    except _Expired:  # from the block or from its clean-up: either way the timer fired while it ran
        raise TimeoutError from None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
