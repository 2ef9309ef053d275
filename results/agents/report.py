"""The agents studies' figures (PROTOCOL.md, PROTOCOL-guess-number.md): the released model's evaluation, H1 and H2
with their verdicts (each over the seeds that finished both of its runs), and a plot per task.

    python results/agents/report.py --runs $SCRATCH/agents --out results/agents [--memory $SCRATCH/rss.log [--memory-task TASK]]

Copies each run's metrics.jsonl, summary.json and config.yaml to OUT/runs/<task>/<run>/ and each release
evaluation's JSON to OUT/release-<task>.json, and writes OUT/study.json and OUT/<task>.png (test pass@1 against
training seconds: each method's mean over seeds, its range shaded).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/studies.py, shared by the studies' reports
from studies import copy_run, evaluations, mean_se, metrics, plot_seconds, shown  # noqa: E402

TASKS = ("calculator", "guess-number")
RUNS = ("iterations-grpo", "iterations-vineppo", "seconds-vineppo")
PHASES = ("sampling", "credit", "update")
COUNTS = ("agent/turns", "agent/tool_calls", "agent/cut_off")  # per iteration, the means reported


def load(folder: Path) -> dict:
    """A run's evaluations (iteration, training seconds, test pass@1), per-iteration agent counts, its summary."""
    rows = metrics(folder)
    its = [r for r in rows if "train/reward" in r]
    return {"evals": evaluations(rows),
            "agent": {k: statistics.mean(r.get(k, 0.0) for r in its) for k in COUNTS},
            "phase_s": {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in its) for p in PHASES},
            "summary": json.loads((folder / "summary.json").read_text())}


def paired(final: dict, a: str, b: str) -> dict | None:
    """a − b per seed over the seeds both finished, mean ± SE, the seeds and the verdict (None: no seed)."""
    seeds = sorted(set(final.get(a, {})) & set(final.get(b, {})))
    if not seeds:
        return None
    d = mean_se([final[a][s] - final[b][s] for s in seeds])
    return {**d, "seeds": seeds, "verdict": shown(d)}


def task_result(root: Path, task: str, out: Path) -> dict | None:
    """H1 and H2 on one task, each from the seeds that finished its two runs (None when no run finished)."""
    found = {run: {int(p.name.rsplit("-s", 1)[1]): p for p in sorted(root.glob(f"{run}-s*"))
                   if (p / "summary.json").exists()} for run in RUNS}
    found = {run: seeds for run, seeds in found.items() if seeds}
    if not found:
        return None
    data = {run: {s: load(p) for s, p in seeds.items()} for run, seeds in found.items()}
    for seeds in found.values():
        for p in seeds.values():
            copy_run(p, out / "runs" / task / p.name, root.parent.parent)  # $SCRATCH/agents/<task> is root
    final = {run: {s: d["summary"]["final_test_pass@1"] for s, d in runs.items()} for run, runs in data.items()}
    per = lambda f: {run: f(runs) for run, runs in data.items()}  # noqa: E731 - one figure per run kind
    plot_seconds(task, data, out / f"{task}.png")
    first = next(iter(data.values()))
    return {"seeds": per(sorted), "start_test_pass@1": mean_se([d["evals"][0][2] for d in first.values()]),
            "final_pass@1": per(lambda runs: mean_se([d["summary"]["final_test_pass@1"] for d in runs.values()])),
            "iterations": per(lambda runs: [d["summary"]["iterations"] for d in runs.values()]),
            "train_s": per(lambda runs: [round(d["summary"]["train_s"], 1) for d in runs.values()]),
            "per_iteration": per(lambda runs: {k: statistics.mean(d["agent"][k] for d in runs.values())
                                               for k in COUNTS}),
            "median_phase_s": per(lambda runs: {p: statistics.median(d["phase_s"][p] for d in runs.values())
                                                for p in PHASES}),
            "h1_vineppo_minus_grpo": paired(final, "iterations-vineppo", "iterations-grpo"),
            "h2_vineppo_minus_grpo": paired(final, "seconds-vineppo", "iterations-grpo")}


def memory(log: Path, task: str, out: Path) -> None:
    """memory.sh's samples as OUT/memory-<task>.json: each run's resident GB every 5 s and its peak.

    A run the log does not hold keeps its samples from the file there (a study continued in a new scratch folder).
    """
    runs: dict[str, list[float]] = {}
    for n, line in enumerate(log.read_text().splitlines(), 1):
        if len(line.split()) != 2 or not line.split()[1].isdigit():
            raise SystemExit(f"{log}:{n}: expected 'RUN KB' as memory.sh writes it, got {line!r}")
        name, kb = line.split()
        runs.setdefault(name, []).append(round(int(kb) / 1e6, 2))
    filed = out / f"memory-{task}.json"
    earlier = json.loads(filed.read_text())["runs"] if filed.exists() else {}
    runs = {**{k: v["samples_gb"] for k, v in earlier.items() if k not in runs}, **runs}
    filed.write_text(json.dumps(
        {"command": f"bash results/agents/memory.sh $SCRATCH/{log.name} {task} (beside run.py)",
         "unit": "GB (10^9 bytes) resident, one sample every 5 s",
         "runs": {k: {"peak_gb": max(v), "samples_gb": v} for k, v in runs.items()}}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--memory", type=Path, help="memory.sh's log of one task's runs")
    ap.add_argument("--memory-task", default=TASKS[0], choices=TASKS, help="the task --memory's log is of")
    args = ap.parse_args()
    if args.memory:
        memory(args.memory, args.memory_task, args.out)
    study = {}
    for task in TASKS:
        release = args.runs / task / "release.json"
        if release.exists():
            shutil.copy(release, args.out / f"release-{task}.json")
            scores = json.loads(release.read_text())
            study.setdefault(task, {})["release"] = {k: scores[k] for k in ("pass@1", "pass@k", "greedy", "reward")}
        result = task_result(args.runs / task, task, args.out)
        if result is not None:
            study.setdefault(task, {}).update(result)
    (args.out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    print(json.dumps(study, indent=1))


if __name__ == "__main__":
    main()
