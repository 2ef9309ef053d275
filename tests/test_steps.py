"""Step splitters (exact concatenation, no cut inside math) and the step -> token mapping."""

import json
import random
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import vineppo.core.steps as steps_mod
from vineppo.core.steps import (MAX_STEP_CHARS, math_spans, split_math, split_newlines, step_token_ranges,
                                token_char_offsets)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _math500():
    path = DATA / "math500" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"shared data {path} not present")
    return [json.loads(line)["solution"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("text,want", [
    ("a\nb\n#### 5", ["a\n", "b\n#### 5"]),
    ("\n\na\nb\n#### 5\n", ["\n\na\n", "b\n#### 5\n"]),
    ("a\n\nb", ["a\n", "\nb"]),
    ("#### 5", ["#### 5"]),
    ("one line", ["one line"]),
    ("", [""]),
    ("a\r\nb", ["a\r\n", "b"]),
])
def test_split_newlines(text, want):
    assert split_newlines(text) == want


def test_split_math_examples():
    text = "First we note that $x = 3.$  Then we compute the value of $y$.\nSo $y = 2$ and we are done."
    steps = split_math(text)
    assert "".join(steps) == text
    assert steps[0] == "First we note that $x = 3.$  "  # a sentence may end inside closing math
    # tiny pieces merge into the next one
    assert split_math("So,\nthe answer is $\\boxed{5}$.") == ["So,\nthe answer is $\\boxed{5}$."]
    # never cut inside display math or an environment, even at newlines and sentence ends
    env = "We have\n\\begin{align*}\nx &= 1. Y \\\\\ny &= 2\n\\end{align*}\nso we are done with it. Next one."
    assert all("\\begin" not in s or "\\end" in s for s in split_math(env))


def test_split_math_halves_long_pieces():
    text = ("We take the first number which is quite large, and then we add the second number which is "
            "larger still to obtain a total that we report.")
    steps = split_math(text)
    assert len(steps) == 2 and "".join(steps) == text
    assert steps[1].startswith("and ")
    assert all(len(s) >= 30 for s in steps)
    inline = "$" + "x+" * 80 + "x$"  # all math: no cut at all
    assert split_math(inline) == [inline]


def _dollar_inside(text: str, pos: int) -> bool:
    """Independent check: an odd number of unescaped `$` before pos means pos is inside `$...$`."""
    return len(re.findall(r"(?<!\\)\$", text[:pos])) % 2 == 1


def test_math500_solutions_split_exactly_and_never_inside_dollars():
    for solution in _math500():
        text = " " + solution
        steps = split_math(text)
        assert "".join(steps) == text
        pos = 0
        for s in steps[:-1]:
            pos += len(s)
            assert not _dollar_inside(text, pos), (text, pos)
            assert text[:pos].count("\\begin{") == text[:pos].count("\\end{")
            assert text[:pos].count("\\[") == text[:pos].count("\\]")
            assert text[:pos].count("[asy]") == text[:pos].count("[/asy]")
        assert all(s for s in steps)


ATOMS = ["$", "$$", "\\[", "\\]", "\\(", "\\)", "\\begin{align}", "\\end{align}", "[asy]", "[/asy]", ". ", "A",
         "b", "\n", "\n\n", ",", " and ", " = ", "+", ":", " ", "\\", "{", "}", "\\$", "word ", "Then ", "x" * 30]


def test_split_math_property_random_strings():
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 60)))
        steps = split_math(text)
        assert "".join(steps) == text
        assert steps and (all(steps) or text == "")
        pos, spans = 0, math_spans(text)
        for s in steps[:-1]:
            pos += len(s)
            assert not any(a < pos < b for a, b in spans)
        assert "".join(split_newlines(text)) == text


def test_split_math_long_text_is_bounded():
    text = ("The quick computation gives a value, and the next one gives another value. " * 30).strip()
    steps = split_math(text)
    assert "".join(steps) == text
    assert max(len(s) for s in steps) <= MAX_STEP_CHARS


