"""Graders: reward 1.0 for a correct final answer, 0.0 otherwise; they never raise."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*([^\n]*)")


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        return float(text)
    except ValueError:
        return None


def grade_gsm8k(completion: str, answer: str) -> float:
    """1.0 when the number after the last `####` equals the reference number (commas, `$`, final `.` ignored)."""
    found = _ANSWER.findall(completion)
    if not found:
        return 0.0
    got, want = _number(found[-1]), _number(answer)
    return float(got is not None and want is not None and got == want)
