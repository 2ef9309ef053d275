"""The package's import structure (docs/architecture.md's floors): the settings load no engine and no
transformers, the engine's interface imports nothing of the package, and every import left inside a function
says why on its line."""

import ast
import json
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
    loaded = _loaded_after("vineppo.core.config")
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

# The package in floors, lowest first. A floor is one or more folders of src/vineppo ("" is the package's own top
# level) and its modules in sublayers, lowest first: a module lives in its floor's folder and imports only from its
# own sublayer or below (any import counts: at the top, inside a function or under TYPE_CHECKING). Within a
# sublayer, no cycle. docs/architecture.md shows the same table.
FLOORS = [
    ("core", [["core.errors", "core.hub"],
              ["core.config", "core.distributed", "core.steps", "core.rewards", "core.grading"],
              ["core.tracking", "core"]]),
    ("tasks", [["tasks.agent", "tasks.base", "tasks.data", "tasks.arith", "tasks.gsm8k", "tasks.math", "tasks.custom",
                "tasks"]]),
    ("models", [["models.causal_lm", "models.prompts"], ["models.parallel"], ["models.lora", "models"]]),
    ("engine", [["engine.api", "engine.graphs", "engine.prefixes"],
                ["engine.plan", "engine.sampling", "engine.attention"],
                ["engine.batch", "engine.split", "engine.ring"],
                ["engine.stops", "engine.schedule", "engine.budget", "engine.balanced", "engine.runner"],
                ["engine.job"],
                ["engine.native", "engine.vllm_backend"],
                ["engine"],
                ["engine.loading"]]),
    ("agents credit", [["agents.dialogue", "agents.engine", "agents", "credit.base", "credit.group", "credit.critic",
                        "credit.vine", "credit.tempo", "credit"]]),
    ("integrations", [["integrations.trl", "integrations"]]),  # TRL's trainers with vineppo's credit; imports trl
    ("training", [["training.forward", "training.runs"],
                  ["training.ppo"],
                  ["training.guard", "training.sft", "training.evaluation"],
                  ["training.algorithms"],
                  ["training.run"],
                  ["training.trainer", "training"]]),
    ("analysis", [["analysis.values"], ["analysis.localisation", "analysis.turn_credit", "analysis"]]),
    (" commands", [["api", "commands", "commands.train", "commands.eval", "commands.sft", "commands.compare",
                    "commands.export", "commands.analyze_values", "commands.analyze_credit", "commands.inspect_data"],
                   ["", "cli", "__main__"]]),  # "": the package itself (its __getattr__ loads the API)
]
LAYERS = [layer for _, layers in FLOORS for layer in layers]  # every sublayer, lowest first


def folder(module: str, src: Path = SRC) -> str:
    """The folder of src/vineppo a module lives in ("" for the package's own top level)."""
    top = module.split(".")[0]
    return top if top and (src / top).is_dir() else ""


def misplaced(graph: dict[str, set[str]], floors: list = FLOORS, src: Path = SRC) -> list[str]:
    """Modules that stand in another folder than their floor's, and folders that are no floor's."""
    home = {m: names.split(" ") for names, layers in floors for layer in layers for m in layer}
    bad = [f"{m!r} lives in {folder(m, src) or 'the top level'!r}, its floor is {' '.join(home[m])!r}"
           for m in graph if m in home and folder(m, src) not in home[m]]
    known = {f for names, _ in floors for f in names.split(" ")}
    bad += [f"folder {p.name!r} is no floor's" for p in sorted(src.iterdir())
            if p.is_dir() and (p / "__init__.py").exists() and p.name not in known]
    return bad


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