def test_step_token_ranges():
    steps = ["ab", "cde", "f"]
    assert step_token_ranges(steps, [0, 1, 2, 4, 5, 6]) == [(0, 2), (2, 4), (4, 6)]  # 6: EOS, past the text
    # a token straddling a whole step: that step gets an empty range
    assert step_token_ranges(["ab", "c", "de"], [0, 1, 4]) == [(0, 2), (2, 2), (2, 3)]
    assert step_token_ranges([""], [0, 0]) == [(0, 2)]
    assert step_token_ranges(["abc"], []) == [(0, 0)]


def _bpe_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The answer is $x = 3$.\nThen we add 2 and get 5.",
              "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_token_char_offsets_byte_level_bpe():
    tok = _bpe_tokenizer()
    text = "Caf\u00e9 costs 3.\nThen \u65e5\u672c \U0001F600 and $x = 3$.\n#### 5"
    ids = tok.encode(text).ids + [tok.token_to_id("<eos>")]
    assert tok.decode(ids, skip_special_tokens=True) == text
    offsets = token_char_offsets(tok, ids)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] == len(text)
    for j, t in enumerate(ids[:-1]):
        piece = tok.decode([t])
        if piece and "\ufffd" not in piece:  # a whole-character token starts exactly where its text does
            assert text.startswith(piece, offsets[j]), (j, piece, offsets[j])
    steps = split_newlines(text)
    ranges = step_token_ranges(steps, offsets)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1][1] - 1 == len(ids) - 1  # EOS belongs to the last step


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_token_char_offsets_fast_path_matches_exact(monkeypatch, kind):
    if kind == "bytelevel":
        tok = _bpe_tokenizer()
    else:  # SentencePiece style: a decode drops the leading space of its first token
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(["we add two and get five then we stop"] * 20,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    text = "we add two and get five. Caf\u00e9 \u65e5\u672c \U0001F600 then we stop " * 12
    ids = tok.encode(text).ids
    fast = token_char_offsets(tok, ids)
    monkeypatch.setattr(steps_mod, "RESYNC_EVERY", 1)  # every offset by a whole-prefix decode
    assert fast == token_char_offsets(tok, ids)


def test_token_char_offsets_char_tokenizer():
    chars = sorted(set("abc \n#5"))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    text = "ab c\n#### 5"
    ids = [chars.index(c) for c in text]
    assert tok.decode(ids) == text
    assert token_char_offsets(tok, ids) == list(range(len(text)))


def test_a_stop_string_joins_the_last_step_so_no_state_sits_in_it():
    """A few-shot response ends with the stop string '\\n\\nProblem:' it was cut at; split by lines, that text
    would be a step of its own and VinePPO would estimate a state inside the stop string, whose continuations
    write a whole new problem and answer (the bug that made VinePPO on SmolLM2 one-shot prompts ramble)."""
    from vineppo.engine import Sample
    from vineppo.tasks import Example, get_task
    from vineppo.training.trainer import _episode

    task = get_task("arith")
    text = " 3 * 5 = 15\n#### 15\n\nProblem:"
    assert task.split_steps(text) == [" 3 * 5 = 15\n#### 15\n", "\nProblem:"]
    assert task.response_steps(text) == [text]
    two = " 3 * 5 = 15\n15 - 2 = 13\n#### 13\n\nProblem:\nAva"
    assert task.response_steps(two) == [" 3 * 5 = 15\n", "15 - 2 = 13\n#### 13\n\nProblem:\nAva"]
    assert task.response_steps("\n\nProblem:") == ["\n\nProblem:"]
    assert task.response_steps(" 1 + 1 = 2\n#### 2") == task.split_steps(" 1 + 1 = 2\n#### 2")  # no stop: unchanged

    class Chars:  # one token per character
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    sample = Sample([ord(c) for c in two], two, [0.0] * len(two), "stop")
    episode = _episode(task, Chars(), (0, Example("x", "p", "s", "13"), [1], sample), 1.0)
    assert [b - a for a, b in episode.steps] == [len(s) for s in task.response_steps(two)]
