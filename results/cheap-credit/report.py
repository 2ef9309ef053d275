"""The cheap-credit study's figures (PROTOCOL.md): every hypothesis's statistic and verdict, and the plots.

    python results/cheap-credit/report.py --runs $SCRATCH/study --values $SCRATCH/values/values.json \
        --credit $SCRATCH/credit-skip/credit.json --out results/cheap-credit

Copies each run's metrics.jsonl, summary.json and config.yaml to OUT/runs/<task>/<method>-s<seed>/, the value and
localisation results to OUT/values.json and OUT/credit.json, and writes OUT/study.json and OUT/<task>.png (test
pass@1 against training seconds: each method's mean over seeds, its range shaded). OUT/iteration.json (H1, H2)
is read as benchmarks/iteration.py wrote it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/studies.py, shared by the studies' reports
from studies import copy_run, evaluations, mean_se, metrics, plot_seconds, shown  # noqa: E402

NEW = ("vineppo-tree", "tempo")
BASELINES = ("vineppo", "grpo", "dr-grpo")
METHODS = ("vineppo", "vineppo-tree", "tempo", "grpo", "dr-grpo")
TASKS = ("default", "skip", "long", "pairs")


def load(folder: Path) -> dict:
    """A run's evaluations (iteration, training seconds, test pass@1) and its summary."""
    return {"evals": evaluations(metrics(folder)), "summary": json.loads((folder / "summary.json").read_text())}


def learning(runs: Path, out: Path) -> dict:
    """H5 per task: final pass@1 at the budget, the paired differences, and pass@1 at equal iterations."""
    result = {}
    for task in TASKS:
        found = {m: {int(p.name.rsplit("-s", 1)[1]): p for p in sorted((runs / task).glob(f"{m}-s*"))
                     if (p / "summary.json").exists()} for m in METHODS}
        if not all(found.values()):
            continue
        for seeds in found.values():
            for p in seeds.values():
                copy_run(p, out / "runs" / task / p.name, runs.parent)  # $SCRATCH/study is --runs
        data = {m: {s: load(p) for s, p in seeds.items()} for m, seeds in found.items()}
        seeds = sorted(set.intersection(*(set(d) for d in data.values())))
        final = {m: {s: data[m][s]["summary"]["final_test_pass@1"] for s in seeds} for m in METHODS}
        common = min(max(i for i, _, _ in run["evals"] if i % 5 == 0) for d in data.values() for run in d.values())
        at = {m: {s: next(p for i, _, p in data[m][s]["evals"] if i == common) for s in seeds} for m in METHODS}
        diffs = {}
        for new in NEW:
            for base in BASELINES:
                if new != base:
                    d = mean_se([final[new][s] - final[base][s] for s in seeds])
                    diffs[f"{new} - {base}"] = {**d, "verdict": shown(d)}
        result[task] = {"seeds": seeds, "final_pass@1": {m: mean_se(list(final[m].values())) for m in METHODS},
                        "iterations": {m: [data[m][s]["summary"]["iterations"] for s in seeds] for m in METHODS},
                        "train_s": {m: [round(data[m][s]["summary"]["train_s"], 1) for s in seeds] for m in METHODS},
                        "differences": diffs, "equal_iterations": common,
                        "pass@1_at_equal_iterations": {m: mean_se(list(at[m].values())) for m in METHODS}}
        plot_seconds(task, data, out / f"{task}.png")
    return result


def values(path: Path, out: Path) -> dict:
    """H3: TEMPO's and GRPO's absolute errors against the truth, paired per state."""
    res = json.loads(path.read_text())
    shutil.copy(path, out / "values.json")
    rows = res["rows"]
    d = mean_se([abs(r["tempo"] - r["true"]) - abs(r["grpo"] - r["true"]) for r in rows])
    return {"mae": res["mae"], "states": len(rows), "tempo_shared_states": res["tempo_shared_states"],
            "tempo_minus_grpo_abs_error": {**{k: v for k, v in d.items() if k != "values"}, "verdict": shown(d)}}


def credit(path: Path, out: Path) -> dict:
    """H4: TEMPO's and GRPO's share of the negative mass on the skipped line."""
    res = json.loads(path.read_text())
    shutil.copy(path, out / "credit.json")
    per = res["summary"]["behaviour"]
    t, g = per["tempo"]["share"], per["grpo"]["share"]
    d = {"mean": t["mean"] - g["mean"], "se": math.hypot(t["se"], g["se"])}
    return {"share": {m: per[m]["share"] for m in per}, "tempo_minus_grpo": {**d, "verdict": shown(d)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--values", type=Path)
    ap.add_argument("--credit", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    study = {"learning": learning(args.runs, args.out)}
    if (args.out / "iteration.json").exists():
        it = json.loads((args.out / "iteration.json").read_text())
        study["cost"] = {m: {k: v for k, v in it[m].items()} for m in METHODS if m in it}
        study["cost"]["tree_over_vineppo_trained_tokens_per_s"] = (it["vineppo-tree"]["trained_tokens_per_s"]
                                                                   / it["vineppo"]["trained_tokens_per_s"])
    if args.values:
        study["values"] = values(args.values, args.out)
    if args.credit:
        study["credit"] = credit(args.credit, args.out)
    (args.out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    print(json.dumps({k: v for k, v in study.items() if k != "learning"}, indent=1))


if __name__ == "__main__":
    main()
