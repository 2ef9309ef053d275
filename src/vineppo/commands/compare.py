"""`vineppo compare`: train several algorithms over several seeds with the same budget, then report.

Every (algorithm, seed) pair is one `vineppo train` subprocess writing OUT/runs/<algo>-s<seed>/, with the
same preset, iterations and seeds, so every algorithm samples the same number of responses per
iteration (checked before anything runs). `--jobs J` runs J at once, each with 1/J of the CPU threads.
A comparison is resumable: finished runs (summary.json) are skipped, half-finished ones continue with
`--resume`. `--report-only` rebuilds the report from the runs already there.

The report (OUT/report.md, OUT/compare.json, PNGs) has: test pass@1 against iteration and against
wall-clock (mean over seeds, band = standard deviation); test pass@1 against train reward (the paper's
generalisation plot); the wall-clock time at which each method first reaches PPO's best test accuracy;
and a table of means and standard deviations over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.core.tracking import console, progress_bar

PHASES = ("time/sampling_s", "time/credit_s", "time/update_s")
RUN_NAME = re.compile(r"^(?P<algo>[\w.-]+)-s(?P<seed>\d+)$")  # e.g. dpo-positive-s2


# ------------------------------------------------------------------------------------ running


def plan(algos: list[str], seeds: int, preset: str, train_args: list[str] = ()) -> None:
    """Check every run's settings (preset + --train-args) and that all sample as many responses per iteration."""
    if seeds < 1:
        raise UserError("--seeds must be >= 1")
    parser = argparse.ArgumentParser(prog="--train-args", add_help=False, exit_on_error=False)
    configs.add_config_arguments(parser)
    try:
        parsed, unknown = parser.parse_known_args(list(train_args))
    except argparse.ArgumentError as e:
        raise UserError(f"--train-args: {e}") from None
    if unknown:
        raise UserError(f"--train-args: not a training setting: {' '.join(unknown)}")
    flags = configs.overrides_from(parsed)
    budgets = {a: (c.prompts_per_iter * c.samples_per_prompt)
               for a in algos for c in [configs.resolve(configs.load_preset(preset), {**flags, "algo": a}, preset)]}
    if len(set(budgets.values())) > 1:
        raise UserError(f"preset {preset!r} gives the algorithms different sample budgets per iteration: {budgets}")


def train_command(run_dir: Path, algo: str, seed: int, iterations: int | None, preset: str,
                  extra: list[str]) -> list[str] | None:
    """The `vineppo train` command for one run: new, resumed, or None when it already finished."""
    it = ["--iterations", str(iterations)] if iterations else []
    summary = run_dir / "summary.json"
    done = json.loads(summary.read_text()) if summary.is_file() else None
    if done and (done.get("time_budget_reached") or not (iterations and done["iterations"] < iterations)):
        return None  # finished: all its iterations, or its --time-budget-s
    if (run_dir / "checkpoints" / "latest").is_file():  # half-finished, or finished and now asked for more
        return [sys.executable, "-m", "vineppo", "train", "--resume", str(run_dir), *it, "--json"]
    if summary.is_file():  # never delete a finished run
        raise UserError(f"{run_dir} finished fewer than {iterations} iterations and has no checkpoint to continue from")
    if run_dir.exists():  # started but killed before its first checkpoint: nothing worth keeping
        shutil.rmtree(run_dir)
    return [sys.executable, "-m", "vineppo", "train", "--config", preset, "--algo", algo, "--seed", str(seed),
            "--out", str(run_dir), *it, *extra, "--json"]


def cpu_threads() -> int:
    """The threads compare may use in all: OMP_NUM_THREADS when set to a positive integer, else the core count."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else (os.cpu_count() or 1)


def run_all(out: Path, algos: list[str], seeds: int, iterations: int | None, preset: str, jobs: int,
            extra: list[str]) -> list[str]:
    """Train every missing (algo, seed) run, `jobs` at a time; returns the names of runs that failed."""
    todo = []
    for algo in algos:
        for seed in range(seeds):
            run_dir = out / "runs" / f"{algo}-s{seed}"
            cmd = train_command(run_dir, algo, seed, iterations, preset, extra)
            if cmd is not None:
                todo.append((run_dir.name, cmd))
    if not todo:
        return []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # Split the CPU threads (OMP_NUM_THREADS if the user set it, else every core) between concurrent runs,
    # so they do not oversubscribe the cores.
    threads = str(max(1, cpu_threads() // jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    failed, running = [], {}
    bar = progress_bar()
    job = bar.add_task("compare", total=len(todo), status=f"{len(todo)} runs, {jobs} at a time")
    with bar:
        while todo or running:
            while todo and len(running) < jobs:
                name, cmd = todo.pop(0)
                log = (out / "logs" / f"{name}.log").open("a")
                running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
                bar.update(job, status="running " + ", ".join(running))
            time.sleep(1.0)
            for name, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                if proc.returncode != 0:
                    failed.append(name)
                    console.print(f"[red]{name} failed (exit {proc.returncode}); see {out / 'logs' / name}.log")
                bar.update(job, advance=1, status="running " + ", ".join(running))
    return failed


# ------------------------------------------------------------------------------------ reading runs


def load_run(run_dir: Path) -> dict:
    """A run's metrics lines (sorted by iteration) and summary."""
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {"metrics": sorted(lines, key=lambda m: m["iteration"]),
            "summary": json.loads((run_dir / "summary.json").read_text())}


def load_runs(out: Path) -> tuple[dict[str, dict[int, dict]], list[str]]:
    """{algo: {seed: run}} for the finished runs under OUT/runs, and the names of unfinished ones."""
    runs: dict[str, dict[int, dict]] = {}
    unfinished = []
    for d in sorted((out / "runs").glob("*")):
        m = RUN_NAME.match(d.name)
        if not d.is_dir() or not m:
            continue
        if not (d / "summary.json").is_file() or not (d / "metrics.jsonl").is_file():
            unfinished.append(d.name)
            continue
        runs.setdefault(m["algo"], {})[int(m["seed"])] = load_run(d)
    return runs, unfinished


def eval_points(run: dict) -> list[dict]:
    """(iteration, wall-clock, test pass@1, train reward) at each evaluated iteration; iteration 0 is the SFT model.

    The train reward of an evaluated iteration is the mean over the iterations since the previous evaluation:
    one iteration's reward is a noisy estimate from a single batch.
    """
    points, window = [], []
    # the clock counts from the process start: the seconds before training began (set-up and the starting model's
    # evaluation, logged at iteration 0) are left out, so the runs compare on their training alone
    origin = next((m.get("time/wall_clock_s", 0.0) for m in run["metrics"] if m.get("iteration") == 0), 0.0)
    for m in run["metrics"]:
        if "train/reward" in m:
            window.append(m["train/reward"])
        if "test/pass@1" in m:
            points.append({"iteration": m["iteration"], "wall_clock_s": m.get("time/wall_clock_s", 0.0) - origin,
                           "test": m["test/pass@1"], "train": sum(window) / len(window) if window else None})
            window = []
    return points


