"""The capital-pairs example's reward in TRL's form for chat data: each completion is a list holding one
assistant message, and the data's `capitals` column (the accepted names of each of the two capitals) by name."""

import re
import unicodedata


def words(text):
    """Lower-case words without accents or punctuation, space-separated, with a space at each end."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return " " + " ".join(re.findall(r"[a-z]+", plain.lower())) + " "


def names_both(prompts, completions, capitals, **kwargs):
    """1.0 when the reply names both capitals (any accepted spelling, as whole words), else 0.0."""
    return [1.0 if all(any(words(n) in words(completion[0]["content"]) for n in names) for names in pair) else 0.0
            for completion, pair in zip(completions, capitals)]
