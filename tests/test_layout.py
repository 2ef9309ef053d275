"""The package's import structure (docs/architecture.md, "Imports"): the settings load no engine and no
transformers, the engine's interface imports nothing of the package, and every import left inside a function
says why on its line."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "vineppo"


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_config_loads_no_engine_and_no_transformers():
    loaded = _loaded_after("vineppo.config")
    assert "transformers" not in loaded and "torch" not in loaded
    assert not any(m.startswith("vineppo.engine") for m in loaded)


def test_the_engine_interface_imports_nothing_of_the_package():
    tree = ast.parse((SRC / "engine" / "api.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("vineppo")]


def test_every_function_level_import_says_why():
    bare = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    bare.append(f"{path.relative_to(SRC)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not bare, "function-level imports without a reason:\n" + "\n".join(bare)
