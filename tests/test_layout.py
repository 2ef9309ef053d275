"""The package's import structure (docs/architecture.md, "Imports"): the settings load no engine and no
transformers, the engine's interface imports nothing of the package, and every import left inside a function
says why on its line."""

import ast
import shutil
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


# ------------------------------------------------------------------ import direction

# The package in layers, lowest first: a module imports only from its own layer or below (any import counts: at
# the top, inside a function or under TYPE_CHECKING). Within a layer, no cycle.
LAYERS = [
    ["errors", "hub"],
    ["config", "distributed", "steps", "tracking", "rewards", "grading"],
    ["tasks.base", "tasks.data", "tasks.arith", "tasks.gsm8k", "tasks.math", "tasks.custom", "tasks"],
    ["prompts", "models"],
    ["parallel", "lora", "engine.api", "engine.graphs", "engine.prefixes"],
    ["engine.plan", "engine.sampling", "engine.attention"],
    ["engine.batch", "engine.split", "engine.ring"],
    ["engine.stops", "engine.schedule", "engine.budget", "engine.balanced"],
    ["engine.job"],
    ["engine.native", "engine.vllm_backend"],
    ["engine"],
    ["minibatch", "ppo", "credit", "runs"],
    ["guard"],
    ["algorithms", "sft", "analysis", "inspect", "export"],
    ["evaluate", "localisation", "compare"],
    ["train"],
    ["api", "", "cli", "__main__"],  # "": the package itself
]
# Upward imports the layers allow, each with its reason.
ALLOWED_UP = {
    ("train", ""): "makes itself callable for the Python API (vineppo.CallableModule); the package imports nothing",
    ("evaluate", ""): "the same as train",
}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the package's modules it imports ('' is the package itself), from the source by AST."""
    names = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix("__init__").rstrip(".")
             for p in src.rglob("*.py")}
    graph = {}
    for path in src.rglob("*.py"):
        me = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix("__init__").rstrip(".")
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vineppo":
                base = node.module.removeprefix("vineppo").lstrip(".")
                out |= {f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in names else base
                        for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name.removeprefix("vineppo").lstrip(".") for a in node.names if a.name.split(".")[0] == "vineppo"}
        graph[me] = out - {me}
    return graph


def violations(graph: dict[str, set[str]], layers: list[list[str]], allowed: dict) -> list[str]:
    """Imports that go up the layers (and are not allowed), and modules the layers do not place."""
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    bad = [f"{m!r} has no layer" for m in graph if m not in level]
    bad += [f"{m or 'vineppo'} imports {t or 'vineppo'} (layer {level[t]} above {level[m]})" for m, ts in graph.items()
            for t in ts if m in level and t in level and level[t] > level[m] and (m, t) not in allowed]
    return bad


def cycles(graph: dict[str, set[str]], ignore: dict) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module), allowed edges left out."""
    edges = {m: {t for t in ts if (m, t) not in ignore and t in graph} for m, ts in graph.items()}
    index, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_imports_only_go_down_the_layers_and_close_no_circle():
    graph = import_graph()
    assert not violations(graph, LAYERS, ALLOWED_UP)
    assert not cycles(graph, ALLOWED_UP)
    assert {t for ts in graph.values() for t in ts} <= set(graph)  # the graph sees every import of the package


def test_a_planted_upward_import_or_circle_is_caught(tmp_path):
    src = tmp_path / "vineppo"
    shutil.copytree(SRC, src)
    plant = lambda name, line: (src / name).write_text((src / name).read_text() + f"\n\ndef _late():\n    {line}\n")  # noqa: E731
    plant("grading.py", "from vineppo.engine import Sample  # planted")
    graph = import_graph(src)
    assert violations(graph, LAYERS, ALLOWED_UP) == ["grading imports engine (layer 10 above 1)"]
    plant("errors.py", "from vineppo.config import TrainConfig  # planted")
    graph = import_graph(src)
    assert "errors imports config (layer 1 above 0)" in violations(graph, LAYERS, ALLOWED_UP)
    assert cycles(graph, ALLOWED_UP) == [["config", "errors"]]
