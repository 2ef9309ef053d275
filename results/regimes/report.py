"""The regimes study's figures (PROTOCOL.md): every hypothesis's statistic and verdict, and the plots.

    python results/regimes/report.py --runs $SCRATCH/study --choose-norm $SCRATCH/chosen-norm.json
        H6's rule on the single-turn conditions: the normalisation the game's VinePPO takes
    python results/regimes/report.py --runs $SCRATCH/study --heldout $SCRATCH/heldout --mental-math $SCRATCH \
        --iteration results/regimes/prep/iteration.json --select results/regimes/prep --out results/regimes

Copies each run's metrics.jsonl, summary.json and config.yaml to OUT/runs/<condition>/<method>-s<seed>/ (the
mental-math case's to OUT/mental-math/<normalisation>/) and writes
OUT/study.json and the plots: OUT/<condition>.png (test pass@1 against training seconds) and OUT/test-vs-train.png
(test pass@1 against training accuracy, every condition and the filed compare runs).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/studies.py, shared by the studies' reports
from studies import copy_run, evaluations, mean_se, metrics, plot_seconds, shown  # noqa: E402

SINGLE = ("hard", "cutoff", "groups-2", "groups-4", "long")
CONDITIONS = SINGLE + ("game",)
STEP = ("vineppo", "vineppo-scale", "vineppo-entropy", "tempo")  # the per-step methods
BASES = ("dr-grpo", "grpo")
SIGNALS = ("signal/flat_groups", "signal/nonzero_tokens", "signal/mixed_states", "signal/shifted_zeros")
WINDOW = 5  # training accuracy at an evaluation: the mean train/reward of the iterations up to it (PROTOCOL.md, H9)


def found(runs: Path, condition: str) -> dict[str, dict[int, Path]]:
    """method -> seed -> run folder, for the finished runs of a condition."""
    out: dict[str, dict[int, Path]] = {}
    for p in sorted((runs / condition).glob("*-s*")):
        if p.is_dir() and (p / "summary.json").exists():
            method, seed = p.name.rsplit("-s", 1)
            out.setdefault(method, {})[int(seed)] = p
    return out


def load(folder: Path) -> dict:
    """A run's metrics rows, evaluations and summary."""
    rows = metrics(folder)
    return {"rows": rows, "evals": evaluations(rows), "summary": json.loads((folder / "summary.json").read_text())}


def load_all(runs: Path, condition: str) -> dict[str, dict[int, dict]]:
    """method -> seed -> loaded run, for the finished runs of a condition."""
    return {m: {s: load(p) for s, p in seeds.items()} for m, seeds in found(runs, condition).items()}


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """a - b over the seeds both have: mean, SE, values, and the protocol's verdict."""
    seeds = sorted(set(a) & set(b))
    d = mean_se([a[s] - b[s] for s in seeds]) if seeds else {"mean": None, "se": None, "values": []}
    return {**d, "seeds": seeds, "verdict": shown(d) if seeds else "not run"}


def signals(run: dict) -> dict[str, float]:
    """The mean of each signal metric over the run's first 5 iterations (those that have it)."""
    first = [r for r in run["rows"] if 1 <= r.get("iteration", 0) <= 5]
    return {k: statistics.mean(r[k] for r in first if k in r) for k in SIGNALS if any(k in r for r in first)}


def accuracy_points(run: dict) -> list[tuple[float, float]]:
    """(training accuracy, test pass@1) at each evaluation after the start: the mean train/reward of the WINDOW
    iterations up to it."""
    reward = {r["iteration"]: r["train/reward"] for r in run["rows"] if "train/reward" in r}
    points = []
    for it, _, test in run["evals"]:
        window = [reward[i] for i in range(it - WINDOW + 1, it + 1) if i in reward]
        if it > 0 and window:
            points.append((statistics.mean(window), test))
    return points


