"""Step splitting: cut a response into reasoning steps whose concatenation is exactly the response.

Splitters only choose cut positions in the original string, so `"".join(steps) == text` holds by
construction. They always return at least one step (`[""]` for an empty response), so end-of-sequence
tokens always have a step to belong to. Also here: mapping steps to token index ranges.
"""

from __future__ import annotations

import bisect
import re
from typing import Callable

from vineppo.core.errors import UserError

# ------------------------------------------------------------------------------------ GSM8K: newlines

_LINE = re.compile(r"[^\n]*\n|[^\n]+")


def split_newlines(text: str) -> list[str]:
    """GSM8K-style steps: one per line; blank lines join the next line, the `#### answer` line joins the last step."""
    steps: list[str] = []
    carry = ""  # blank lines waiting for a line with content
    for line in _LINE.findall(text):
        if not line.strip():
            carry += line
        elif steps and line.lstrip().startswith("####"):
            steps[-1] += carry + line
            carry = ""
        else:
            steps.append(carry + line)
            carry = ""
    if carry:
        if steps:
            steps[-1] += carry
        else:
            steps.append(carry)
    return steps or [text]


# ------------------------------------------------------------------- `--steps`: splitters for any text

STEPS_HELP = "lines, paragraphs, sentences, tokens:N, regex:PATTERN (a step ends after each match) or turns (a dialogue's turns)"
_LINE_END = re.compile(r"\n")
_PARAGRAPH = re.compile(r"\n[ \t\r]*\n(?:[ \t\r]*\n)*")  # a blank-line run ends a paragraph
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n+")  # sentence punctuation and its spaces, or a line break


def split_at(text: str, pattern: re.Pattern) -> list[str]:
    """Steps that end after each non-empty match of `pattern`; a piece of blanks joins the next step."""
    cuts = [m.end() for m in pattern.finditer(text) if m.end() > m.start()]
    steps: list[str] = []
    carry = ""  # whitespace-only pieces waiting for one with content
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        piece = carry + text[a:b]
        carry = piece if not piece.strip() else ""
        if piece.strip():
            steps.append(piece)
    if carry:
        steps = steps[:-1] + [steps[-1] + carry] if steps else [carry]
    return steps or [text]


def make_splitter(spec: str) -> Callable[[str], list[str]]:
    """The splitter `--steps` names (tokens:N splits in the trainer, by token count: here one step); a UserError
    names --steps for anything else."""
    kind, _, arg = spec.partition(":")
    if spec in ("lines", "paragraphs", "sentences"):
        pattern = {"lines": _LINE_END, "paragraphs": _PARAGRAPH, "sentences": _SENTENCE_END}[spec]
        return lambda text: split_at(text, pattern)
    if (kind == "tokens" and arg.isdigit() and int(arg) >= 1) or spec == "turns":  # cut by the trainer, not the text
        return lambda text: [text]
    if kind == "regex" and arg:
        try:
            pattern = re.compile(arg)
        except re.error as e:
            raise UserError(f"--steps {spec!r}: bad regular expression: {e}") from None
        return lambda text: split_at(text, pattern)
    raise UserError(f"--steps {spec!r}: use {STEPS_HELP}")


def token_steps(spec: str) -> int:
    """N for `--steps tokens:N` (a step every N response tokens), else 0 (steps come from the text)."""
    kind, _, arg = spec.partition(":")
    return int(arg) if kind == "tokens" and arg.isdigit() else 0


