"""The TRL measurement's figures: test pass@1 of VinePPOTrainer, TempoTrainer and TRL's GRPOTrainer against steps and
training seconds, beside `vineppo train`'s native runs of the same methods, and the seconds a step takes by phase.

    python results/trl/report.py --trl $SCRATCH/trl/arith --native $SCRATCH/trl/native \
        --mental-math $SCRATCH/trl/mental-math --out results/trl

Copies the TRL records to OUT/arith/ and OUT/mental-math/, each native run's metrics.jsonl, summary.json and
config.yaml to OUT/native/<method>-s<seed>/, and writes OUT/trl.json and OUT/curves.png. A native iteration is 4 TRL
steps (run.py's table), so native iteration i is drawn at step 4i.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/studies.py, shared by the studies' reports
from studies import copy_run, evaluations, mean_se, metrics, shown  # noqa: E402

METHODS = ("grpo", "tempo", "vineppo")
STEPS_PER_ITERATION = 4


def trl_runs(folder: Path, out: Path) -> dict:
    """{method: {seed: record}} of run.py's records in `folder`, copied to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for path in sorted(folder.glob("*-s*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["trainer"], {})[record["seed"]] = record
        shutil.copy(path, out / path.name)
    return runs


def native_runs(folder: Path, out: Path) -> dict:
    """{method: {seed: record}}: each native run's curve (step, seconds, test pass@1) and its seconds per step by
    phase, in run.py's form; the run's files copied to `out`."""
    runs: dict = {}
    for run in sorted(p for p in folder.glob("*-s*") if (p / "summary.json").exists()):
        method, seed = run.name.rsplit("-s", 1)
        copy_run(run, out / run.name, folder.parent.parent)  # $SCRATCH/trl/native is --native
        rows = metrics(run)
        steps = STEPS_PER_ITERATION * max(r["iteration"] for r in rows)
        phase = {k: sum(r.get(f"time/{k}_s", 0.0) for r in rows) / steps for k in ("sampling", "credit", "update")}
        runs.setdefault(method, {})[int(seed)] = {
            "curve": [{"step": STEPS_PER_ITERATION * i, "seconds": s, "test_pass@1": p} for i, s, p in evaluations(rows)],
            "seconds_per_step": {"generation": phase["sampling"], "credit": phase["credit"], "update": phase["update"]}}
    return runs


def per_step(record: dict) -> float:
    """A run's seconds per step, all phases."""
    return sum(record["seconds_per_step"].values())


def at_seconds(curve: list[dict], seconds: float) -> float:
    """Test pass@1 of a curve at `seconds` of training, linearly between its evaluations (its last if past them)."""
    points = [(c["seconds"], c["test_pass@1"]) for c in curve]
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if s0 <= seconds <= s1:
            return p0 + (p1 - p0) * (seconds - s0) / max(s1 - s0, 1e-9)
    return points[-1][1]


def summary(runs: dict) -> dict:
    """Per method: final pass@1 and seconds per step (mean, SE over seeds), the curve's mean at each step; the
    VinePPO/GRPO and TEMPO/GRPO step ratios; the paired differences to GRPO at equal steps and at GRPO's seconds."""
    seeds = sorted(set.intersection(*(set(runs[m]) for m in METHODS if m in runs)))
    out: dict = {"seeds": seeds, "methods": {}}
    for m in (m for m in METHODS if m in runs):
        recs = [runs[m][s] for s in seeds]
        curve = [{"step": c["step"], "test_pass@1": statistics.mean(r["curve"][k]["test_pass@1"] for r in recs),
                  "seconds": statistics.mean(r["curve"][k]["seconds"] for r in recs)}
                 for k, c in enumerate(recs[0]["curve"])]
        phases = {k: statistics.mean(r["seconds_per_step"][k] for r in recs) for k in recs[0]["seconds_per_step"]}
        out["methods"][m] = {"final_pass@1": mean_se([r["curve"][-1]["test_pass@1"] for r in recs]),
                             "seconds_per_step": mean_se([per_step(r) for r in recs]),
                             "seconds_per_step_by_phase": phases, "curve": curve}
    grpo = out["methods"]["grpo"]
    for m in ("tempo", "vineppo"):
        if m not in out["methods"]:
            continue
        ratio = out["methods"][m]["seconds_per_step"]["mean"] / grpo["seconds_per_step"]["mean"]
        steps = mean_se([runs[m][s]["curve"][-1]["test_pass@1"] - runs["grpo"][s]["curve"][-1]["test_pass@1"]
                         for s in seeds])
        budget = {s: runs["grpo"][s]["curve"][-1]["seconds"] for s in seeds}
        seconds = mean_se([at_seconds(runs[m][s]["curve"], budget[s]) - runs["grpo"][s]["curve"][-1]["test_pass@1"]
                           for s in seeds])
        out[f"{m}/grpo"] = {"step_ratio": ratio,
                            "equal_steps": {**steps, "verdict": shown(steps)},
                            "at_grpo_seconds": {**seconds, "verdict": shown(seconds)}}
    return out


def plot(trl: dict, native: dict, path: Path) -> None:
    """Test pass@1 against steps and against training seconds: TRL's trainers solid, the native runs dashed."""
    import matplotlib  # only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (name, result), style in ((("TRL", trl), "-"), (("native", native), "--")):
        for k, (m, r) in enumerate(result["methods"].items()):
            curve = r["curve"]
            for ax, x in zip(axes, ("step", "seconds")):
                ax.plot([c[x] for c in curve], [c["test_pass@1"] for c in curve], style, marker="o", ms=3,
                        color=f"C{k}", label=f"{m} ({name})")
    for ax, label in zip(axes, ("TRL optimiser steps (native: 4 per iteration)", "training seconds (log scale)")):
        ax.set(xlabel=label, ylabel="test pass@1")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("symlog", linthresh=10)  # native and TRL seconds differ 5-15x: a linear axis hides the native
    axes[0].legend(fontsize=8)
    fig.suptitle(f"arith, shipped SFT model: mean of {len(trl['seeds'])} seeds (TRL 1.16 solid, vineppo train dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl", required=True, type=Path, help="run.py's --out for the arith runs")
    ap.add_argument("--native", required=True, type=Path, help="the native runs' folder (<method>-s<seed>/)")
    ap.add_argument("--mental-math", type=Path, help="run.py's --out for the mental-math runs")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    trl = summary(trl_runs(args.trl, args.out / "arith"))
    native = summary(native_runs(args.native, args.out / "native"))
    result = {"arith": {"trl": trl, "native": native,
                        "vineppo_step_ratio_trl_over_native": trl["vineppo/grpo"]["step_ratio"]
                        / native["vineppo/grpo"]["step_ratio"]}}
    if args.mental_math:
        mm = trl_runs(args.mental_math, args.out / "mental-math")
        result["mental-math"] = {m: {"curve": r[0]["curve"], "seconds_per_step": r[0]["seconds_per_step"],
                                     "seconds_per_step_total": per_step(r[0])} for m, r in mm.items()}
        if {"grpo", "vineppo"} <= set(mm):
            result["mental-math"]["vineppo/grpo step_ratio"] = per_step(mm["vineppo"][0]) / per_step(mm["grpo"][0])
    (args.out / "trl.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(trl, native, args.out / "curves.png")
    print(json.dumps({k: v for k, v in result["arith"]["trl"].items() if "/" in k}, indent=2))


if __name__ == "__main__":
    main()