def at_accuracy(points: list[tuple[float, float]], target: float) -> float | None:
    """Test pass@1 at training accuracy `target`: linear between the two evaluations around its first crossing."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if min(x0, x1) <= target <= max(x0, x1):
            return y0 if x1 == x0 else y0 + (y1 - y0) * (target - x0) / (x1 - x0)
    return next((y for x, y in points if x == target), None)


def condition_report(name: str, data: dict[str, dict[int, dict]]) -> dict:
    """H1-H5 (per-step methods against the GRPO baselines), H7's signals, H9 at matched training accuracy."""
    final = {m: {s: r["summary"]["final_test_pass@1"] for s, r in seeds.items()} for m, seeds in data.items()}
    diffs = {f"{m} - {b}": paired(final[m], final[b]) for m in final for b in BASES if m not in BASES and b in final}
    points = {m: {s: accuracy_points(r) for s, r in seeds.items()} for m, seeds in data.items()}
    reached = [max(x for x, _ in p) for seeds in points.values() for p in seeds.values() if p]
    target = min(reached) if reached else None
    matched = {m: {s: v for s, p in seeds.items() if (v := at_accuracy(p, target)) is not None}
               for m, seeds in points.items()} if target is not None else {}
    sig = {m: [signals(r) for r in seeds.values()] for m, seeds in data.items()}
    evaluated = [{i for i, _, _ in r["evals"]} for seeds in data.values() for r in seeds.values()]
    common = max(set.intersection(*evaluated), default=0)  # the last evaluated iteration every run reached
    at = {m: [next(p for i, _, p in r["evals"] if i == common) for r in seeds.values()
              if any(i == common for i, _, _ in r["evals"])] for m, seeds in data.items()}
    return {"seeds": sorted({s for seeds in data.values() for s in seeds}),
            "final_pass@1": {m: mean_se(list(v.values())) for m, v in final.items()},
            "differences": diffs,
            "entropy_states": paired(final["vineppo-entropy"], final["vineppo-scale"])  # H8's quality
            if "vineppo-entropy" in final and "vineppo-scale" in final else None,
            "iterations": {m: [r["summary"]["iterations"] for r in seeds.values()] for m, seeds in data.items()},
            "train_s": {m: [r["summary"]["train_s"] for r in seeds.values()] for m, seeds in data.items()},
            "signals": {m: {k: statistics.mean(v[k] for v in runs) for k in SIGNALS if all(k in v for v in runs)}
                        for m, runs in sig.items()},
            "matched_accuracy": target,
            "pass@1_at_matched_accuracy": {m: mean_se(list(v.values())) for m, v in matched.items() if v},
            "matched_differences": {f"{m} - {b}": paired(matched[m], matched[b]) for m in ("vineppo-scale",)
                                    for b in BASES if m in matched and b in matched},
            "equal_iterations": common,
            "pass@1_at_equal_iterations": {m: mean_se(v) for m, v in at.items() if v}}


def normalisation(runs: Path) -> dict:
    """H6: scale minus whitening within VinePPO and GRPO, over every single-turn (condition, seed) pair and per
    condition; the rule's choice for VinePPO."""
    out = {}
    for scaled, whitened in (("vineppo-scale", "vineppo"), ("grpo-scale", "grpo")):
        pairs, per = [], {}
        for c in SINGLE:
            runs_c = found(runs, c)
            if scaled in runs_c and whitened in runs_c:
                f = {m: {s: json.loads((p / "summary.json").read_text())["final_test_pass@1"]
                         for s, p in runs_c[m].items()} for m in (scaled, whitened)}
                per[c] = paired(f[scaled], f[whitened])
                pairs += [f[scaled][s] - f[whitened][s] for s in sorted(set(f[scaled]) & set(f[whitened]))]
        d = mean_se(pairs) if pairs else {"mean": None, "se": None, "values": []}
        whiten_better = bool(pairs) and d["se"] is not None and d["mean"] < -2 * d["se"]
        out[f"{scaled} - {whitened}"] = {**d, "pairs": len(pairs), "verdict": shown(d) if pairs else "not run",
                                        "per_condition": per, "default": "whiten" if whiten_better else "scale"}
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else None


def lead_against_flat(conditions: dict) -> dict:
    """H7: VinePPO's lead over Dr. GRPO (mean of vineppo and vineppo-scale) against Dr. GRPO's flat-group share."""
    rows = []
    for c in SINGLE:
        r = conditions.get(c)
        if not r or "dr-grpo" not in r["final_pass@1"]:
            continue
        leads = [r["differences"][f"{m} - dr-grpo"]["mean"] for m in ("vineppo", "vineppo-scale")
                 if f"{m} - dr-grpo" in r["differences"]]
        if leads:
            rows.append({"condition": c, "lead": statistics.mean(leads),
                         "flat_groups": r["signals"]["dr-grpo"]["signal/flat_groups"]})
    return {"rows": rows, "spearman": spearman([x["flat_groups"] for x in rows], [x["lead"] for x in rows])}


def heldout(folder: Path) -> dict:
    """The held-out shift: per condition, each method's pass@1 on 5-6 operations and the differences to the bases."""
    out = {}
    for c in ("hard", "groups-2", "groups-4"):
        scores: dict[str, dict[int, float]] = {}
        for p in sorted((folder / c).glob("*.json")):
            method, seed = p.stem.rsplit("-s", 1)
            scores.setdefault(method, {})[int(seed)] = json.loads(p.read_text())["pass@1"]
        if scores:
            out[c] = {"pass@1": {m: mean_se(list(v.values())) for m, v in scores.items()},
                      "differences": {f"{m} - {b}": paired(scores[m], scores[b]) for m in scores for b in BASES
                                      if m not in BASES and b in scores}}
    return out


def mental_math(folder: Path) -> dict:
    """The mental-math case: per normalisation, iteration 2's advantages and signal, entropy, and test pass@1."""
    out = {}
    for norm in ("whiten", "scale", "none"):
        run = folder / f"mental-math-plain-{norm}"
        if not (run / "metrics.jsonl").exists():
            continue
        rows = {r["iteration"]: r for r in metrics(run)}
        two = rows.get(2, {})
        out[norm] = {"iteration_2": {k: two.get(k) for k in ("advantage/mean", "advantage/std", "signal/nonzero_tokens",
                                                              "signal/shifted_zeros", "advantage/loss_mean", "loss",
                                                              "entropy", "train/response_tokens", "train/reward")},
                     "zero_after_whitening": (-two["advantage/mean"] / two["advantage/std"]
                                              if norm == "whiten" and two.get("advantage/std") else None),
                     "response_tokens": {i: r.get("train/response_tokens") for i, r in rows.items() if i > 0},
                     "entropy": {i: r.get("entropy") for i, r in rows.items() if i > 0},
                     "test_pass@1": {i: r["test/pass@1"] for i, r in rows.items() if "test/pass@1" in r}}
    return out


