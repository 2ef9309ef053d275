"""The regimes study's multi-turn condition: the guess-number game over 1 to 32, where an outcome needs five turns or
more. `reset(row)` says the rules with one game played out (five guesses halving the range, as the guess-number
example shows its game: without one the released SmolLM2-135M-Instruct restates the rules instead of guessing);
`step(text)` reads the number the turn ends with and answers "Higher.", "Lower." or ends the game (reward 1 when
right). A turn ends at a line break; a turn without a number gets a reminder and counts as a guess.

**Mechanism.** Halving play needs five guesses for most numbers of 1 to 32 (every one within five), and play that
does not halve needs more: the reward comes after five turns or more, and a dialogue that loses loses because of
turns in its middle that ignored an answer. A reward for the whole dialogue credits every guess of a game alike;
VinePPO's states at every turn start, whose continuations replay the game, can credit the turns that moved the
right way. Deterministic (rebuilt from its row and replayed, it is where it was), as those continuations need.
"""

import json
import random
import re
from pathlib import Path

HIGH = 32
RULES = ("I am thinking of a whole number from 1 to 32. You guess it: reply with one number. I will say higher or "
         "lower, until you get it. A game, where my number was 21:\nYou: 16\nMe: Higher.\nYou: 24\nMe: Lower.\n"
         "You: 20\nMe: Higher.\nYou: 22\nMe: Lower.\nYou: 21\nMe: Right!\nNow I have a new number. Your guess?")


class GuessWide:
    deterministic = True  # rebuilt from its row and replayed, it is where it was
    stop = ("\n",)  # a move is one line

    def reset(self, row: dict) -> str:
        self.secret = int(row["secret"])
        return RULES

    def step(self, text: str):
        numbers = re.findall(r"\d+", text)
        if not numbers:
            return f"Reply with one number from 1 to {HIGH}.", False
        guess = int(numbers[-1])
        if guess == self.secret:
            return "Right!", True, 1.0
        return ("Higher." if guess < self.secret else "Lower."), False


if __name__ == "__main__":  # python results/regimes/game.py: writes the game's train and test files beside it
    here = Path(__file__).parent
    rng = random.Random(0)
    for name, n in (("game-train", 320), ("game-test", 64)):
        rows = [{"prompt": "Let us play a guessing game.", "secret": rng.randint(1, HIGH)} for _ in range(n)]
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
