"""`arith`: synthetic GSM8K-format word problems, generated from a seed; the embedded default task.

A problem is a chain of operations (+, -, x, exact /) on a running quantity: the generator takes 1-3 digit
operands and up to 6 operations; the registered default is 2-4 operations on 1-2 digit operands, the
difficulty at which the tiny CPU model learns the format in a few minutes of SFT yet still slips on
multi-digit products and carries (its pass@1 lands near 0.4). The reference solution
has one line per operation, `<a> <op> <b> = <value>`, then `#### <answer>`. Carries and multi-digit
products are where a small model slips, so credit assignment has specific steps to find.
"""

from __future__ import annotations

import hashlib
import random

from vineppo.tasks import Example, Task, register

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
N_SPLIT = {"train": 20000, "validation": 500, "test": 500}


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


def make_problem(rng: random.Random, min_ops: int = 2, max_ops: int = 4, digits: int = 2) -> Example:
    """One random problem with its reference solution and answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, 10**digits - 1)
    sentences = [rng.choice(START).format(name=name, n=value, item=item)]
    lines = []
    for _ in range(rng.randint(min_ops, max_ops)):
        for _try in range(10):
            op = rng.choice("+-*/")
            n = _operand(rng, op, value, digits)
            if n is not None:
                break
        else:
            op, n = "+", 1
        new = {"+": value + n, "-": value - n, "*": value * n, "/": value // max(n, 1)}[op]
        sentences.append(rng.choice(FORMS[op]).format(name=name, n=n, item=item))
        lines.append(f"{value} {op} {n} = {new}")
        value = new
    sentences.append(rng.choice(QUESTION).format(name=name, item=item))
    problem = " ".join(sentences)
    solution = "\n".join(lines) + f"\n#### {value}"
    return Example(id="", problem=problem, solution=solution, answer=str(value))


def split_of(problem: str) -> str:
    """The split a problem text belongs to, by a hash: the same text never lands in two splits."""
    h = int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16) % 100
    return "test" if h < 5 else "validation" if h < 10 else "train"


def load_arith(split: str, path: str | None = None, seed: int = 0, min_ops: int = 2, max_ops: int = 4,
               digits: int = 2, size: int | None = None) -> list[Example]:
    """`size` problems of `split` (default: 20000 train, 500 validation, 500 test, or --data's test_size=N)."""
    from vineppo.errors import UserError

    if path is not None:  # no file: --data carries the generator's knobs, e.g. "max_ops=6,digits=3"
        knobs = {"min_ops": min_ops, "max_ops": max_ops, "digits": digits, "test_size": 0}
        for item in filter(None, (x.strip() for x in path.split(","))):
            key, _, value = item.partition("=")
            if key not in knobs or not value.isdigit():
                raise UserError(f"task 'arith' is generated: --data takes knobs like 'min_ops=2,max_ops=6,digits=3', "
                                f"not {item!r}")
            knobs[key] = int(value)
        min_ops, max_ops, digits = knobs["min_ops"], knobs["max_ops"], knobs["digits"]
        if split == "test" and knobs["test_size"] and size is None:  # a larger test set starts with the default one
            size = knobs["test_size"]
        if not (1 <= min_ops <= max_ops and 1 <= digits <= 3):
            raise UserError(f"task 'arith': need 1 <= min_ops <= max_ops and 1 <= digits <= 3 (got {path!r})")
    if split not in N_SPLIT:
        raise UserError(f"task 'arith' has no split {split!r}; splits: {', '.join(N_SPLIT)}")
    want = N_SPLIT[split] if size is None else size
    rng = random.Random(f"arith-{seed}-{split}")
    seen: set[str] = set()
    out: list[Example] = []
    for _ in range(want * 100):
        ex = make_problem(rng, min_ops, max_ops, digits)
        if ex.problem in seen or split_of(ex.problem) != split:
            continue
        seen.add(ex.problem)
        out.append(Example(id=f"arith-{split}-{len(out)}", problem=ex.problem, solution=ex.solution,
                           answer=ex.answer))
        if len(out) == want:
            break
    return out


def _register() -> None:
    from vineppo.grading import extract_gsm8k, grade_gsm8k
    from vineppo.steps import split_newlines

    register(Task(name="arith", load=load_arith, grade=grade_gsm8k, split_steps=split_newlines, extract=extract_gsm8k))


_register()
