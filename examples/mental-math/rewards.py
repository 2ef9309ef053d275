"""The mental-math example's reward in TRL's form: a batch of text completions, the data's columns by name."""

import re


def last_number(completions, answer, **kwargs):
    """1.0 when the last number of the reply is the answer, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion)
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards
