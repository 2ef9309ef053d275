"""`vineppo analyze-values`: each method's value estimates against Monte Carlo ground truth (vineppo.analysis.values)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vineppo.analysis.values import EXTRA_K, METHODS, Study, analyze, critic_state_values, load_inputs
from vineppo.core import config as configs
from vineppo.core.config import ENGINES, check_engine
from vineppo.core.errors import UserError
from vineppo.core.tracking import console as err_console
from vineppo.core.tracking import progress_bar
from vineppo.models.prompts import HELP
from vineppo.tasks import DATA_HELP, custom

LABELS = {"vineppo_k1": "VinePPO K=1", "vineppo_k3": "VinePPO K=3", "vineppo_k9": "VinePPO K=9",
          "ppo_critic": "PPO critic", "grpo": "GRPO (group mean)", "rloo": "RLOO (leave-one-out mean)",
          "tempo": "TEMPO (shared prefixes)"}


def print_table(result: dict, console) -> None:
    """The MAE / ranking table in the terminal."""
    rk = result["ranking"]
    table = Table(title=f"value estimates on {result['states']} states (ground truth: {result['settings']['gt_k']} "
                        f"rollouts)")
    table.add_column("method")
    table.add_column("MAE", justify="right")
    table.add_column(f"step ranking ({rk['pairs']} pairs)", justify="right")
    for m in METHODS:
        a, r = result["mae"][m], result["ranking_accuracy"][m]
        table.add_row(LABELS[m], "n/a" if a is None else f"{a:.4f}", "n/a" if r is None else f"{r:.1%}")
    console.print(table)
    step = "next turns" if "per_turn" in result else "steps"
    console.print(f"ranking: {rk['states']} states, {rk['alternatives']} alternative {step}, {rk['pairs']} pairs "
                  f"counted; {rk['pairs_excluded_true_tie']} pairs with exactly equal true values excluded; a "
                  f"predicted tie counts as wrong.")
    if "per_turn" in result:
        print_turns(result, console)
    console.print(f"the truth's mean standard error: {result['truth_se']:.4f} (a noise floor under every MAE)")
    if result["mae"]["ppo_critic"] is None:
        console.print("PPO critic: not evaluated (no --critic RUN_DIR given).")
    console.print(f"TEMPO: {result['tempo_shared_states']:.0%} of the states are shared by two or more of their group's "
                  f"responses; the others take the value of the deepest shared prefix before them.")
    table = Table(title="compute axis: VinePPO's Monte Carlo, fixed K and adaptive K (max 9), on the same states")
    for col in ("setting", "MAE", "step ranking", "continuations / state", "MC tokens / state"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in result["compute"]:
        table.add_row(compute_label(r), f"{r['mae']:.4f}", "n/a" if r["ranking_accuracy"] is None else
                      f"{r['ranking_accuracy']:.1%}", f"{r['continuations_per_state']:.2f}", f"{r['tokens_per_state']:.0f}")
    console.print(table)


def print_turns(result: dict, console) -> None:
    """A dialogue task's MAE per turn: the states at each turn start (turn 1: the prompt)."""
    shown = [m for m in METHODS if result["mae"][m] is not None]
    table = Table(title="MAE per turn (the states at the start of each turn of the policy's dialogues)")
    for col in ("turn", "states", "mean true value", "truth's SE", *(LABELS[m] for m in shown)):
        table.add_column(col, justify="left" if col == "turn" else "right")
    for t, row in result["per_turn"].items():
        table.add_row(str(int(t) + 1), str(row["states"]), f"{row['true_mean']:.3f}", f"{row['truth_se']:.3f}",
                      *(f"{row['mae'][m]:.4f}" for m in shown))
    console.print(table)


def compute_label(row: dict) -> str:
    """'K=9' or 'adaptive agree, k_min 3' for a row of the compute axis."""
    if row["rule"] == "fixed":
        return f"K={row['k_min']}"
    return f"adaptive {row['rule']}, k_min {row['k_min']}, K {row['k_max']}"


