"""Build results/long-chain/ from the study's runs: the protocol's statistic, the verdict, and the plots.

    python results/long-chain/report.py --runs DIR [--out results/long-chain]

DIR holds one `vineppo compare` folder per arm (default, long, long-adaptive), each run with final-eval.jsonl
(`vineppo eval` of its final checkpoint on the protocol's 2000 test problems x 2 samples), and sft-default.jsonl,
sft-long.jsonl (the SFT models on the same problems). See results/long-chain/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/studies.py, shared by the studies' reports
from studies import RUN_FILES, copy_run  # noqa: E402

BASELINES = ("ppo", "grpo", "rloo")
ARMS = {"default": "default", "long": "long", "long-adaptive": "long"}  # compare folder -> task


def score(path: Path) -> dict:
    """pass@1 of one evaluation and its standard error over problems (std of per-problem means / sqrt(N))."""
    per = [json.loads(line)["pass@1"] for line in path.read_text().splitlines() if line.strip()]
    return {"pass@1": statistics.fmean(per), "se": statistics.stdev(per) / math.sqrt(len(per)), "problems": len(per)}


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """Mean over seeds of a - b (paired by seed) and its standard error (sd of the differences / sqrt(seeds))."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    return {"mean": statistics.fmean(d), "se": statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None,
            "per_seed": d}


def curves(run: Path) -> list[dict]:
    """(train seconds, in-run test pass@1, mean train reward since the previous evaluation) at each evaluation."""
    pts, window = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "train/reward" in m:
            window.append(m["train/reward"])
        if "test/pass@1" in m:
            pts.append({"iteration": m["iteration"], "train_s": m.get("time/train_s", 0.0), "test": m["test/pass@1"],
                        "train": statistics.fmean(window) if window else None})
            window = []
    return pts


def collect(runs: Path) -> dict:
    """{arm: {algo: {seed: {...}}}} with the final evaluation, iterations, train seconds and MC tokens."""
    out = {}
    for arm in ARMS:
        for run in sorted((runs / arm / "runs").glob("*-s*")):
            algo, seed = run.name.rsplit("-s", 1)
            summary = json.loads((run / "summary.json").read_text())
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            out.setdefault(arm, {}).setdefault(algo, {})[int(seed)] = {
                "final": score(run / "final-eval.jsonl"), "iterations": summary["iterations"],
                "train_s": summary["train_s"], "curve": curves(run),
                "mc_tokens_per_iteration": statistics.fmean([m.get("mc/tokens", 0.0) for m in metrics
                                                             if "train/reward" in m]),
                "s_per_iteration": summary["train_s"] / summary["iterations"]}
    return out


def verdict(delta: dict) -> str:
    """The protocol's rule: supported when, for every baseline, long - default > 2 SE; not supported when the point
    estimate is <= 0 for every baseline; inconclusive otherwise."""
    gaps = [delta[b]["long_minus_default"] for b in BASELINES]
    if all(g["mean"] > 2 * g["se"] for g in gaps):
        return "supported"
    if all(g["mean"] <= 0 for g in gaps):
        return "not supported"
    return "inconclusive"


def plot(data: dict, out: Path) -> None:
    import matplotlib  # only for the figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, xlabel, name in (("train_s", "training seconds (sampling, credit, updates)", "test_vs_time"),
                              ("train", "train reward (mean since the previous evaluation)", "test_vs_train")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, arm in zip(axes, ("default", "long")):
            rows = sorted(data[arm].items()) + ([(f"{a} adaptive K", v) for a, v in data["long-adaptive"].items()]
                                                if arm == "long" and "long-adaptive" in data else [])
            for i, (label, seeds) in enumerate(rows):
                for s, r in sorted(seeds.items()):
                    pts = [p for p in r["curve"] if p[key] is not None]
                    ax.plot([p[key] for p in pts], [p["test"] for p in pts], color=f"C{i}", alpha=0.7,
                            marker="o", ms=3, label=label if s == min(seeds) else None)
            ax.set_title(f"{arm} task (in-run test: 200 problems x 4)", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test pass@1")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", default="results/long-chain")
    args = ap.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    data = collect(runs)
    finals = {arm: {algo: {s: r["final"]["pass@1"] for s, r in seeds.items()} for algo, seeds in algos.items()}
              for arm, algos in data.items()}
    delta = {}
    for b in BASELINES:
        d = {arm: paired(finals[arm]["vineppo"], finals[arm][b]) for arm in ("default", "long")}
        gap = d["long"]["mean"] - d["default"]["mean"]
        se = math.sqrt(d["long"]["se"] ** 2 + d["default"]["se"] ** 2)
        delta[b] = {**d, "long_minus_default": {"mean": gap, "se": se}}
    table = {arm: {algo: {"final_mean": statistics.fmean(v.values()), "final_sd": statistics.stdev(v.values()),
                          "per_seed": v, "eval_se": statistics.fmean(data[arm][algo][s]["final"]["se"] for s in v),
                          "iterations": statistics.fmean(data[arm][algo][s]["iterations"] for s in v),
                          "s_per_iteration": statistics.fmean(data[arm][algo][s]["s_per_iteration"] for s in v),
                          "mc_tokens_per_iteration": statistics.fmean(data[arm][algo][s]["mc_tokens_per_iteration"]
                                                                      for s in v)}
                   for algo, v in algos.items()} for arm, algos in finals.items()}
    sft = {task: score(runs / f"sft-{task}.jsonl") for task in ("default", "long")}
    result = {"sft": sft, "methods": table, "vineppo_minus_baseline": delta, "verdict": verdict(delta)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(data, out)
    for arm in ARMS:  # the raw runs: metrics, summaries, configs and final evaluations (no weights)
        for run in sorted((runs / arm / "runs").glob("*-s*")):
            copy_run(run, out / "runs" / arm / run.name, runs.parent, RUN_FILES + ("final-eval.json",))
    print(json.dumps({k: result[k] for k in ("sft", "vineppo_minus_baseline", "verdict")}, indent=1))
    for arm, algos in table.items():
        for algo, t in algos.items():
            print(f"{arm:14s} {algo:8s} {100 * t['final_mean']:.1f} ± {100 * t['final_sd']:.1f} (eval SE "
                  f"{100 * t['eval_se']:.1f}) it {t['iterations']:.1f} s/it {t['s_per_iteration']:.1f} "
                  f"MC tok/it {t['mc_tokens_per_iteration']:.0f}")


if __name__ == "__main__":
    main()
