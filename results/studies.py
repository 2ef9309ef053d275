"""What the pre-registered studies' reports (results/cheap-credit, agents, trl and regimes: report.py) share: the
mean and standard error over seeds, the protocols' 2-SE rule, a run's evaluations, the copy of a run's files into
results/ and the plot of test pass@1 against training seconds."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

RUN_FILES = ("metrics.jsonl", "summary.json", "config.yaml")  # what results/ keeps of a run: no weights


def mean_se(xs: list[float]) -> dict:
    """Mean, standard error (sample sd / sqrt n; None for one value) and the values."""
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return {"mean": statistics.mean(xs), "se": se, "values": xs}


def shown(d: dict) -> str:
    """The protocols' rule: a mean more than 2 standard errors from 0."""
    return "shown" if d["se"] is not None and abs(d["mean"]) > 2 * d["se"] else "not shown"


def metrics(folder: Path) -> list[dict]:
    """A run's metrics.jsonl, a dict a line."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def evaluations(rows: list[dict]) -> list[tuple[int, float, float]]:
    """A run's evaluations among its metrics rows: (iteration, training seconds, test pass@1)."""
    return [(r["iteration"], r.get("time/train_s", 0.0), r["test/pass@1"]) for r in rows if "test/pass@1" in r]


def copy_run(run: Path, dest: Path, scratch: Path, names: tuple = RUN_FILES) -> None:
    """A run's files into `dest`, the scratch folder's path written as $SCRATCH (the commands' name for it)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (run / name).exists():
            (dest / name).write_text((run / name).read_text().replace(str(scratch.resolve()), "$SCRATCH"))


def plot_seconds(task: str, data: dict, path: Path) -> None:
    """Test pass@1 against training seconds: each method's mean over seeds at its evaluations, the range shaded
    (`data[method][seed]["evals"]` as `evaluations` gives them)."""
    import matplotlib  # only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m, runs in data.items():
        n = min(len(r["evals"]) for r in runs.values())
        xs = [statistics.mean(r["evals"][k][1] for r in runs.values()) for k in range(n)]
        ys = [[r["evals"][k][2] for r in runs.values()] for k in range(n)]
        ax.plot(xs, [statistics.mean(y) for y in ys], marker="o", ms=3, label=m)
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15)
    ax.set(xlabel="training seconds (sampling, credit, update)", ylabel="test pass@1",
           title=f"{task}: test pass@1 against seconds (mean of {len(next(iter(data.values())))} seeds, range)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
