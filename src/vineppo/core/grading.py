"""Graders: reward 1.0 for a correct final answer, 0.0 otherwise; they never raise.

GSM8K/arith compare the number after the last `####`. MATH compares the last `\\boxed{}` with the reference:
first by string equality after a light normalisation (most correct answers stop there), then by
`math-verify` (numeric and symbolic equivalence) in a persistent worker process that is killed and
restarted when a call runs past the time limit. math-verify's own timeouts use SIGALRM, which works only
in a main thread and cannot interrupt sympy stuck in C code; a separate process can always be killed.

Extractors (`extract_gsm8k`, `extract_math`) return the answer a grader would compare, or None when it
finds none: whether a response is parsable at all, right or wrong.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Protocol

MATH_TIMEOUT = 5.0  # seconds per grade_math call, hard
MAX_ANSWER_CHARS = 2000  # longer boxed answers are compared as strings only: no real answer is that long
STARTUP_TIMEOUT = 120.0  # a fresh worker imports sympy; on a loaded machine that takes a while

# ---------------------------------------------------------------------------------------------- GSM8K

_GSM_ANSWER = re.compile(r"####([^\n]*)")
# `$` and sign, digits with optional thousands commas, optional decimals; then a short unit, no digits.
_GSM_NUMBER = re.compile(r"\s*\$?\s*(-?\s*\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*([^\d]{0,20})$")


def parse_number(text: str) -> Decimal | None:
    """The number in a GSM8K answer line (`$1,000.`, `-5`, `12.0`, `18 dollars`), or None."""
    m = _GSM_NUMBER.match(text)
    if not m:
        return None
    tail = m.group(2).strip()
    # A trailing period, `%` or a unit word is fine; anything else (an operator, a second clause) is not.
    if tail and not re.fullmatch(r"%?\.?|[A-Za-z][A-Za-z ]*\.?", tail):
        return None
    try:
        return Decimal(m.group(1).replace(",", "").replace("$", "").replace(" ", ""))
    except InvalidOperation:
        return None


class Sample(Protocol):
    """What grading reads of a sampled continuation (vineppo.engine.Sample is one; grading sits below the engine)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    dialogue: Any  # a dialogue's turns: its `messages` are what rewards read, its `reward` the environment's (or None)


# A scorer: one reward (None: none) per completion of items[i] (a task's examples), in one call: Task.score.
Scorer = Callable[[list[Any], list[str], list[list[int]]], list["float | None"]]


def outcome_reward(grade: Callable[[str, str], float], text: str, answer: str, finish_reason: str) -> float:
    """A per-answer grader's reward (eval's lenient score): the grade of a response that stopped; 0 if cut off."""
    return grade(text, answer) if finish_reason == "stop" else 0.0


def outcome_rewards(score: Scorer, items: list[Any], samples: list[Sample], texts: list | None = None,
                    token_ids: list[list[int]] | None = None) -> list[float | None]:
    """The method's rewards of many samples (samples[i] answers items[i]): the finished ones scored in one call, the
    ones cut off by the token limit 0. `texts` and `token_ids` replace the samples' own (a continuation with its
    response prefix). A dialogue is scored on its messages, and an environment's reward is the reward."""
    texts = [completion(s, s.text) for s in samples] if texts is None else texts
    token_ids = [list(s.token_ids) for s in samples] if token_ids is None else token_ids
    given = [s.dialogue.reward if s.dialogue is not None else None for s in samples]
    done = [i for i, s in enumerate(samples) if s.finish_reason == "stop" and given[i] is None]
    scored = score([items[i] for i in done], [texts[i] for i in done], [token_ids[i] for i in done]) if done else []
    out: list[float | None] = [given[i] if s.finish_reason == "stop" and given[i] is not None else 0.0
                               for i, s in enumerate(samples)]  # the scored ones are filled in below
    for i, r in zip(done, scored):
        out[i] = r
    return out


class Conversation(list):
    """A dialogue's messages as reward functions read them, and the environment instance that played it (`env`: what
    TRL's reward functions receive as `environments`)."""

    env: Any = None


def completion(sample: Sample, text: str) -> Any:
    """What a reward reads of a sample: a dialogue's messages (tool and environment turns included), else `text`."""
    if sample.dialogue is None:
        return text
    messages = Conversation(sample.dialogue.messages)
    messages.env = sample.dialogue.env
    return messages


def continuation_rewards(score: Scorer, tokenizer, prefix_ids: list[int], samples: list[Sample],
                         item: Any) -> list[float | None]:
    """The rewards of a response prefix (token ids) followed by each continuation, each graded as one decoded text.

    The joined tokens are decoded, not the decoded texts joined: a tokenizer may decode a token differently
    at the start of a text (SentencePiece drops the space of a leading "▁word"), so the texts need not join.
    """
    ids = [list(prefix_ids) + list(s.token_ids) for s in samples]
    texts = [completion(s, tokenizer.decode(x, skip_special_tokens=True)) for s, x in zip(samples, ids)]
    return outcome_rewards(score, [item] * len(samples), samples, texts, ids)


def extract_gsm8k(completion: str) -> str | None:
    """The answer after the last `####` when it is a number the grader can read, else None."""
    found = _GSM_ANSWER.findall(completion)
    if not found or parse_number(found[-1]) is None:
        return None
    return found[-1].strip()


def grade_gsm8k(completion: str, answer: str) -> float:
    """1.0 when the number after the last `####` equals the reference number (commas, `$`, final `.` ignored)."""
    try:
        got, want = extract_gsm8k(completion), parse_number(answer)
        return float(got is not None and want is not None and parse_number(got) == want)
    except Exception:  # a grader never raises: a reward of 0 is the answer to anything unexpected
        return 0.0


