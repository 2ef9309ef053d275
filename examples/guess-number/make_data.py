"""Writes train.jsonl and test.jsonl of the guess-number example: a prompt that opens the game, and the secret
number (1 to 8) in a `secret` column the environment reads; drawn with a fixed seed.

    python examples/guess-number/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
PROMPT = "Let us play a guessing game."

if __name__ == "__main__":
    rng = random.Random(0)
    for name, n in (("train", 200), ("test", 64)):
        rows = [{"prompt": PROMPT, "secret": rng.randint(1, 8)} for _ in range(n)]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {n} games")