def spread(xs: list[float]) -> dict:
    """{"mean", "std"} (sample standard deviation; 0 for one value; None for none)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "std": None}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def curves(seed_runs: dict[int, dict]) -> dict:
    """Mean/std over seeds of test pass@1, wall-clock and train reward at the iterations every seed evaluated."""
    pts = {s: {p["iteration"]: p for p in eval_points(r)} for s, r in seed_runs.items()}
    common = sorted(set.intersection(*(set(p) for p in pts.values())))
    out = {"iteration": common}
    for key in ("test", "wall_clock_s", "train"):
        stats = [spread([pts[s][i][key] for s in pts]) for i in common]
        out[key] = [x["mean"] for x in stats]
        out[key + "_std"] = [x["std"] for x in stats]
    return out


def time_to_reach(run: dict, target: float) -> float | None:
    """Wall-clock seconds at the first evaluation with test pass@1 >= target (0 for the SFT model); None if never."""
    return next((p["wall_clock_s"] for p in eval_points(run) if p["test"] >= target), None)


def summarize(runs: dict[str, dict[int, dict]]) -> dict:
    """compare.json: per algorithm, mean/std over seeds of the headline numbers, and time to PPO's best."""
    order = list(configs.ALGOS)  # others after
    runs = dict(sorted(runs.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))
    ppo = runs.get("ppo")
    ppo_best = spread([r["summary"]["best_test_pass@1"] for r in ppo.values()])["mean"] if ppo else None
    algos = {}
    for algo, seed_runs in runs.items():
        seeds = sorted(seed_runs)
        rs = [seed_runs[s] for s in seeds]
        entry = {"seeds": seeds}
        for key in ("final_test_pass@1", "best_test_pass@1", "sft_test_pass@1"):
            entry[key] = spread([r["summary"][key] for r in rs])
        # Runs that evaluate a validation split (RestEM) pick their model by it: its test pass@1.
        entry["test_at_best_val_pass@1"] = spread([r["summary"].get("test_at_best_val_pass@1") for r in rs])
        entry["wall_clock_s"] = spread([r["summary"]["wall_clock_s"] for r in rs])
        entry["wall_clock_per_iteration_s"] = spread(
            [r["summary"]["wall_clock_s"] / r["summary"]["iterations"] for r in rs if r["summary"]["iterations"]])
        for phase in PHASES:  # mean seconds per iteration in each phase
            entry[phase] = spread([spread([m[phase] for m in r["metrics"] if phase in m])["mean"] for r in rs])
        per_seed = [time_to_reach(r, ppo_best) for r in rs] if ppo_best is not None else []
        reached = [t for t in per_seed if t is not None]
        # Mean over the seeds that reach it (with how many did); "never" when none does.
        entry["time_to_ppo_best_s"] = {**spread(reached), "reached": len(reached), "of": len(rs),
                                       "per_seed": per_seed}
        entry["curves"] = curves(seed_runs)
        algos[algo] = entry
    return {"ppo_best_test_pass@1": ppo_best, "algos": algos}


# ------------------------------------------------------------------------------------ report


def _fmt(ms: dict, pct: bool = False, unit: str = "") -> str:
    if ms["mean"] is None:
        return "n/a"
    if pct:
        return f"{100 * ms['mean']:.1f} ± {100 * ms['std']:.1f}"
    return f"{ms['mean']:.2f} ± {ms['std']:.2f}{unit}"


def _reach(t: dict) -> str:
    if t["mean"] is None:
        return "never"
    return f"{t['mean']:.0f} s ({t['reached']}/{t['of']} seeds)"


def write_report(out: Path, summary: dict, unfinished: list[str]) -> None:
    """report.md with the final table, time to PPO's best, and the plots."""
    best = summary["ppo_best_test_pass@1"]
    lines = ["# Comparison", "",
             "Mean ± standard deviation over seeds (sample std; 0 with one seed). Pass@1 in %. Seconds per phase "
             "are means per iteration. Test at best validation: the test pass@1 of the iteration with the best "
             "validation pass@1 (the model selection of runs that evaluate a validation split: RestEM).", "",
             "| method | seeds | final test | best test | SFT test | s / iteration | sampling s | credit s | update s "
             "| time to PPO best | test at best validation |", "|" + "---|" * 11]
    for algo, e in summary["algos"].items():
        lines.append(f"| {algo} | {len(e['seeds'])} | {_fmt(e['final_test_pass@1'], True)} | "
                     f"{_fmt(e['best_test_pass@1'], True)} | {_fmt(e['sft_test_pass@1'], True)} | "
                     f"{_fmt(e['wall_clock_per_iteration_s'])} | " + " | ".join(_fmt(e[p]) for p in PHASES) +
                     f" | {_reach(e['time_to_ppo_best_s'])} | {_fmt(e['test_at_best_val_pass@1'], True)} |")
    lines += ["", "## Time to PPO's best test accuracy", ""]
    if best is None:
        lines.append("No PPO runs: nothing to compare against.")
    else:
        lines.append(f"Target: PPO's best test pass@1, averaged over its seeds: {100 * best:.1f}%. For each seed, the "
                     f"logged wall-clock (`time/wall_clock_s` from the end of the starting model's evaluation: "
                     f"training including its periodic evaluations) of the first evaluation at or above it; the mean is over the seeds that "
                     f"reach it.")
        lines.append("")
        for algo, e in summary["algos"].items():
            lines.append(f"- {algo}: {_reach(e['time_to_ppo_best_s'])}")
    lines += ["", "## Plots", "", "![test vs iteration](test_vs_iteration.png)", "",
              "![test vs wall-clock](test_vs_wallclock.png)", "",
              "Generalisation: test pass@1 against train reward (the mean train reward since the previous evaluation) "
              "at each evaluated iteration, mean over seeds.", "", "![test vs train](test_vs_train.png)", ""]
    if unfinished:
        lines += [f"Unfinished runs (not included): {', '.join(unfinished)}", ""]
    (out / "report.md").write_text("\n".join(lines))


