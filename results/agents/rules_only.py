"""The guess-number game as first written, for the released model's filed replies to it
(release-guess-number-rules-only.jsonl): the rules alone, no game played out, and a turn that ends only at the
model's end-of-turn token or the token limit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "guess-number"))  # the example's game

from game import GuessNumber  # noqa: E402 - after the path that finds it

RULES = "I am thinking of a whole number from 1 to 8. Guess it: reply with one number. I will say higher or lower."


class RulesOnly(GuessNumber):
    stop = ()

    def reset(self, row: dict) -> str:
        super().reset(row)
        return RULES
