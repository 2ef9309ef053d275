"""`vineppo analyze-credit`: where each method's advantages fall on a response with one wrong line
(vineppo.analysis.localisation), or over the turns of a failed dialogue (vineppo.analysis.turn_credit)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vineppo.analysis.localisation import CreditStudy, analyze_credit
from vineppo.analysis.turn_credit import analyze_turn_credit
from vineppo.analysis.values import load_inputs
from vineppo.core import config as configs
from vineppo.core.config import check_engine
from vineppo.core.errors import UserError
from vineppo.core.tracking import console, progress_bar
from vineppo.models.prompts import HELP
from vineppo.tasks import DATA_HELP, custom
from vineppo.training.sft import default_model

NAMES = {"vineppo_k1": "VinePPO K=1", "vineppo_k3": "VinePPO K=3", "vineppo_k9": "VinePPO K=9",
         "vineppo_adaptive": "VinePPO adaptive K", "grpo": "GRPO", "rloo": "RLOO", "ppo_critic": "PPO critic (GAE)", "tempo": "TEMPO (shared prefixes)",
         "truth": "truth (K = gt-k)"}


def table(result: dict) -> str:
    """The summary as a Markdown table: per label and method, share and before (mean ± standard error)."""

    out = ["| first error | method | share of negative mass on the bad line | mean advantage of the right lines "
           "before it | responses |", "|---|---|---|---|---|"]
    for label, per in result["summary"].items():
        for m in result["methods"]:
            out.append(f"| {label} | {NAMES.get(m, m)} | {_cell(per[m]['share'])} | {_cell(per[m]['before'])} | "
                       f"{per[m]['share']['n']} |")
    return "\n".join(out)


def turn_table(result: dict) -> str:
    """A dialogue task's summary as a Markdown table: per dialogue length and method, the share on each turn and the
    distance to the truth's shares (mean ± standard error)."""
    out = ["| dialogues | method | share of the negative advantage mass on turn 1 / 2 / ... | distance to the truth's "
           "shares | dialogues with negative mass |", "|---|---|---|---|---|"]
    for label, per in result["distance"].items():
        n = int(label.split()[0])
        for m in result["methods"]:
            shares = " / ".join(_cell(result["summary"][f"turn {t + 1} of {n}"][m]["share"]) for t in range(n))
            out.append(f"| {label} | {NAMES.get(m, m)} | {shares} | {_cell(per[m])} | "
                       f"{result['summary'][f'turn 1 of {n}'][m]['share']['n']} |")
    for m, d in result["overall"].items():
        out.append(f"| all | {NAMES.get(m, m)} | | {_cell(d)} | {d['n']} |")
    return "\n".join(out)


def _cell(x: dict) -> str:
    """mean ± standard error, the mean alone, or n/a."""
    if x["mean"] is None:
        return "n/a"
    return f"{x['mean']:.3f} ± {x['se']:.3f}" if x["se"] is not None else f"{x['mean']:.3f}"


def plot(result: dict, path: Path, tick: str = "first error: {}",
         ylabel: str = "share of negative advantage mass on the bad line") -> None:
    """credit.png: each method's share per label (a first error, or a turn of a dialogue), with its standard error."""
    import matplotlib  # only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the Agg backend is chosen

    labels, methods = list(result["summary"]), result["methods"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        xs = [i + k * width for i in range(len(labels))]
        means = [result["summary"][lab][m]["share"]["mean"] or 0.0 for lab in labels]
        errs = [result["summary"][lab][m]["share"]["se"] or 0.0 for lab in labels]
        ax.bar(xs, means, width, yerr=errs, label=NAMES.get(m, m))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], [tick.format(lab) for lab in labels])
    ax.set(ylabel=ylabel, ylim=(0, 1))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RULES = dict(problems=configs.AT_LEAST_1, samples=configs.AT_LEAST_1, responses=configs.AT_LEAST_1,
             gt_k=configs.AT_LEAST_1, max_new_tokens=configs.AT_LEAST_1, token_budget=configs.AT_LEAST_1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo analyze-credit`."""
    d = CreditStudy()
    p.add_argument("--model", default=None, help="policy folder (default: the task's SFT model)")
    p.add_argument("--prompt-format", default=None, help=HELP)
    p.add_argument("--task", default="arith", help="task name (arith: its lines are checked against the chain; custom "
                   "with --tools or --env: the turns of failed dialogues)")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--split", default="test")
    p.add_argument("--critic", default=None, metavar="RUN_DIR", help="a `vineppo train --algo ppo` run folder")
    p.add_argument("--problems", type=int, default=d.problems, help=f"problems sampled (default {d.problems})")
    p.add_argument("--samples", type=int, default=d.samples, help=f"responses per problem (default {d.samples})")
    p.add_argument("--responses", type=int, default=d.responses,
                   help=f"wrong responses analysed per first-error label (default {d.responses})")
    p.add_argument("--gt-k", type=int, default=d.gt_k, help=f"continuations per state for the truth ({d.gt_k})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--token-budget", type=int, default=65536, help="engine: max rows x tokens in one decode batch")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--engine", default="native", help="rollout backend: native or vllm (default native)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the generated test set and of the few-shot draw "
                   "(default 0, as train's)")
    p.add_argument("--out", default=None, help="folder for credit.json, credit.md, credit.png (default: runs/credit-<time>)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    custom.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo analyze-credit`."""
    configs.check_flags(vars(args), RULES)
    check_engine(args.engine)
    if args.task != "arith" and not (args.task == "custom" and (args.tools or args.env)):
        raise UserError(f"--task {args.task}: analyze-credit reads a response's lines against an arith problem's "
                        "chain of operations, or a dialogue's turns; only --task arith, or --task custom with --tools "
                        "or --env, is supported")
    out = Path(args.out) if args.out else Path("runs") / f"credit-{time.strftime('%Y%m%d-%H%M%S')}"
    # the policy is the --model, else the task's SFT model (never the --critic run's policy: the study is of SFT)
    got = load_inputs(args, out, lambda ckpt: args.model or str(default_model(args.task, args.data)))
    study = CreditStudy(args.problems, args.samples, args.responses, args.gt_k, args.seed, args.max_new_tokens)
    bar = progress_bar()
    job = bar.add_task("credit", total=None, status="sampling responses")

    def progress(name: str):
        bar.update(job, completed=0, total=None, status=name)
        return lambda done, tokens: bar.update(job, completed=done)

    turns = got.task.agent is not None
    with bar:
        result = analyze_turn_credit(got, study, progress) if turns else \
            analyze_credit(got.engine, got.prompter, got.task, got.examples, study, got.critic, progress)
    result.update(model=got.model_dir, critic=args.critic, data=args.data)
    text = turn_table(result) if turns else table(result)
    (out / "credit.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "credit.md").write_text(text + "\n")
    if turns:
        plot(result, out / "credit.png", "{}", "share of negative advantage mass on the turn")
    else:
        plot(result, out / "credit.png")
    console.print(text)
    found = f"{result['wrong_in_one_turn']} of them in their first turn (not analysed); analysed {result['analysed']}" \
        if turns else f"first errors {result['first_error_kinds']}"
    console.print(f"{result['wrong']} of {result['responses']} {'dialogues' if turns else 'responses'} wrong; {found}; "
                  f"{result['timing']['advantages_s']:.0f}s of advantages; wrote {out / 'credit.json'}")
    if args.json:
        keys = ("summary", "distance", "overall", "analysed", "responses", "wrong") if turns else \
            ("summary", "first_error_kinds", "analysed", "responses", "wrong")
        print(json.dumps({k: result[k] for k in keys}))
    return 0
