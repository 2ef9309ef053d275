"""The capitals example's rewards in TRL's form for chat data: each completion is a list holding one assistant
message, and the data's `capital` column (the accepted names) comes by name."""

import re
import unicodedata


def words(text):
    """Lower-case words without accents or punctuation, space-separated, with a space at each end."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return " " + " ".join(re.findall(r"[a-z]+", plain.lower())) + " "


def names_the_capital(prompts, completions, capital, **kwargs):
    """1.0 when the reply names the capital (any accepted spelling, as whole words), else 0.0."""
    return [1.0 if any(words(name) in words(completion[0]["content"]) for name in names) else 0.0
            for completion, names in zip(completions, capital)]


def brief(completions, **kwargs):
    """1.0 for a reply of at most three words (the city's name alone, as the system turn asks), 0.1 less for each
    word more, 0.0 from thirteen words on."""
    return [min(1.0, max(0.0, (13 - len(completion[0]["content"].split())) / 10)) for completion in completions]
