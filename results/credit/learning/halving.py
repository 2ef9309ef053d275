"""Learning speed on the skip tasks: per run, the first iteration (and its logged wall-clock) at which the
skipped-operation share of the training samples falls to half its first-iteration value (the SFT model's
samples), as in the six-method comparison, the responses sampled until then, and the test pass@1 and skip
share before and after; then, per method, the seed ranges the protocol's verdict compares, and (with --plot)
the skip share against iterations, one panel per method and one overlay.

Usage: python results/credit/learning/halving.py [--plot DIR] RUN_DIR...   (run folders named METHOD-sSEED)
"""

import argparse
import re
import statistics
from pathlib import Path

from vineppo.commands.compare import load_run

BEHAVIOUR = "skip"
CEILING_FRACTION = 0.7  # of the careful style's test pass@1 (the SFT model's): set after the runs, not by the protocol


def halving(m: list[dict]) -> dict:
    """When the training samples' skip share first falls to half its iteration-1 value: iteration, responses,
    seconds (all None when it does not within the run)."""
    start = m[1][f"train/behaviour/{BEHAVIOUR}"]  # iteration 1 samples from the SFT model
    hit = next((r for r in m[2:] if r[f"train/behaviour/{BEHAVIOUR}"] <= start / 2), None)
    if hit is None:
        return {"iteration": None, "responses": None, "seconds": None}
    return {"iteration": hit["iteration"], "responses": sum(r["episodes"] for r in m[1:hit["iteration"] + 1]),
            "seconds": hit["time/wall_clock_s"]}


def ceiling(m: list[dict]) -> dict:
    """The careful style's ceiling (the SFT model's test pass@1 on its careful samples), the final pass@1 as a
    fraction of it, and the first evaluated iteration (its seconds) with pass@1 >= CEILING_FRACTION of it."""
    top = m[0]["test/behaviour_pass@1/careful"]
    hit = next((r for r in m[1:] if r.get("test/pass@1", -1) >= CEILING_FRACTION * top), None)
    return {"ceiling": top, "final": m[-1]["test/pass@1"] / top, "iteration": hit and hit["iteration"],
            "seconds": hit and hit["time/wall_clock_s"]}


def row(run: Path) -> str:
    """One markdown table row for the run folder `run`."""
    m = load_run(run)["metrics"]  # sorted by iteration; iteration 0 is the SFT model's evaluation
    h = halving(m)
    when = (f"{h['iteration']} | {h['responses']:.0f} | {h['seconds']:.0f}" if h["iteration"] else
            f"not in {m[-1]['iteration']} | | ")
    end = m[-1]
    return (f"| {run.name} | {when} | {m[0]['test/pass@1']:.3f} → {end['test/pass@1']:.3f} | "
            f"{m[0][f'test/behaviour/{BEHAVIOUR}']:.3f} → {end[f'test/behaviour/{BEHAVIOUR}']:.3f} | "
            f"{end['time/wall_clock_s']:.0f} |")


def by_method(runs: list[Path]) -> dict[str, list[Path]]:
    """Run folders grouped by method (the name before -sSEED), in the order first seen."""
    out: dict[str, list[Path]] = {}
    for r in runs:
        out.setdefault(re.sub(r"-s\d+$", "", r.name), []).append(r)
    return out


def _range(values: list) -> str:
    """min-max of the values, a run that never halves counted as 'none' (above every number)."""
    done = sorted(v for v in values if v is not None)
    missing = len(values) - len(done)
    text = f"{done[0]:.0f}-{done[-1]:.0f}" if done else "none"
    return text + (f" (+{missing} not halved)" if missing and done else "")


