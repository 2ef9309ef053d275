"""Where a run's numbers go: metrics.jsonl (always), TensorBoard (default), Weights & Biases (when asked); the tables
of sampled responses (completions.jsonl), the run's plan before it starts, and its curves.png."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError

console = Console(stderr=True)
PROGRESS_EVERY = 10.0  # seconds between a long phase's progress lines outside a terminal (Meter)
_IMPORTED = time.perf_counter()  # the fallback start of the process where /proc does not say
GPU_SIZED_TOKENS = 2_000_000  # a plan that samples more tokens than this (at the length cap) is GPU-sized on a CPU
COMPLETIONS = "completions.jsonl"  # in the run folder: the tables of sampled responses


def process_start() -> float:
    """The perf_counter() reading at which this process started (Linux: from /proc; else when this module loaded)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start time
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return time.perf_counter() - age if 0 <= age < 10 * 86400 else _IMPORTED


class Tracker:
    """Appends one JSON line per logged step and mirrors scalars to TensorBoard / W&B."""

    def __init__(self, out: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None, keep_until: int | None = None, enabled: bool = True):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        if keep_until is not None:  # a resumed run drops lines past its checkpoint
            for path in (self.path, out / COMPLETIONS):
                if path.exists():
                    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
                    kept = [ln for ln in lines if json.loads(ln).get("iteration", 0) <= keep_until]
                    path.write_text("".join(ln + "\n" for ln in kept))
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

    def table(self, step: int, rows: list[dict]) -> None:
        """Record a table of sampled responses for iteration `step`: lines of completions.jsonl, TensorBoard text,
        a W&B table."""
        if not self.enabled or not rows:
            return
        with (self.path.parent / COMPLETIONS).open("a") as f:
            f.write("".join(json.dumps({"iteration": step, **row}, default=str) + "\n" for row in rows))
        columns = list(dict.fromkeys(k for row in rows for k in row))
        if self.tb is not None:
            self.tb.add_text("completions", _markdown(columns, rows), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb  # optional dependency, imported in __init__ already when --wandb is on

            table = wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
            self.wandb.log({"completions": table}, step=step)

    def close(self) -> None:
        """Flush and close the writers."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _cell(value) -> str:
    """A table cell as text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _markdown(columns: list[str], rows: list[dict]) -> str:
    """The rows as a Markdown table (TensorBoard's text tab renders it)."""
    cell = lambda v: _cell(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows])


def plan(cfg: TrainConfig, device: str, done: int, evaluated: int) -> tuple[str, str | None]:
    """The run's plan in one line (iterations x prompts x responses x tokens, Monte Carlo, evaluations) and, for
    GPU-sized settings on a CPU, a warning naming what to use instead (None otherwise). `done`: iterations done
    already (a resume); `evaluated`: the test and validation problems of one evaluation."""
    left = cfg.iterations - done
    every = [i for i in range(done + 1, cfg.iterations + 1) if cfg.eval_every and i % cfg.eval_every == 0]
    evals = (len(every) + (cfg.iterations not in every) + (done == 0)) if evaluated else 0
    states = (f"at most {cfg.mc_max_states} states per response" if cfg.mc_states == "all" else
              f"the states {cfg.mc_states} picks per response (at most {cfg.mc_max_states})")
    mc = f"Monte Carlo: K = {cfg.mc_k} continuations from each of {states}" if cfg.estimator == "vine" else \
        "no Monte Carlo"
    plural = lambda n, word: f"{n} {word}" + "s" * (n != 1)  # noqa: E731
    evaluation = (f"{plural(evals, 'evaluation')} of {evaluated} problems x {cfg.eval_samples} samples" if evals
                  else "no evaluation")
    turns = cfg.max_turns if cfg.tools or cfg.env else 1  # a dialogue: turns of at most max_new_tokens each
    length = f"dialogues of at most {turns} turns x {cfg.max_new_tokens} tokens" if turns > 1 or cfg.tools or cfg.env \
        else f"at most {cfg.max_new_tokens} tokens"
    ends = (f"; it ends after {plural(left, 'iteration')} or {cfg.time_budget_s:g} s of training (sampling, credit, "
            f"updates), whichever comes first" if cfg.time_budget_s > 0 else "")
    line = (f"plan: {plural(left, 'iteration')} x {cfg.prompts_per_iter} prompts x {cfg.samples_per_prompt} responses "
            f"x {length}; {mc}; {evaluation}{ends}")
    responses = left * cfg.prompts_per_iter * cfg.samples_per_prompt
    tokens = (responses + evals * evaluated * cfg.eval_samples) * cfg.max_new_tokens * turns
    if device != "cpu" or tokens <= GPU_SIZED_TOKENS:
        return line, None
    instead = {"custom": "--config custom-cpu", "arith": "--config arith-tiny"}.get(
        cfg.task, "fewer --iterations, --prompts-per-iter, --max-new-tokens and --eval-problems")
    return line, (f"warning: GPU-sized settings on a CPU: up to {tokens / 1e6:,.1f}M tokens to sample before any Monte "
                  f"Carlo (a 135M-parameter model samples a few hundred tokens a second on a CPU core); for a CPU use "
                  f"{instead}, or a YAML file of your own (--config FILE.yaml, as examples/*/train.yaml)")


