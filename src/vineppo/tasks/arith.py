"""`arith`: synthetic GSM8K-format word problems, generated from a seed; the embedded default task.

A problem is a chain of operations (+, -, x, exact /) on a running quantity: the generator takes 1-3 digit
operands and up to 12 operations; the registered default is 2-4 operations on 1-2 digit operands, the
difficulty at which the tiny CPU model learns the format in a few minutes of SFT yet still slips on
multi-digit products and carries.

**Behaviours.** Each problem's reference solution is written in one of five styles, drawn from a hash of
the problem text (so every split holds the same problems whatever the mix, and a problem keeps its style):
- `careful`: one line per operation, `<a> <op> <b> = <value>`, then `#### <answer>`: the reliable way;
- `premature`: the lines of every operation but the last, then the value before the last operation as the
  answer (answering before the reasoning is finished; wrong unless the value was 0 before a product);
- `skip`: every operation told in a sentence that opens with "Then", except the last, is left out and the
  lines after it carry on from the value before it (a step dropped mid-chain; wrong but for rare coincidences). A problem with
  no such operation, or whose shortened chain would need an inexact division, is written carefully;
- `fused`: two operations per line, `(<a> <op> <b>) <op> <c> = <value>` (right, in fewer and harder lines);
- `bare`: the answer line alone (the whole chain done in the head).
`--data` sets the shares, e.g. `premature=0.5,skip=0.2`: naming any share replaces the default mix, and
careful takes the rest. `behaviour` labels a model's
response by what it did, whatever its arithmetic: the same five, plus `other` (a line that matches no
operation of the problem, a wrong order, no answer line).

**Why the default mix is premature 0.6, careful 0.4.** Real SFT data carry unreliable habits, and RL with
a verifiable reward mostly gains by selecting among behaviours the model already learned, not by new
skill. Trained on this mix, the model learns one choice, made at the point before the last operation:
write it out, or answer now. More than half of the references answer early there, so greedy decoding and
low temperatures choose the unreliable behaviour (they sharpen the majority choice) and the SFT model's
pass@1 is low although its careful samples are often right: their accuracy is the ceiling that selection
alone can reach. The careful form is common enough (40%) that every batch samples it. `premature=0` gives
the clean task, every reference careful (the task before behaviours existed), and `skip`, `fused`, `bare`
are there for studies of where credit goes (a wrong line among right ones) and for other mixes.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from vineppo.core.errors import UserError
from vineppo.core.grading import extract_gsm8k, grade_gsm8k
from vineppo.core.steps import split_newlines
from vineppo.tasks.base import Example, Task, register

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Milo", "Nora"]
ITEMS = ["apples", "coins", "stamps", "marbles", "books", "shells", "cards", "pencils", "stickers", "beads"]

START = ["{name} has {n} {item}.", "{name} starts with {n} {item}.", "There are {n} {item} in {name}'s box."]
FORMS = {
    "+": ["{name} gets {n} more {item}.", "Then {name} finds {n} more.", "A friend gives {name} another {n} {item}."],
    "-": ["{name} gives away {n} {item}.", "Then {name} loses {n} of them.", "{name} sells {n} {item}."],
    "*": ["The number of {item} is multiplied by {n}.", "Then {name} ends up with {n} times as many.",
          "{name} trades them for {n} times as many {item}."],
    "/": ["{name} splits the {item} into {n} equal piles and keeps one pile.",
          "Then the {item} are shared equally by {n} kids and {name} keeps one share.",
          "{name} keeps only one part out of {n} equal parts."],
}
QUESTION = ["How many {item} does {name} have now?", "How many {item} are left in the end?",
            "How many {item} does {name} end up with?"]
MAX_VALUE = 9999
MAX_OPS = 12  # the longest chain: a careful solution of 12 lines stays well inside the tiny model's 1024 positions
N_SPLIT = {"train": 20000, "validation": 500, "test": 500}
STYLES = ("careful", "premature", "skip", "fused", "bare")
BEHAVIOURS = STYLES + ("other",)
DEFAULT_MIX = {"premature": 0.6}  # the rest careful: see the module's docstring for why


@dataclass(frozen=True)
class Knobs:
    """The generator's settings (`--data "min_ops=2,max_ops=6,premature=0.5"`); unnamed styles have share 0."""

    min_ops: int = 2  # fewest operations in a problem
    max_ops: int = 4  # most operations (at most 12)
    digits: int = 2  # operand digits (1-3)
    test_size: int = 0  # problems in the test split (0: 500)
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))  # style -> share of the references; careful the rest


