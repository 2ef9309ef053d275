"""Writes train.jsonl and test.jsonl of the mental-math example: every sum, difference and product of two digits
1-9 (differences not below 0), asked as one question; a problem's split is fixed by a hash of its text.

    python examples/mental-math/make_data.py
"""

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).parent


def problems() -> list[dict]:
    """Every question with its answer: 81 sums, 45 differences, 81 products."""
    out = []
    for a in range(1, 10):
        for b in range(1, 10):
            out.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
            if a >= b:
                out.append({"prompt": f"What is {a} - {b}?", "answer": str(a - b)})
            out.append({"prompt": f"What is {a} * {b}?", "answer": str(a * b)})
    return out


def split(row: dict) -> str:
    """test for about 30% of the questions, train for the rest, by a hash of the question."""
    return "test" if int(hashlib.sha256(row["prompt"].encode()).hexdigest()[:8], 16) % 10 < 3 else "train"


if __name__ == "__main__":
    rows = problems()
    for name in ("train", "test"):
        chosen = [r for r in rows if split(r) == name]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
        print(f"{name}: {len(chosen)} questions")
