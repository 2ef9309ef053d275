"""Writes train.jsonl and test.jsonl of the calculator example: products of a three-digit and a two-digit number,
too large to work out in the head of a 135M model, with their answers; drawn with a fixed seed. Each prompt opens
with one worked call of the tool (DEMO): without it the released SmolLM2-135M-Instruct never writes the call
(0 of 300 replies on the test set), and with reward 0 on every sample no method can learn. test-questions.jsonl
holds the test questions alone, for the worked dialogue of demo.json (`--demo`) instead of the text.

    python examples/calculator/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
DEMO = ("Use the calculator tool for the multiplication. For example, for 12 * 34 you write <calc>12 * 34</calc>, "
        "read <result>408</result> and answer 408. ")


def rows(n: int, rng: random.Random) -> list[dict]:
    """n questions and answers."""
    out = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        out.append({"prompt": f"{DEMO}What is {a} * {b}?", "answer": str(a * b)})
    return out


if __name__ == "__main__":
    rng = random.Random(0)
    for name, n in (("train", 400), ("test", 60)):
        made = rows(n, rng)
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in made))
        print(f"{name}: {n} questions")
    alone = [{**r, "prompt": r["prompt"].removeprefix(DEMO)} for r in made]  # the test questions without DEMO
    (HERE / "test-questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alone))