# ----------------------------------------------------------------------------------------------- MATH

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE = re.compile(r"\\.|[{}]", re.S)
_OPEN = re.compile(r"\s*\{")
_BARE = re.compile(r" \s*([^\s$]+)")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed x`) brace-balanced, or None."""
    last = None
    for last in _BOXED.finditer(text):
        pass
    if last is None:
        return None
    m = _OPEN.match(text, last.end())
    if m:
        depth = 0
        for b in _BRACE.finditer(text, m.end() - 1):
            if b.group() == "{":
                depth += 1
            elif b.group() == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end() : b.start()]
        return None  # unbalanced: a truncated answer is no answer
    m = _BARE.match(text, last.end())  # `\boxed 5`: the argument runs to the next space or `$`
    return m.group(1) if m else None


_NORMALISE = [
    (re.compile(r"\\left|\\right|\\[!,;:]|\\ |\s+|\$"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\{?\\circ\}?"), ""),
    (re.compile(r"\\%|%"), ""),
    (re.compile(r"\\text\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\\mbox\{([^{}]*)\}"), r"\1"),
]


def normalise_answer(text: str) -> str:
    """A light, safe normalisation for string comparison: spacing, `\\left`/`\\right`, `\\dfrac`, degrees, `%`."""
    for pattern, repl in _NORMALISE:
        text = pattern.sub(repl, text)
    return text.rstrip(".")


def _plain_number(text: str) -> Decimal | None:
    if not re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+", text):
        return None
    return Decimal(text.replace(",", ""))


class _Verifier:
    """A math-verify worker process behind a pipe; killed and replaced when a call overruns its limit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def _start(self) -> None:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # so the worker finds vineppo even without an install
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from vineppo.core.grading import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            text=True, encoding="utf-8", bufsize=1)
        self.ready = False
        self.pid = os.getpid()

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _readline(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def equal(self, pred: str, gold: str, timeout: float) -> bool:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None or self.pid != os.getpid():
                self._start()
            try:
                if not self.ready:
                    # Startup is not part of the per-call limit, but it has its own.
                    if self._readline(STARTUP_TIMEOUT) != "ready\n":
                        self._kill()
                        return False
                    self.ready = True
                inner = max(1, int(timeout) - 1)  # math-verify's own alarm, so most slow calls end gracefully
                self.proc.stdin.write(json.dumps([pred, gold, inner]) + "\n")
                self.proc.stdin.flush()
                reply = self._readline(timeout)
            except (OSError, ValueError):
                reply = None
            if reply in ("1\n", "0\n"):
                return reply == "1\n"
            self._kill()
            self._start()  # start the replacement now so its import overlaps with the caller's work
            return False

    def close(self) -> None:
        with self.lock:
            self._kill()


_VERIFIER = _Verifier()
atexit.register(_VERIFIER.close)


def _serve() -> None:
    """Worker loop: read `[pred, gold, timeout]` lines, answer `1` or `0` lines."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; it kills us when it exits
    logging.disable(logging.CRITICAL)
    from math_verify import parse, verify  # math-verify's worker: only this subprocess imports it

    reply = sys.stdout
    sys.stdout = sys.stderr  # a library's stray print must not be read as an answer
    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        try:
            pred, gold, t = json.loads(line)
            ok = verify(parse("\\boxed{" + gold + "}", parsing_timeout=t),
                        parse("\\boxed{" + pred + "}", parsing_timeout=t), timeout_seconds=t)
        except BaseException:  # noqa: BLE001 - anything at all is a wrong answer, never a dead worker
            ok = False
        print("1" if ok else "0", file=reply, flush=True)


def math_equal(pred: str, gold: str, timeout: float = MATH_TIMEOUT) -> bool:
    """Whether two LaTeX answers are equal: normalised strings, plain numbers, then math-verify (time-limited)."""
    p, g = normalise_answer(pred), normalise_answer(gold)
    if p == g:
        return True
    pn, gn = _plain_number(p), _plain_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    if not p or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    return _VERIFIER.equal(pred, gold, timeout)


def extract_math(completion: str) -> str | None:
    """The content of the last `\\boxed{}` when there is a non-empty one, else None."""
    got = last_boxed(completion)
    return got if got is not None and got.strip() else None


def grade_math(completion: str, answer: str, timeout: float = MATH_TIMEOUT) -> float:
    """1.0 when the last `\\boxed{}` of the completion equals the reference answer (math-verify, hard time limit)."""
    try:
        got = last_boxed(completion)
        return float(got is not None and math_equal(got, answer, timeout))
    except Exception:  # a grader never raises
        return 0.0


# -------------------------------------------------------------------------------------- lenient reading
# A diagnosis for `vineppo eval` only (did the model know the answer but write it in another form?): the
# reward, and every reported pass@1 without "lenient" in its name, stays the strict grader above.

_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]+)", re.I)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def lenient_answer(text: str) -> str | None:
    """The final answer read leniently: the last `####` line, else the last `\\boxed{}`, else what follows the
    last "the answer is", else the last number; `$` and a final period removed."""
    readings = ([a for a in _GSM_ANSWER.findall(text) if a.strip()], [b for b in [last_boxed(text)] if b],
                _ANSWER_IS.findall(text), _NUMBER.findall(text))
    for found in readings:
        if found:
            return found[-1].replace("$", "").strip().rstrip(".").strip()
    return None


def lenient_gsm8k(completion: str, answer: str) -> float:
    """1.0 when the first number of the leniently read answer equals the reference number."""
    try:
        got = _NUMBER.search(lenient_answer(completion) or "")
        want = parse_number(answer)
        return float(got is not None and want is not None and Decimal(got.group().replace(",", "")) == want)
    except Exception:  # like a grader, never raises
        return 0.0


def lenient_math(completion: str, answer: str, timeout: float = MATH_TIMEOUT) -> float:
    """1.0 when the leniently read answer equals the reference (the same comparison as `grade_math`)."""
    try:
        got = lenient_answer(completion)
        return float(bool(got) and math_equal(got, answer, timeout))
    except Exception:  # like a grader, never raises
        return 0.0