def violations(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Imports that go up the layers, and modules the layers do not place."""
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    bad = [f"{m!r} has no layer" for m in graph if m not in level]
    bad += [f"{m or 'vineppo'} imports {t or 'vineppo'} (layer {level[t]} above {level[m]})" for m, ts in graph.items()
            for t in ts if m in level and t in level and level[t] > level[m]]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module)."""
    edges = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
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
    assert not violations(graph, LAYERS)
    assert not cycles(graph)
    assert {t for ts in graph.values() for t in ts} <= set(graph)  # the graph sees every import of the package


def test_the_folders_are_the_floors():
    assert not misplaced(import_graph())
    assert {folder(m) for m in import_graph()} == {f for names, _ in FLOORS for f in names.split(" ")}


def test_the_architecture_page_shows_the_same_floors():
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[2] for line in page.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    shown = [sorted("" if f == "the top level" else f for f in (part.strip(" `/") for part in row.split(",")))
             for row in rows]
    assert shown == [sorted(names.split(" ")) for names, _ in FLOORS]


def script_graph(folder: Path) -> dict[str, set[str]]:
    """script -> the scripts of `folder` it imports (they import each other by plain name: `from rollouts import`)."""
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        graph[path.stem] = (found & names) - {path.stem}
    return graph


def test_the_benchmarks_import_each_other_without_a_circle():
    graph = script_graph(SRC.parents[1] / "benchmarks")
    assert "rollouts" in graph["shapes"] or "common" in graph["shapes"]  # the graph sees their imports
    assert not cycles(graph)


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_a_planted_upward_import_or_circle_is_caught(tmp_path):
    src = tmp_path / "vineppo"
    shutil.copytree(SRC, src)
    plant = lambda name, line: (src / name).write_text((src / name).read_text() + f"\n\ndef _late():\n    {line}\n")  # noqa: E731
    plant("core/grading.py", "from vineppo.engine import Sample  # planted")
    graph = import_graph(src)
    assert violations(graph, LAYERS) == [f"core.grading imports engine (layer {_layer('engine')} above "
                                         f"{_layer('core.grading')})"]
    plant("core/errors.py", "from vineppo.core.config import TrainConfig  # planted")
    graph = import_graph(src)
    assert f"core.errors imports core.config (layer {_layer('core.config')} above 0)" in violations(graph, LAYERS)
    assert cycles(graph) == [["core.config", "core.errors"]]
    plant("training/trainer.py", "from vineppo.commands.eval import show  # planted")
    assert (f"training.trainer imports commands.eval (layer {_layer('commands.eval')} above "
            f"{_layer('training.trainer')})") in violations(import_graph(src), LAYERS)


def test_a_planted_module_in_the_wrong_folder_is_caught(tmp_path):
    src = tmp_path / "vineppo"
    shutil.copytree(SRC, src)
    assert not misplaced(import_graph(src), src=src)
    (src / "core" / "guard.py").write_text((src / "training" / "guard.py").read_text())  # a training module in core/
    assert "'core.guard' has no layer" in violations(import_graph(src), LAYERS)
    moved = [(names, [[m.replace("training.guard", "core.guard") for m in layer] for layer in layers])
             for names, layers in FLOORS]  # the table follows it, but the table's floor is still training's
    assert misplaced(import_graph(src), moved, src) == ["'core.guard' lives in 'core', its floor is 'training'"]
    (src / "misc").mkdir()
    (src / "misc" / "__init__.py").write_text("")
    assert "folder 'misc' is no floor's" in misplaced(import_graph(src), src=src)


def test_a_planted_circle_among_the_benchmarks_is_caught(tmp_path):
    shutil.copytree(SRC.parents[1] / "benchmarks", tmp_path / "b")
    common = tmp_path / "b" / "common.py"
    common.write_text(common.read_text() + "\n\ndef _late():\n    import shapes  # planted\n")
    assert ["common", "shapes"] in cycles(script_graph(tmp_path / "b"))


def test_the_package_names_are_the_python_api_functions_and_load_nothing_heavy_until_used():
    code = ("import sys, inspect, json, vineppo; heavy = 'torch' in sys.modules; from vineppo import train, evaluate, "
            "TrainConfig; from vineppo import api; print(json.dumps([heavy, train is api.train, evaluate is api.evaluate,"
            " type(train).__name__, list(inspect.signature(train).parameters)[:2], TrainConfig.__name__]))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out == [False, True, True, "function", ["config", "data"], "TrainConfig"]  # no module stands in for them
