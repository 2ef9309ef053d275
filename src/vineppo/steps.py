"""Step splitting: cut a response into reasoning steps whose concatenation is exactly the response."""

from __future__ import annotations


def split_newlines(text: str) -> list[str]:
    """GSM8K-style steps: one per line (newline kept with its line); leading empty lines join the first step."""
    pieces = text.splitlines(keepends=True)
    steps: list[str] = []
    for piece in pieces:
        if steps and not steps[-1].strip():
            steps[-1] += piece
        else:
            steps.append(piece)
    return steps or [text]
