"""The guess-number example's environment: higher or lower, in the interface vineppo's `--env` takes.

`reset(row)` starts a game for the row's secret and says the rules, with one game played out as an example (without
it the released SmolLM2-135M-Instruct restates the rules as its own instead of guessing); `step(text)` reads the
number the model's turn ends with and answers "Higher.", "Lower.", or ends the game (reward 1 when right). A turn
ends at a line break (`stop`): a move is one line, and what the model writes after it (the model tends to play the
whole game out, both sides) is not its move. A turn without a number is answered with a reminder and counts as a
guess. The game is deterministic: rebuilt from its row and replayed with the earlier turns, it is where it was,
which VinePPO's continuations from a turn need.
"""

import re

RULES = ("I am thinking of a whole number from 1 to 8. You guess it: reply with one number. I will say higher or "
         "lower, until you get it. A game, where my number was 6:\nYou: 4\nMe: Higher.\nYou: 7\nMe: Lower.\nYou: 6\n"
         "Me: Right!\nNow I have a new number. Your guess?")


class GuessNumber:
    deterministic = True  # rebuilt from its row and replayed, it is where it was
    stop = ("\n",)  # a move is one line

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
