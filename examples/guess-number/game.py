"""The guess-number example's environment: higher or lower, in the interface vineppo's `--env` takes.

`reset(row)` starts a game for the row's secret and says the rules; `step(text)` reads the number the model's turn
ends with and answers "higher", "lower", or ends the game (reward 1 when right). A turn without a number is answered
with the rules again and counts as a guess. The game is deterministic: rebuilt from its row and replayed with the
earlier turns, it is where it was, which VinePPO's continuations from a turn need.
"""

import re

RULES = "I am thinking of a whole number from 1 to 8. Guess it: reply with one number. I will say higher or lower."


class GuessNumber:
    deterministic = True  # rebuilt from its row and replayed, it is where it was

    def reset(self, row: dict) -> str:
        self.secret = int(row["secret"])
        return RULES

    def step(self, text: str):
        numbers = re.findall(r"\d+", text)
        if not numbers:
            return "Reply with one number from 1 to 8.", False
        guess = int(numbers[-1])
        if guess == self.secret:
            return "Right!", True, 1.0
        return ("Higher." if guess < self.secret else "Lower."), False