def summary(runs: list[Path]) -> list[str]:
    """Per method: seeds, halving ranges (iterations, responses, seconds), final test pass@1 and skip share."""
    lines = ["| method | seeds | halved at iteration | responses | seconds | final test pass@1 | final test skip share "
             f"| train s / iteration | final / careful ceiling | {CEILING_FRACTION:.0%} of the ceiling at iteration "
             "| (seconds) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, rs in by_method(runs).items():
        ms = [load_run(r)["metrics"] for r in rs]
        hs = [halving(m) for m in ms]
        final = [m[-1]["test/pass@1"] for m in ms]
        skip = [m[-1][f"test/behaviour/{BEHAVIOUR}"] for m in ms]
        per_it = [m[-1]["time/train_s"] / m[-1]["iteration"] for m in ms]  # sampling, credit, update
        sd = statistics.stdev(final) if len(final) > 1 else 0.0
        cs = [ceiling(m) for m in ms]
        lines.append(f"| {method} | {len(rs)} | {_range([h['iteration'] for h in hs])} | "
                     f"{_range([h['responses'] for h in hs])} | {_range([h['seconds'] for h in hs])} | "
                     f"{statistics.mean(final):.3f} ± {sd:.3f} | {statistics.mean(skip):.3f} | "
                     f"{statistics.mean(per_it):.1f} | {statistics.mean(c['final'] for c in cs):.2f} | "
                     f"{_range([c['iteration'] for c in cs])} | {_range([c['seconds'] for c in cs])} |")
    return lines


def curves(runs: list[Path]) -> list[str]:
    """Per method, the mean over seeds of the test skip share and test pass@1 at each evaluated iteration."""
    lines = []
    for method, rs in by_method(runs).items():
        evals = [[x for x in load_run(r)["metrics"] if "test/pass@1" in x] for r in rs]
        n = min(map(len, evals))
        its = [e["iteration"] for e in evals[0][:n]]
        share = [statistics.mean(ev[i][f"test/behaviour/{BEHAVIOUR}"] for ev in evals) for i in range(n)]
        pass1 = [statistics.mean(ev[i]["test/pass@1"] for ev in evals) for i in range(n)]
        if not lines:
            lines = [f"| method | test skip share at iterations {' / '.join(map(str, its))} | test pass@1 |",
                     "|---|---|---|"]
        lines.append(f"| {method} | {' / '.join(f'{v:.3f}' for v in share)} | {' / '.join(f'{v:.3f}' for v in pass1)} |")
    return lines


def paired(runs: list[Path], ref: str = "vineppo") -> list[str]:
    """Per method, `ref`'s test skip share minus the method's, seed by seed (same seed: same SFT evaluation, same
    prompts per iteration): the mean and the seeds' range at each evaluated iteration."""
    groups = by_method(runs)
    evals = {m: {re.search(r"-s(\d+)$", r.name)[1]: {x["iteration"]: x for x in load_run(r)["metrics"]
                                                     if "test/pass@1" in x} for r in rs} for m, rs in groups.items()}
    its = sorted(i for i in next(iter(evals[ref].values())) if i > 0)
    lines = [f"| {ref} minus | " + " | ".join(f"iteration {i}" for i in its) + " |", "|---" * (len(its) + 1) + "|"]
    for method, seeds in evals.items():
        if method == ref:
            continue
        cells = []
        for i in its:
            d = [evals[ref][s][i][f"test/behaviour/{BEHAVIOUR}"] - seeds[s][i][f"test/behaviour/{BEHAVIOUR}"]
                 for s in seeds if s in evals[ref]]
            cells.append(f"{statistics.mean(d):+.3f} [{min(d):+.3f}, {max(d):+.3f}]")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def plot(runs: list[Path], out: Path) -> None:
    """shares_by_method.png (a panel per method, a line per seed) and shares_overlay.png (means over seeds: the
    training samples' share per iteration, the test samples' at each evaluation)."""
    import matplotlib  # optional dependency, only for the figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    groups = by_method(runs)
    key = f"train/behaviour/{BEHAVIOUR}"
    fig, axes = plt.subplots(1, len(groups), figsize=(3 * len(groups), 3), sharey=True, squeeze=False)
    means = {}
    for ax, (method, rs) in zip(axes[0], groups.items()):
        curves = []
        for r in rs:
            m = [x for x in load_run(r)["metrics"] if key in x]
            ax.plot([x["iteration"] for x in m], [x[key] for x in m], lw=1, label=r.name[len(method) + 1:])
            curves.append([x[key] for x in m])
        n = min(map(len, curves))
        means[method] = [statistics.mean(c[i] for c in curves) for i in range(n)]
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("iteration")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("skip share of the training samples")
    fig.tight_layout()
    fig.savefig(out / "shares_by_method.png", dpi=110)
    plt.close(fig)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, ys in means.items():
        left.plot(range(1, len(ys) + 1), ys, lw=1.2, label=method)
        evals = [[x for x in load_run(r)["metrics"] if "test/pass@1" in x] for r in groups[method]]
        n = min(map(len, evals))
        right.plot([e["iteration"] for e in evals[0][:n]],
                   [statistics.mean(ev[i][f"test/behaviour/{BEHAVIOUR}"] for ev in evals) for i in range(n)],
                   marker="o", ms=3, lw=1.2, label=method)
    left.set_title("training samples (mean over seeds)", fontsize=9)
    right.set_title("test samples, fixed problems (mean over seeds)", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("iteration")
        ax.set_ylabel("skip share")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "shares_overlay.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", type=Path, default=None, help="folder for shares_by_method.png, shares_overlay.png")
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    print("| run | halved at iteration | responses | seconds | test pass@1 | test skip share | run seconds |")
    print("|---|---|---|---|---|---|---|")
    for d in args.runs:
        print(row(d))
    print()
    print("\n".join(summary(args.runs)))
    print()
    print("\n".join(curves(args.runs)))
    print()
    print("\n".join(paired(args.runs)))
    if args.plot:
        args.plot.mkdir(parents=True, exist_ok=True)
        plot(args.runs, args.plot)