def every_n_tokens(n_tokens: int, n: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of N tokens each (the last one shorter), at least one range."""
    return [(s, min(s + n, n_tokens)) for s in range(0, n_tokens, n)] or [(0, 0)]


# ---------------------------------------------------------------------------------------- MATH style

MIN_STEP_CHARS = 20  # shorter pieces without a closing period merge into the next
MAX_STEP_CHARS = 100  # longer pieces are split near their middle
MIN_HALF_CHARS = 30  # ... but only where both halves keep at least this many characters

# Openers of regions that are never cut; `\\.` skips escapes such as `\$`.
_OPEN = re.compile(r"\$\$|\$|\\\[|\\\(|\\begin\{([^{}\n]*)\}|\[asy\]|\\.", re.S)
_CLOSE = {"$$": re.compile(r"\\.|\$\$", re.S), "$": re.compile(r"\\.|\$|\n\s*\n", re.S),
          "\\[": re.compile(r"\\\]"), "\\(": re.compile(r"\\\)|\n\s*\n"), "[asy]": re.compile(r"\[/asy\]")}


def math_spans(text: str) -> list[tuple[int, int]]:
    """The [start, end) spans of math in `text`: `$..$`, `$$..$$`, `\\[..\\]`, `\\(..\\)`, environments, `[asy]`.

    An unclosed region runs to the end of the text; an unclosed inline one (`$`, `\\(`) to the next blank line,
    since LaTeX allows no paragraph break inside inline math.
    """
    spans = []
    i = 0
    while (m := _OPEN.search(text, i)) is not None:
        tok = m.group()
        if tok.startswith("\\begin"):
            end = _env_end(text, m.end(), m.group(1))
        elif tok in _CLOSE:
            end = _close_end(text, m.end(), tok)
        else:  # an escaped character
            i = m.end()
            continue
        spans.append((m.start(), end))
        i = max(end, m.end())
    return spans


def _close_end(text: str, pos: int, opener: str) -> int:
    closer = _CLOSE[opener]
    while (c := closer.search(text, pos)) is not None:
        if c.group().startswith("\n"):  # paragraph break: inline math ends unclosed before it
            return c.start()
        if c.group()[0] != "\\" or opener in ("\\[", "\\(", "[asy]"):
            return c.end()
        pos = c.end()
    return len(text)


def _env_end(text: str, pos: int, name: str) -> int:
    """End of `\\end{name}` matching a `\\begin{name}` whose header ends at `pos` (same-name nesting counted)."""
    tag = re.compile(r"\\(begin|end)\{" + re.escape(name) + r"\}")
    depth = 1
    for t in tag.finditer(text, pos):
        depth += 1 if t.group(1) == "begin" else -1
        if depth == 0:
            return t.end()
    return len(text)


def _inside(spans: list[tuple[int, int]], starts: list[int], pos: int) -> bool:
    """Whether a cut at `pos` falls strictly inside a math span."""
    k = bisect.bisect_right(starts, pos - 1) - 1  # last span starting before pos
    return k >= 0 and spans[k][0] < pos < spans[k][1]


# A sentence end: `.`/`?`/`!` (maybe just before a closing `$`, as in `x = 3.$`), whitespace, a capital.
_SENTENCE = re.compile(r"[.!?](?:\$\$|\$|\\\]|\\\))?[ \t\r\n]+(?=[A-Z])")
_NEWLINES = re.compile(r"\n(?:[ \t\r]*\n)*")  # a run of line breaks cuts once, after the last
_ENDS_SENTENCE = re.compile(r"[.!?](?:\$\$|\$|\\\]|\\\))?\s*$")
_SOFT = re.compile(r",\s+|:\s+|(?<=\s)and\s")  # where a long piece may be split, in order of preference
_HARD = re.compile(r"=\s*|\+\s*")  # used only when no soft point works


def _tiny(piece: str) -> bool:
    body = piece.strip()
    return not body or (len(body) < MIN_STEP_CHARS and not _ENDS_SENTENCE.search(piece))


def _split_long(text: str, a: int, b: int, ok) -> list[int]:
    """Cut positions that split text[a:b] near its middle, recursively, while it is longer than MAX_STEP_CHARS."""
    if b - a <= MAX_STEP_CHARS:
        return []
    mid = (a + b) / 2
    for pattern in (_SOFT, _HARD):
        cuts = [m.end() if pattern is _HARD or m.group()[0] in ",:" else m.start()
                for m in pattern.finditer(text, a, b)]
        cuts = [c for c in cuts if c - a >= MIN_HALF_CHARS and b - c >= MIN_HALF_CHARS and ok(c)]
        if cuts:
            c = min(cuts, key=lambda c: abs(c - mid))
            return _split_long(text, a, c, ok) + [c] + _split_long(text, c, b, ok)
    return []


def split_math(text: str) -> list[str]:
    """MATH-style steps: cut at sentence ends and newlines outside math, merge tiny pieces, halve long ones."""
    spans = math_spans(text)
    starts = [s for s, _ in spans]

    def ok(pos: int) -> bool:
        return 0 < pos < len(text) and not _inside(spans, starts, pos)

    cuts = {m.end() for m in _NEWLINES.finditer(text)} | {m.end() for m in _SENTENCE.finditer(text)}
    bounds = [0] + sorted(c for c in cuts if ok(c)) + [len(text)]

    # Merge tiny pieces into the next one; a tiny last piece joins the one before.
    merged = [0]
    for end in bounds[1:]:
        if _tiny(text[merged[-1] : end]) and end != len(text):
            continue
        merged.append(end)
    if len(merged) > 2 and _tiny(text[merged[-2] : merged[-1]]):
        del merged[-2]

    final = [0]
    for a, b in zip(merged, merged[1:]):
        final += _split_long(text, a, b, ok) + [b]
    return [text[a:b] for a, b in zip(final, final[1:])] or [text]


# ------------------------------------------------------------------------------------- steps -> tokens


def step_token_ranges(step_texts: list[str], token_char_offsets: list[int]) -> list[tuple[int, int]]:
    """Token index ranges [start, end) per step, from each token's starting character offset in the response.

    A token belongs to the step that contains its first character; tokens starting at or past the end of the
    text (EOS) belong to the last step. Every token is in exactly one range and the ranges tile
    [0, len(tokens)) in order. A step in which no token starts (a token spans it entirely) gets an empty
    range (s, s): it receives no tokens, and its credit lands on the token that started before it.
    """
    ends, total = [], 0
    for s in step_texts:
        total += len(s)
        ends.append(total)
    n_steps = max(len(step_texts), 1)
    owner, last = [], 0
    for off in token_char_offsets:
        k = min(bisect.bisect_right(ends, off), n_steps - 1)
        last = max(last, k)  # offsets should be non-decreasing; if not, never go back a step
        owner.append(last)
    ranges, j = [], 0
    for k in range(n_steps):
        start = j
        while j < len(owner) and owner[j] == k:
            j += 1
        ranges.append((start, j))
    return ranges


RESYNC_EVERY = 32  # tokens between exact (whole-prefix) decodes in token_char_offsets
_CONTEXT = 4  # tokens decoded before the new one, so tokenizer quirks at a decode's start cancel out


def token_char_offsets(tokenizer, token_ids: list[int]) -> list[int]:
    """Each token's starting character offset in `tokenizer.decode(token_ids, skip_special_tokens=True)`.

    The exact offset of token j is the length of the common prefix of decode(ids[:j]) and the full text; that
    stays right for byte-level BPE, where a prefix ending mid-character decodes to a replacement character.
    Decoding every prefix is quadratic, so offsets advance by decoding a few tokens of context plus the new
    one (a leading-space quirk at a decode's start appears in both and cancels), with an exact decode every
    RESYNC_EVERY tokens and whenever a replacement character or an inconsistency shows up.
    """
    ids = list(token_ids)

    def decode(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=True)

    text = decode(ids)

    def exact(j: int) -> int:
        prefix = decode(ids[:j]) if j else ""
        if text.startswith(prefix):
            return len(prefix)
        n = 0
        for x, y in zip(prefix, text):
            if x != y:
                break
            n += 1
        return n

    offsets, last = [], 0
    for j in range(len(ids)):
        if j == 0 or j % RESYNC_EVERY == 0:
            off = exact(j)
        else:
            ctx = ids[max(0, j - 1 - _CONTEXT) : j - 1]
            before, after = decode(ctx), decode(ctx + [ids[j - 1]])
            if after.startswith(before) and "\ufffd" not in after[len(before) :]:
                off = last + len(after) - len(before)
            else:
                off = exact(j)
        last = max(last, min(off, len(text)))
        offsets.append(last)
    return offsets
