"""Where a run's numbers go: metrics.jsonl (always), TensorBoard (default), Weights & Biases (when asked)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vineppo.errors import UserError

console = Console(stderr=True)


class Tracker:
    """Appends one JSON line per logged step and mirrors scalars to TensorBoard / W&B."""

    def __init__(self, out: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None, keep_until: int | None = None, enabled: bool = True):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        if keep_until is not None and self.path.exists():  # a resumed run drops lines past its checkpoint
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("iteration", 0) <= keep_until]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy: only when the run writes TensorBoard files

            self.tb = SummaryWriter(str(out / "tensorboard"))
        if wandb_project:
            try:
                import wandb  # optional dependency: vineppo[wandb]
            except ImportError:

                raise UserError("--wandb needs the wandb package: pip install 'vineppo[wandb]'") from None
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(out))

    def log(self, step: int, metrics: dict) -> None:
        """Record `metrics` for iteration `step`."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"iteration": step, **metrics}) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the writers."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def progress_bar(enabled: bool = True) -> Progress:
    """A terminal progress bar with a free-text status column (phase, reward, accuracy) and an ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=not enabled, transient=False)


def plot_run(out: Path) -> Path | None:
    """curves.png in the run folder: test pass@1 and the test samples' behaviour shares against iteration and
    against training seconds (sampling, credit, updates), from metrics.jsonl; None before any evaluation."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    points = [r for r in rows if "test/pass@1" in r]
    if not points:
        return None
    import matplotlib  # heavy; only runs that evaluate draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    names = sorted({k.rsplit("/", 1)[1] for r in points for k, v in r.items() if k.startswith("test/behaviour/") and v})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((axes[0], "iteration", "iteration"), (axes[1], "time/train_s", "training seconds")):
        xs = [r.get(x, 0.0) for r in points]
        ax.plot(xs, [r["test/pass@1"] for r in points], "k-o", lw=2, label="test pass@1")
        for name in names:
            ax.plot(xs, [r.get(f"test/behaviour/{name}", 0.0) for r in points], "--", marker=".",
                    label=f"share {name}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("test pass@1 / share of samples")
    axes[1].legend(loc="best", fontsize=8)
    fig.suptitle(out.name)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
