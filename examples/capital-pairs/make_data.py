"""Writes train.jsonl and test.jsonl of the capital-pairs example: one user turn that asks for the capitals of two
countries, and each capital's accepted names. The countries are the capitals example's; the test pairs are new
pairs of countries that the training pairs also hold, so what training can carry over is each country's capital.

    python examples/capital-pairs/make_data.py
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "capitals"))
from make_data import CAPITALS  # noqa: E402  (the capitals example's table, one source for both examples)

N_TRAIN, N_TEST = 400, 60


def chat(first: str, second: str) -> dict:
    """One example: the question, and the accepted names of the two capitals in the order asked (a list column)."""
    question = f"What is the capital of {first}, and what is the capital of {second}?"
    return {"messages": [{"role": "user", "content": question}],
            "capitals": [CAPITALS[first].split("|"), CAPITALS[second].split("|")]}


def pairs(seed: int = 0) -> list[tuple[str, str]]:
    """N_TRAIN + N_TEST distinct ordered pairs of different countries, drawn with a fixed seed."""
    rng, names, seen = random.Random(seed), sorted(CAPITALS), set()
    while len(seen) < N_TRAIN + N_TEST:
        seen.add(tuple(rng.sample(names, 2)))
    return sorted(seen, key=lambda p: rng.random())


if __name__ == "__main__":
    drawn = pairs()
    for name, chosen in (("train", drawn[:N_TRAIN]), ("test", drawn[N_TRAIN:])):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(chat(a, b)) + "\n" for a, b in chosen))
        print(f"{name}: {len(chosen)} pairs")
