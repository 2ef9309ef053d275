"""arith with a stricter reward: the answer right AND every `a op b = c` line arithmetically right (exact
division), so a chain that reaches the answer through a wrong line (e.g. 68 * 4 = 252 ... / 89) earns 0."""
import dataclasses
import re
import sys

import vineppo.tasks as T
from vineppo.cli import main

LINE = re.compile(r"^\s*(\d+)\s*([-+*/])\s*(\d+)\s*=\s*(\d+)\s*$")
base = T.get_task("arith")
def lines_right(text):
    for line in text.split("\n"):
        m = LINE.match(line)
        if not m:
            continue
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        want = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op]
        if want != c:
            return False
    return True
def grade(text, answer):
    return base.grade(text, answer) if lines_right(text) else 0.0
T.register(dataclasses.replace(base, grade=grade))
sys.exit(main())