def plot(out: Path, summary: dict) -> None:
    """test_vs_iteration.png, test_vs_wallclock.png, test_vs_train.png."""
    import matplotlib  # optional dependency, only for figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    for name, xkey, xlabel in (("test_vs_iteration", "iteration", "iteration"),
                               ("test_vs_wallclock", "wall_clock_s", "wall-clock (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for algo, e in summary["algos"].items():
            c = e["curves"]
            y, sd = [100 * v for v in c["test"]], [100 * v for v in c["test_std"]]
            ax.plot(c[xkey], y, marker="o", ms=3, label=algo)
            ax.fill_between(c[xkey], [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], alpha=0.2)
        if summary["ppo_best_test_pass@1"] is not None:
            ax.axhline(100 * summary["ppo_best_test_pass@1"], color="grey", ls="--", lw=0.8, label="PPO best")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test pass@1 (%)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for algo, e in summary["algos"].items():
        c = e["curves"]
        pts = [(100 * tr, 100 * te) for tr, te in zip(c["train"], c["test"]) if tr is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=algo)
    ax.set_xlabel("train reward (%)")
    ax.set_ylabel("test pass@1 (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "test_vs_train.png", dpi=120)
    plt.close(fig)


def report(out: Path) -> dict:
    """Build report.md, compare.json and the plots from the finished runs in OUT/runs; returns compare.json."""
    runs, unfinished = load_runs(out)
    if not runs:
        raise UserError(f"{out / 'runs'}: no finished runs (<algo>-s<seed>/ with summary.json) to report on")
    summary = summarize(runs)
    (out / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(out, summary, unfinished)
    plot(out, summary)
    return summary


# ------------------------------------------------------------------------------------ command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo compare`."""
    p.add_argument("--algos", default="vineppo,ppo,grpo,rloo",
                   help=f"comma-separated algorithms: any of {', '.join(configs.ALGOS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 for every algorithm (default 3)")
    p.add_argument("--iterations", type=int, default=None, help="RL iterations per run (default: the preset's)")
    p.add_argument("--config", default="arith-tiny", help="training preset or YAML file (default: arith-tiny)")
    p.add_argument("--out", default="runs/compare", help="comparison folder (default: runs/compare)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once (the CPU threads, OMP_NUM_THREADS or every core, are split between them)")
    p.add_argument("--train-args", default="", help="extra flags for every new `vineppo train`, e.g. '--device cpu'")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the runs in --out")
    p.add_argument("--json", action="store_true", help="print compare.json")


def _ensure_start_model(preset: str, train_args: str) -> None:
    """Train the shared default SFT model once, before parallel runs would each start training it."""
    cfg = configs.resolve(configs.load_preset(preset), {})
    if cfg.model == "auto" and "--model" not in train_args:
        from vineppo.training.sft import default_model  # torch and transformers: only when the SFT model is made

        default_model(cfg.task, cfg.data, train_missing=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo compare`."""
    out = Path(args.out)
    failed = []
    if not args.report_only:
        algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        if not algos:
            raise UserError("--algos is empty")
        if args.jobs < 1 or (args.iterations is not None and args.iterations < 1):
            raise UserError("--jobs and --iterations must be >= 1")
        plan(algos, args.seeds, args.config, shlex.split(args.train_args))
        _ensure_start_model(args.config, args.train_args)
        failed = run_all(out, algos, args.seeds, args.iterations, args.config, args.jobs, shlex.split(args.train_args))
    summary = report(out)
    if args.json:
        print(json.dumps(summary))
    else:
        print((out / "report.md").read_text())
        print(f"wrote {out / 'report.md'}, {out / 'compare.json'} and plots", file=sys.stderr)
    if failed:
        print(f"vineppo compare: {len(failed)} run(s) failed: {', '.join(failed)} (logs in {out / 'logs'})",
              file=sys.stderr)
    return 1 if failed else 0