def plot_test_vs_train(panels: dict[str, dict[str, dict[int, dict]]], path: Path) -> None:
    """H9's plot: test pass@1 against training accuracy, one panel per condition (and the filed compare runs), each
    method's k-th evaluation averaged over its seeds (both coordinates)."""
    import matplotlib  # only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colours: dict[str, str] = {}  # a method keeps its colour across the panels
    for ax, (name, data) in zip(axes.flat, panels.items()):
        for m, seeds in data.items():
            runs = [accuracy_points(r) for r in seeds.values()]
            n = min(len(p) for p in runs)
            if n:
                ax.plot([statistics.mean(p[k][0] for p in runs) for k in range(n)],
                        [statistics.mean(p[k][1] for p in runs) for k in range(n)], marker="o", ms=3, label=m,
                        color=colours.setdefault(m, f"C{len(colours) % 10}"))
        ax.set(title=name, xlabel="training accuracy (mean train reward, 5 iterations)", ylabel="test pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def copy_runs(runs: Path, out: Path) -> None:
    """Each finished run's metrics, summary and config under OUT/runs/<condition>/ ($SCRATCH/study is RUNS)."""
    for c in CONDITIONS:
        for seeds in found(runs, c).values():
            for p in seeds.values():
                copy_run(p, out / "runs" / c / p.name, runs.parent)


def side_files(study: dict, args: argparse.Namespace) -> None:
    """The held-out shift and the mental-math case (their files copied to OUT), H8's cost and the selections, into
    `study`."""
    if args.heldout:
        study["heldout"] = heldout(args.heldout)
        for c in study["heldout"]:  # each evaluation's scores (its per-problem rows stay in the scratch folder)
            (args.out / "heldout" / c).mkdir(parents=True, exist_ok=True)
            for p in (args.heldout / c).glob("*.json"):
                shutil.copy(p, args.out / "heldout" / c / p.name)
    if args.mental_math:
        study["mental_math"] = mental_math(args.mental_math)
        for norm in study["mental_math"]:  # the case's runs, filed beside the study's
            copy_run(args.mental_math / f"mental-math-plain-{norm}", args.out / "mental-math" / norm, args.mental_math)
    if args.iteration:  # filed beside the selections (prep/), so read, not copied
        it = json.loads(args.iteration.read_text())
        study["iteration"] = {m: {"median_iteration_s": it[m]["median_iteration_s"], "ratio_to_grpo": it[m]["ratio_to_grpo"]}
                              for m in ("vineppo", "vineppo-scale", "vineppo-entropy", "grpo") if m in it}
        if "vineppo-entropy" in it:
            e = it["vineppo-entropy"]["median_iteration_s"]
            study["iteration"].update(entropy_over_vineppo=e / it["vineppo"]["median_iteration_s"],
                                      source=str(args.iteration))  # over GRPO's: its ratio_to_grpo
    if args.select:
        study["select"] = json.loads((args.select / "select.json").read_text())

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--choose-norm", type=Path, help="write H6's choice for VinePPO to this file and stop")
    ap.add_argument("--heldout", type=Path)
    ap.add_argument("--mental-math", type=Path)
    ap.add_argument("--iteration", type=Path)
    ap.add_argument("--select", type=Path, help="the folder of select.json")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    norm = normalisation(args.runs)
    if args.choose_norm:
        choice = norm["vineppo-scale - vineppo"]
        args.choose_norm.write_text(json.dumps({"advantage_norm": choice["default"], "from": choice}, indent=2) + "\n")
        print(f"VinePPO's normalisation: {choice['default']} (scale - whiten {choice['mean']}, SE {choice['se']}, "
              f"{choice['pairs']} pairs)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    copy_runs(args.runs, args.out)
    conditions, panels = {}, {}
    for c in CONDITIONS:
        data = load_all(args.runs, c)
        if data:
            conditions[c], panels[c] = condition_report(c, data), data
            plot_seconds(c, data, args.out / f"{c}.png")
    filed = load_all(Path(__file__).resolve().parents[1] / "compare", "runs")  # the filed compare runs, beside
    if filed:
        panels["compare (filed)"] = filed
    if panels:
        plot_test_vs_train(panels, args.out / "test-vs-train.png")
    study = {"conditions": conditions, "normalisation": norm, "lead_against_flat_groups": lead_against_flat(conditions)}
    side_files(study, args)
    (args.out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    print(json.dumps({c: {k: v["mean"] for k, v in r["differences"].items()} for c, r in conditions.items()}, indent=1))


if __name__ == "__main__":
    main()