class Meter:
    """A long phase's progress from an engine's Progress calls (`meter(done, tokens)`): samples done (of `total` when
    known) and tokens a second, counted over the phase's jobs (each job counts from 0 again), handed to `show` as one
    text at most every `every` seconds (outside a terminal that makes a line, so a log is never silent for long)."""

    def __init__(self, label: str, total: int | None, show: Callable[[str], None], every: float | None = None,
                 unit: str = "samples"):
        self.label, self.total, self.show, self.unit = label, total, show, unit
        self.every = PROGRESS_EVERY if every is None else every
        self.start = self.shown = time.perf_counter()
        self.before, self.job = (0, 0), (0, 0)  # (done, tokens) of the phase's earlier jobs, and of the current one

    def __call__(self, done: int, tokens: int) -> None:
        if done < self.job[0]:  # a new job counts from 0: the last one's counts join the phase's
            self.before = (self.before[0] + self.job[0], self.before[1] + self.job[1])
        self.job = (done, tokens)
        now = time.perf_counter()
        if now - self.shown >= self.every:
            self.shown = now
            self.show(self.text())

    @property
    def done(self) -> int:
        """Samples done in the phase so far."""
        return self.before[0] + self.job[0]

    def text(self) -> str:
        """'evaluating: 320/800 samples, 1,240 tokens/s'."""
        tokens, seconds = self.before[1] + self.job[1], max(time.perf_counter() - self.start, 1e-9)
        of = f"/{self.total}" if self.total else ""
        return f"{self.label}: {self.done}{of} {self.unit}" + (f", {tokens / seconds:,.0f} tokens/s" if tokens else "")


def progress_bar(enabled: bool = True) -> Progress:
    """A terminal progress bar with a free-text status column (phase, reward, accuracy) and an ETA."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=not enabled, transient=False)


def plot_run(out: Path) -> Path | None:
    """curves.png in the run folder: the training reward (the mean reward of each iteration's responses), test pass@1
    and the test samples' behaviour shares against iteration and against training seconds (sampling, credit,
    updates), from metrics.jsonl; None before any iteration or evaluation."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    points = [r for r in rows if "test/pass@1" in r]
    trained = [r for r in rows if "train/reward" in r]
    if not points and not trained:
        return None
    import matplotlib  # heavy; only runs that evaluate draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    names = sorted({k.rsplit("/", 1)[1] for r in points for k, v in r.items() if k.startswith("test/behaviour/") and v})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((axes[0], "iteration", "iteration"), (axes[1], "time/train_s", "training seconds")):
        ax.plot([r.get(x, 0.0) for r in trained], [r["train/reward"] for r in trained], color="tab:blue", lw=1,
                alpha=0.8, label="train reward (mean)")
        xs = [r.get(x, 0.0) for r in points]
        ax.plot(xs, [r["test/pass@1"] for r in points], "k-o", lw=2, label="test pass@1")
        for name in names:
            ax.plot(xs, [r.get(f"test/behaviour/{name}", 0.0) for r in points], "--", marker=".",
                    label=f"share {name}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    rewards = [r["train/reward"] for r in trained]
    axes[0].set_ylim(min(0.0, *rewards) if rewards else 0.0, max(1.0, *rewards) if rewards else 1.0)
    axes[0].set_ylabel("reward / test pass@1 / share of samples")
    axes[1].legend(loc="best", fontsize=8)
    fig.suptitle(out.name)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