def parse_knobs(text: str | None) -> Knobs:
    """The knobs `--data` names (None or "": the defaults); a UserError names a bad knob."""
    if not text:
        return Knobs()
    ints = {"min_ops": 2, "max_ops": 4, "digits": 2, "test_size": 0}
    mix: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key in ints and value.isdigit():
            ints[key] = int(value)
        elif key in STYLES[1:] and re.fullmatch(r"\d*\.?\d+", value) and float(value) <= 1:
            mix[key] = float(value)
        else:
            raise UserError(f"task 'arith' is generated: --data takes knobs like 'min_ops=2,max_ops=6,digits=3,"
                            f"premature=0.5' ({', '.join(ints)} whole numbers; {', '.join(STYLES[1:])} shares "
                            f"in [0, 1]), not {item!r}")
    if not (1 <= ints["min_ops"] <= ints["max_ops"] <= MAX_OPS and 1 <= ints["digits"] <= 3):
        raise UserError(f"task 'arith': need 1 <= min_ops <= max_ops <= {MAX_OPS} and 1 <= digits <= 3 (got {text!r})")
    if sum(mix.values()) > 1 + 1e-9:
        raise UserError(f"task 'arith': the style shares add up to {sum(mix.values()):g} > 1 (got {text!r}); "
                        f"careful takes what the others leave")
    return Knobs(**ints, mix={k: v for k, v in (mix or DEFAULT_MIX).items() if v > 0})


def _operand(rng: random.Random, op: str, value: int, digits: int) -> int | None:
    """A random operand for `op` that keeps the running value a whole number in [0, MAX_VALUE], or None."""
    hi = 10**digits - 1
    if op == "+":
        return rng.randint(1, min(hi, MAX_VALUE - value)) if value < MAX_VALUE else None
    if op == "-":
        return rng.randint(1, min(hi, value)) if value >= 1 else None
    if op == "*":
        top = min(hi, MAX_VALUE // max(value, 1), 12 if value >= 10 else 99)
        return rng.randint(2, top) if top >= 2 else None
    divisors = [d for d in range(2, min(hi, value) + 1) if value % d == 0]
    return rng.choice(divisors) if divisors else None


def _apply(value: int, op: str, n: int) -> int | None:
    """value op n, or None for a division that is not exact."""
    if op == "/":
        return value // n if value % n == 0 else None
    return value + n if op == "+" else value - n if op == "-" else value * n


@dataclass(frozen=True)
class Chain:
    """A problem's arithmetic: the start value and its operations (op, operand, told with "Then")."""

    start: int
    ops: tuple[tuple[str, int, bool], ...]


def make_problem(rng: random.Random, min_ops: int = 2, max_ops: int = 4, digits: int = 2) -> tuple[str, Chain]:
    """One random problem text and its chain of operations (the random draws are those of every earlier version)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, 10**digits - 1)
    start = value
    sentences = [rng.choice(START).format(name=name, n=value, item=item)]
    ops = []
    for _ in range(rng.randint(min_ops, max_ops)):
        for _try in range(10):
            op = rng.choice("+-*/")
            n = _operand(rng, op, value, digits)
            if n is not None:
                break
        else:
            op, n = "+", 1
        form = rng.choice(FORMS[op])
        sentences.append(form.format(name=name, n=n, item=item))
        ops.append((op, n, form.startswith("Then")))
        value = _apply(value, op, n)
    sentences.append(rng.choice(QUESTION).format(name=name, item=item))
    return " ".join(sentences), Chain(start, tuple(ops))


def style_of(problem: str, mix: dict) -> str:
    """The style a problem's reference is written in: a hash of its text against the cumulative shares."""
    u = int(hashlib.sha256(f"style:{problem}".encode()).hexdigest()[:12], 16) / 16**12
    edge = 0.0
    for style in STYLES[1:]:
        edge += mix.get(style, 0.0)
        if u < edge:
            return style
    return "careful"


def solution(chain: Chain, style: str) -> str:
    """The reference solution of `chain` written in `style` (a skip that cannot apply falls back to careful)."""
    ops, value = chain.ops, chain.start
    if style == "bare":
        return f"#### {_run(chain.start, ops)}"
    if style == "fused":
        lines = []
        for k in range(0, len(ops), 2):
            (op1, n1, _), rest = ops[k], ops[k + 1:k + 2]
            mid = _apply(value, op1, n1)
            if not rest:
                lines.append(f"{value} {op1} {n1} = {mid}")
                value = mid
                continue
            op2, n2, _ = rest[0]
            new = _apply(mid, op2, n2)
            lines.append(f"({value} {op1} {n1}) {op2} {n2} = {new}")
            value = new
        return "\n".join(lines) + f"\n#### {value}"
    if style == "premature":
        ops = ops[:-1]
    elif style == "skip":
        kept = tuple(o for i, o in enumerate(ops) if not (o[2] and i < len(ops) - 1))
        if len(kept) == len(ops) or _run(chain.start, kept) is None:
            kept = ops
        ops = kept
    lines = []
    for op, n, _ in ops:
        new = _apply(value, op, n)
        lines.append(f"{value} {op} {n} = {new}")
        value = new
    return "\n".join(lines + [f"#### {value}"])


def _run(value: int, ops) -> int | None:
    """The value after `ops`, or None when a division on the way is not exact."""
    for op, n, _ in ops:
        value = _apply(value, op, n)
        if value is None:
            return None
    return value


def split_of(problem: str) -> str:
    """The split a problem text belongs to, by a hash: the same text never lands in two splits."""
    h = int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16) % 100
    return "test" if h < 5 else "validation" if h < 10 else "train"


