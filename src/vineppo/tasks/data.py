"""Shared loading for file-backed tasks: strict JSONL reading, Hugging Face Hub access, validation carving."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from vineppo.core.errors import UserError
from vineppo.core.hub import offline, reachable
from vineppo.tasks.base import Example

N_VALIDATION = 500  # problems carved from train into a validation split
VALIDATION_SEED = 20240601  # fixed, so every run (whatever its --seed) sees the same validation split


def read_jsonl(path: str | Path, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[dict]:
    """Every record of a JSONL file; a UserError names file, line and field for anything malformed or missing."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read: {e}") from None
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            if lineno == text.count("\n") + 1:  # the empty string after the final newline
                continue
            raise UserError(f"{path}:{lineno}: blank line (one JSON object per line expected)")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            # json's messages may end in "at" ("Unterminated string starting at"): the column follows once
            what = e.msg.removesuffix(" at")
            raise UserError(f"{path}:{lineno}: malformed JSON: {what} at column {e.colno}") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        check_fields(record, required, optional, f"{path}:{lineno}")
        records.append(record)
    if not records:
        raise UserError(f"{path}: empty file (no records)")
    return records


def check_fields(record: dict, required: tuple[str, ...], optional: tuple[str, ...], where: str) -> None:
    """A UserError naming `where` and the field when a required field is missing or a field is not a string."""
    for name in required:
        if name not in record:
            raise UserError(f"{where}: missing field {name!r}")
    for name in required + optional:
        if name in record and not isinstance(record[name], str):
            raise UserError(f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}")


def load_hub(repo: str, config: str | None, split: str, task: str, required: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> list[dict]:
    """Records of a Hugging Face Hub data set split; offline or unreachable, a one-line UserError at once."""
    hint = f"pass a local JSONL file with --data PATH (task {task!r}, hub data set {repo})"
    # With HF_HUB_OFFLINE set, `datasets` uses its cache and never touches the network; without it, we test
    # the connection ourselves because a firewalled host can make `datasets` wait for minutes.
    if not offline("HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE") and not reachable():
        raise UserError(f"cannot reach huggingface.co to download {repo}; {hint}")
    try:
        import datasets  # optional dependency: only for hub data sets

        datasets.disable_progress_bars()
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # noqa: BLE001 - every failure of the download becomes the same one-line hint
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"cannot load {repo} split {split!r} from the hub ({first}); {hint}") from None
    records = [dict(r) for r in ds]
    for i, record in enumerate(records):
        check_fields(record, required, optional, f"hub {repo} {split} record {i}")
    return records


def carve(records: list, split: str, n_validation: int = N_VALIDATION) -> list[tuple[int, object]]:
    """(index, record) pairs of `split` carved from a train list: a fixed-seed validation sample, or the rest."""
    n_val = min(n_validation, len(records) // 10)  # never carve more than a tenth of a small file
    order = list(range(len(records)))
    random.Random(VALIDATION_SEED).shuffle(order)
    val = set(order[:n_val])
    keep = [i for i in range(len(records)) if (i in val) == (split == "validation")]
    return [(i, records[i]) for i in keep]


def check_split(task: str, split: str, splits: tuple[str, ...]) -> None:
    """A UserError unless `split` is one of the task's splits."""
    if split not in splits:
        raise UserError(f"task {task!r} has no split {split!r}; splits: {', '.join(splits)}")


def load_examples(task: str, split: str, path: str | None, hub: tuple[str, str | None, str],
                  parse: Callable[[dict, str], tuple[str, str, str]], **fields: tuple[str, ...]) -> list[Example]:
    """The Examples of `split` from the JSONL `path`, else the hub split `hub` (repo, config, split): test is the whole
    source, train and validation a fixed carve of it; `parse(record, where)` gives (problem, solution, answer); ids
    are `<task>-<source>-<index>`, so a problem keeps its id whichever split it lands in."""
    source = "test" if split == "test" else "train"
    records = load_hub(*hub, task=task, **fields) if path is None else read_jsonl(path, **fields)
    pairs = list(enumerate(records)) if split == "test" else carve(records, split)
    out = []
    for i, record in pairs:
        where = f"{path}:{i + 1}" if path is not None else f"hub {hub[0]} {hub[2]} record {i}"  # line = index + 1
        problem, solution, answer = parse(record, where)
        out.append(Example(id=f"{task}-{source}-{i}", problem=problem, solution=solution, answer=answer))
    return out