def plot_compute(result: dict, path: Path) -> None:
    """Value error (MAE against the ground truth) against Monte Carlo tokens per state, one point per K setting."""
    import matplotlib  # optional dependency, only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in result["compute"]:
        fixed = r["rule"] == "fixed"
        ax.scatter(r["tokens_per_state"], r["mae"], marker="o" if fixed else "^", color="C0" if fixed else "C1")
        ax.annotate(compute_label(r), (r["tokens_per_state"], r["mae"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xlabel("Monte Carlo tokens per state")
    ax.set_ylabel(f"MAE vs {result['settings']['gt_k']}-rollout truth")
    ax.set_title(f"value error per Monte Carlo token ({result['states']} states)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(result: dict, path: Path) -> None:
    """Predicted vs true value, one panel per method."""
    import matplotlib  # optional dependency, only for figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    fig, axes = plt.subplots(2, 4, figsize=(16, 8), sharex=True, sharey=True)
    for ax in axes.flat[len(METHODS):]:
        ax.set_visible(False)
    truth = [r["true"] for r in result["rows"]]
    for ax, m in zip(axes.flat, METHODS):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        if result["mae"][m] is None:
            ax.text(0.5, 0.5, "not evaluated\n(no --critic)", ha="center", va="center")
        else:
            ax.scatter(truth, [r[m] for r in result["rows"]], s=12, alpha=0.6)
        ax.set_title(LABELS[m] + ("" if result["mae"][m] is None else f"  MAE {result['mae'][m]:.3f}"), fontsize=10)
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
    for ax in axes[-1]:
        ax.set_xlabel(f"true value ({result['settings']['gt_k']} rollouts)")
    for ax in axes[:, 0]:
        ax.set_ylabel("predicted value")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo analyze-values`."""
    p.add_argument("--model", default=None,
                   help="policy folder, .gguf file or hub id (default with --critic: that run's latest checkpoint)")
    p.add_argument("--prompt-format", default=None, help=HELP)
    p.add_argument("--task", default="arith", help="task name (default: arith); a custom task with --tools or --env "
                   "is valued at its dialogues' turn starts")
    p.add_argument("--critic", default=None, metavar="RUN_DIR", help="a `vineppo train --algo ppo` run folder")
    p.add_argument("--states", type=int, default=64, help="states whose value is estimated (default 64)")
    p.add_argument("--gt-k", type=int, default=256, help="rollouts per state for the ground truth (default 256)")
    p.add_argument("--ranking-states", type=int, default=None,
                   help="states for step ranking (default: a fifth of --states; each costs --alternatives states)")
    p.add_argument("--alternatives", type=int, default=5, help="alternative next steps per ranking state (default 5)")
    p.add_argument("--split", default="test")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="response / continuation length cap (a dialogue: of each turn)")
    p.add_argument("--token-budget", type=int, default=65536, help="engine: max rows x tokens in one decode batch")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--engine", default="native", help=f"rollout backend: {' or '.join(ENGINES)} (default native)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of generated data sets (arith) and of the few-shot "
                   "draw (default 0, as train's)")
    p.add_argument("--out", default=None, help="folder for values.json and values.png (default: runs/values-<time>)")
    p.add_argument("--json", action="store_true", help="print the MAE / ranking summary as one JSON object")
    custom.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo analyze-values`."""
    configs.check_flags(vars(args), dict(states=configs.AT_LEAST_1, gt_k=configs.AT_LEAST_1,
                                         ranking_states=configs.AT_LEAST_0, max_new_tokens=configs.AT_LEAST_1))
    ranking_states = args.ranking_states if args.ranking_states is not None else math.ceil(args.states / 5)
    check_engine(args.engine)
    if ranking_states and args.alternatives < 2:
        raise UserError("--alternatives must be >= 2 to rank steps (or pass --ranking-states 0)")
    if args.token_budget <= args.max_new_tokens:
        raise UserError(f"--token-budget: smaller than one row (a prompt plus --max-new-tokens {args.max_new_tokens} "
                        f"tokens), got {args.token_budget}")
    out = Path(args.out) if args.out else Path("runs") / f"values-{time.strftime('%Y%m%d-%H%M%S')}"
    got = load_inputs(args, out, lambda ckpt: args.model or (str(ckpt) if ckpt else None))
    task, examples, critic, model_dir, tokenizer, prompter, engine = (got.task, got.examples, got.critic,
                                                                      got.model_dir, got.prompter.tokenizer,
                                                                      got.prompter, got.engine)
    critic_fn = critic_state_values(critic, tokenizer.pad_token_id) if critic is not None else None

    bar = progress_bar()
    job = bar.add_task("value rollouts", total=None, status="sampling states and alternatives")
    with bar:
        study = Study(args.states, args.gt_k, min(ranking_states, args.states), args.alternatives, args.seed,
                      args.max_new_tokens)
        result = analyze(engine, tokenizer, task, examples, study, critic_values=critic_fn,
                         progress=lambda done, total: bar.update(job, completed=done, total=total, status=""),
                         prompter=prompter)
    result["model"], result["critic"], result["task"] = model_dir, args.critic, args.task

    (out / "values.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "values.png")
    plot_compute(result, out / "values_compute.png")
    print_table(result, err_console if args.json else Console())
    tm = result["timing"]
    err_console.print(f"{tm['continuations']} continuations in {tm['monte_carlo_s']:.1f}s ({tm['seconds_per_state']:.2f}s "
                      f"per state of {args.gt_k + EXTRA_K} rollouts); wrote {out / 'values.json'}, {out / 'values.png'}")
    if args.json:
        print(json.dumps({k: result[k] for k in ("mae", "per_turn", "ranking_accuracy", "states", "compute")
                          if k in result}))
    return 0