def load_arith(split: str, path: str | None = None, seed: int = 0, size: int | None = None) -> list[Example]:
    """`size` problems of `split` (default: 20000 train, 500 validation, 500 test, or --data's test_size=N).

    `path` carries the generator's knobs (`parse_knobs`), not a file: the task is generated."""
    knobs = parse_knobs(path)
    if split not in N_SPLIT:
        raise UserError(f"task 'arith' has no split {split!r}; splits: {', '.join(N_SPLIT)}")
    if size is None:  # a larger test set starts with the default one
        size = knobs.test_size if split == "test" and knobs.test_size else N_SPLIT[split]
    rng = random.Random(f"arith-{seed}-{split}")
    seen: set[str] = set()
    out: list[Example] = []
    for _ in range(size * 100):
        problem, chain = make_problem(rng, knobs.min_ops, knobs.max_ops, knobs.digits)
        if problem in seen or split_of(problem) != split:
            continue
        seen.add(problem)
        out.append(Example(id=f"arith-{split}-{len(out)}", problem=problem,
                           solution=solution(chain, style_of(problem, knobs.mix)), answer=str(_run(chain.start,
                                                                                                  chain.ops))))
        if len(out) == size:
            break
    return out


# ------------------------------------------------------------------------------------ reading a response

_SENTENCES = [(op, form) for op, forms in FORMS.items() for form in forms]


def _pattern(form: str) -> re.Pattern:
    names, items = "|".join(NAMES), "|".join(ITEMS)
    text = re.escape(form).replace(r"\{name\}", f"(?:{names})").replace(r"\{item\}", f"(?:{items})")
    return re.compile(text.replace(r"\{n\}", r"(\d+)"))


_FORMS = [(op, form.startswith("Then"), _pattern(form)) for op, form in _SENTENCES]
_START = [_pattern(form) for form in START]
_LINE = re.compile(r"^\s*(\()?\s*(-?\d+)\s*([-+*/x])\s*(-?\d+)\s*(?(1)\)\s*([-+*/x])\s*(-?\d+))\s*=\s*(-?\d+)\s*$")
_FINAL = re.compile(r"^\s*####")


def chain_of(problem: str) -> Chain | None:
    """The chain of operations a problem text states (None when it is not an `arith` problem)."""
    sentences = re.findall(r"[^.?]+[.?]", problem)
    if len(sentences) < 2:
        return None
    first = next((m for p in _START if (m := p.fullmatch(sentences[0].strip()))), None)
    if first is None:
        return None
    ops = []
    for sentence in sentences[1:-1]:
        hit = next(((op, then, m) for op, then, p in _FORMS if (m := p.fullmatch(sentence.strip()))), None)
        if hit is None:
            return None
        ops.append((hit[0], int(hit[2][1]), hit[1]))
    return Chain(int(first[1]), tuple(ops))


def behaviour(example: Example, response: str) -> str:
    """Which way a response went about its problem (one of BEHAVIOURS), by its lines' operations, not their sums."""
    chain = chain_of(example.problem)
    lines = [line for line in response.strip().split("\n") if line.strip()]
    final = [i for i, line in enumerate(lines) if _FINAL.match(line)]
    if chain is None or not final or final[0] != len(lines) - 1:
        return "other"
    parsed = [_LINE.match(line) for line in lines[:-1]]
    if any(m is None for m in parsed):
        return "other"
    if not parsed:
        return "bare"
    said = []  # the (op, operand) pairs the lines carry out, in order
    for m in parsed:
        said.append((m[3].replace("x", "*"), int(m[4])))
        if m[1]:
            said.append((m[5].replace("x", "*"), int(m[6])))
    wanted = [(op, n) for op, n, _ in chain.ops]
    fused = any(m[1] for m in parsed)
    if said == wanted:
        return "fused" if fused else "careful"
    left_out = _left_out(said, wanted)
    if fused or left_out is None:
        return "other"
    return "premature" if left_out == list(range(len(wanted) - len(left_out), len(wanted))) else "skip"


def first_wrong_line(example: Example, response: str) -> tuple[int, str] | None:
    """(index among the non-blank lines, kind) of the first line where a response departs from a right solution of
    its problem, or None when every line is right. Kinds: 'premature' (the `####` line comes before the last
    operation), 'skip' (a line carries out a later operation, leaving the next one out), 'slip' (a line's
    operation and operands are right, its result is not), 'other' (anything else: a wrong copy, a fused or
    unparsable line, an extra line, a wrong final answer after right lines, no answer line)."""
    chain = chain_of(example.problem)
    lines = [line for line in response.split("\n") if line.strip()]
    if chain is None:
        return (0, "other") if lines else None
    value, done = chain.start, 0  # the running value and the operations carried out so far
    for j, line in enumerate(lines):
        if _FINAL.match(line):
            if done < len(chain.ops):
                return j, "premature"
            return None if line.split("####", 1)[1].strip().replace(",", "") == str(value) else (j, "other")
        m = _LINE.match(line)
        if m is None or m[1] or done == len(chain.ops):
            return j, "other"
        a, op, n, result = int(m[2]), m[3].replace("x", "*"), int(m[4]), int(m[7])
        if (op, n) != chain.ops[done][:2]:
            return j, "skip" if (op, n) in [o[:2] for o in chain.ops[done + 1:]] else "other"
        if a != value:
            return j, "other"
        if result != _apply(a, op, n):
            return j, "slip"
        value, done = result, done + 1
    return max(len(lines) - 1, 0), "other"


def _left_out(said: list, wanted: list) -> list[int] | None:
    """The indices of `wanted` that `said` leaves out when it is a subsequence of it (matched greedily), else None."""
    out, j = [], 0
    for i, item in enumerate(wanted):
        if j < len(said) and said[j] == item:
            j += 1
        else:
            out.append(i)
    return out if j == len(said) else None


register(Task(name="arith", preset="arith-tiny", load=load_arith, grade=grade_gsm8k, split_steps=split_newlines, extract=extract_gsm8k,
              behaviour=behaviour, behaviours=BEHAVIOURS))
