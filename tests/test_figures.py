"""Every figure the README and the docs' headline tables quote, checked against the results file it comes from.

Each `Figure` names the page that quotes it, the text as the page writes it, the files under results/ it is
computed from, and how: the check renders the figure from the files and requires both that it equals the
text and that the page contains the text (whitespace folded, so a line break inside a quote is fine). A
figure changed on the page and not in its file, or in its file and not on the page, fails; the tests at the
bottom plant both.
"""

from __future__ import annotations

import json
import statistics
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Figure:
    page: str  # the page that quotes it, from the repository root
    text: str  # the figure as the page writes it
    sources: tuple[str, ...]  # the results files it is computed from (JSON, JSON lines, or a run's config.yaml)
    render: Callable[..., str]  # the parsed sources, in order -> the text


def _load(path: Path) -> Any:
    """A JSON file, a JSON-lines file as a list of its records, or a run's config.yaml."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if path.suffix == ".yaml":
        return yaml.safe_load(text)
    return json.loads(text)


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def wrong_figures(root: Path, figures: list[Figure]) -> list[str]:
    """'page: problem' for each figure whose page does not hold it or whose sources render something else."""
    found = []
    for f in figures:
        try:
            rendered = f.render(*(_load(root / s) for s in f.sources))
        except (OSError, ValueError, KeyError, TypeError) as e:
            found.append(f"{f.page}: {f.text!r}: its sources {', '.join(f.sources)} cannot be read ({e})")
            continue
        if rendered != f.text:
            found.append(f"{f.page}: {f.text!r}, but {', '.join(f.sources)} give {rendered!r}")
        elif _fold(f.text) not in _fold((root / f.page).read_text(encoding="utf-8")):
            found.append(f"{f.page}: does not quote {f.text!r} ({', '.join(f.sources)})")
    return found


# ------------------------------------------------------------------------------------------------ the registry

MAIN = "results/main-job"
SFT_EVALS = tuple(f"{MAIN}/sft-s{s}-eval.json" for s in SEEDS)
FINAL_EVALS = tuple(f"{MAIN}/final-s{s}-eval.json" for s in SEEDS)
CLEAN = tuple(f"results/main-job-clean/rerun-40/{p}-s{s}-eval-full.json" for p in ("sft", "fin") for s in SEEDS)
COMPARE = "results/compare/compare.json"
REAL = "results/real-model/rl-from-release/runs.json"
FRESH = f"{MAIN}/fresh-clone.json"
RERUN = tuple(f"results/real-model/bf16-rounded/{a}-s0-summary.json" for a in ("grpo", "vineppo"))
F32 = tuple(f"results/real-model/float32-preset/{p}" for p in ("eval-grpo-s0.json", "eval-vineppo-s0.json",
                                                                 "grpo-s0-summary.json", "vineppo-s0-summary.json"))
BF16_EVALS = tuple(f"results/real-model/bf16-rounded/eval-grpo-s0-{d}.json" for d in ("float32", "bfloat16"))
NAMES = {"vineppo": "VinePPO", "dr-grpo": "Dr. GRPO", "grpo": "GRPO", "dpo-positive": "DPO+", "grpo-trl": "GRPO-TRL",
         "rloo": "RLOO", "ppo": "PPO", "restem": "RestEM"}


def _slash(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _pass1(*evals: dict) -> str:
    return _slash([100 * e["pass@1"] for e in evals], ".1f")


def _share(fmt: str) -> Callable[..., str]:
    return lambda *evals: " / ".join(f"{100 * e['behaviours']['premature']['share']:{fmt}}%" for e in evals)


def _gain_range(*evals: dict) -> str:
    gains = [100 * (b["pass@1"] - a["pass@1"]) for a, b in zip(evals[:3], evals[3:])]
    return f"+{min(gains):.0f} to +{max(gains):.0f} points"


def _clean_gains(*evals: dict) -> str:
    return " / ".join(f"{100 * (b['pass@1'] - a['pass@1']):+.1f}" for a, b in zip(evals[:3], evals[3:]))


def _ranking(compare: dict) -> str:
    finals = {a: v["final_test_pass@1"] for a, v in compare["algos"].items()}
    order = sorted(finals, key=lambda a: -finals[a]["mean"])
    top = set(order[:3])  # the three at the top carry their seed spread: they are within it of each other
    return ", ".join(f"{NAMES[a]} {100 * finals[a]['mean']:.1f}"
                     + (f" ± {100 * finals[a]['std']:.1f}" if a in top else "") for a in order)


def _real(runs: dict) -> str:
    strict = {a: [r["final_eval"]["strict"] for k, r in runs["runs"].items() if k.rsplit("-s", 1)[0] == a]
              for a in ("grpo", "vineppo")}
    return (f"{runs['base']['strict']:.3f} → {min(strict['grpo']):.2f}-{max(strict['grpo']):.2f} (GRPO) and "
            f"{min(strict['vineppo']):.2f}-{max(strict['vineppo']):.2f} (VinePPO)")


def _real_minutes(runs: dict) -> str:
    seconds = [r["wall_clock_s"] for r in runs["runs"].values()]
    return f"{min(seconds) / 60:.0f}-{max(seconds) / 60:.0f} minutes per run"


def _fresh(run: dict) -> str:
    s = run["summary"]
    return f"{run['wall_clock_s']:.0f} s, {s['sft_test_pass@1']:.3f} → {s['final_test_pass@1']:.3f} in-run"


def _rerun(grpo: dict, vineppo: dict) -> str:
    return (f"GRPO {grpo['sft_test_pass@1']:.3f} → {grpo['final_test_pass@1']:.3f}, "
            f"VinePPO {vineppo['sft_test_pass@1']:.3f} → {vineppo['final_test_pass@1']:.3f}")


CHEAP = "results/cheap-credit/study.json"


def _cheap_cost(study: dict) -> str:
    c = study["cost"]
    return (f"{c['tempo']['ratio_to_grpo']:.2f}× ({c['tempo']['median_iteration_s']:.2f} s against "
            f"{c['grpo']['median_iteration_s']:.2f} s; VinePPO {c['vineppo']['ratio_to_grpo']:.2f}×)")


def _cheap_tree(study: dict) -> str:
    c = study["cost"]
    return (f"{c['tree_over_vineppo_trained_tokens_per_s']:.2f}× "
            f"({c['vineppo-tree']['median_trained_tokens'] / c['vineppo']['median_trained_tokens']:.1f}× the tokens "
            f"an iteration at {c['vineppo-tree']['ratio_to_grpo']:.2f}× GRPO's iteration)")


def _cheap_values(study: dict) -> str:
    m = study["values"]["mae"]
    return f"MAE {m['tempo']:.3f} against {m['grpo']:.3f} (VinePPO K = 9: {m['vineppo_k9']:.3f})"


def _cheap_credit(study: dict) -> str:
    c, d = study["credit"]["share"], study["credit"]["tempo_minus_grpo"]
    return (f"{c['tempo']['mean']:.2f} against {c['grpo']['mean']:.2f}, {d['mean']:+.2f} ± {d['se']:.2f} "
            f"(truth {c['truth']['mean']:.2f}, VinePPO {c['vineppo_k9']['mean']:.2f})")


def _cheap_row(task: str) -> Callable[[dict], str]:
    def render(study: dict) -> str:
        f = study["learning"][task]["final_pass@1"]
        cells = [f"{100 * f[m]['mean']:.1f} ± {100 * f[m]['se']:.1f}" for m in
                 ("vineppo", "vineppo-tree", "tempo", "grpo", "dr-grpo")]
        return " | ".join(cells)
    return render


def _cheap_readme(study: dict) -> str:
    c = study["cost"]
    return (f"`tempo` costs {c['tempo']['ratio_to_grpo']:.2f}× a GRPO iteration and `vineppo-tree` "
            f"{c['vineppo-tree']['ratio_to_grpo']:.2f}×")


UPDATE = "results/benchmarks/throughput/update-sft-arith.json"


def _update_row(u: dict) -> str:
    runs = u["fraction_of_limit_runs"]
    return (f"| update, tokens × epochs / s | {u['update_tokens_per_s']:,.0f} | bare forward + backward "
            f"{u['limit_tokens_per_s']:,.0f} | **{u['fraction_of_limit']:.2f}** of the limit "
            f"({min(runs):.2f}-{max(runs):.2f}) |")


def _trl_row(u: dict) -> str:
    runs = u["vineppo_over_trl_runs"]
    return (f"| GRPO iteration, completion tokens/s (sampling {u['sampling_s']:.2f} s + update {u['update_s']:.2f} s) "
            f"| {u['iteration_tokens_per_s']:,.0f} | TRL 1.16 `GRPOTrainer` {u['trl_tokens_per_s']:,.0f} | "
            f"**{u['vineppo_over_trl']:.2f}×** TRL ({min(runs):.2f}-{max(runs):.2f}) |")


GPU_ROLLOUTS = tuple(f"results/benchmarks/gpu/rollouts-{d}.json" for d in ("graphs", "eager"))
SAMPLING = "results/benchmarks/sampling/cpu.json"


def _gpu_row(r: dict) -> str:
    g, m = r["generate"], r["monte_carlo"]
    return (f"{r['token_budget']:,} | {g['tokens_per_s']:,.0f} tok/s | {m['tokens_per_s']:,.0f} tok/s | "
            f"{g['gpu_busy']:.0%} / {m['gpu_busy']:.0%} |")


def _sampling(r: dict) -> str:
    passes = {t: r[f"passes_T{t}"] for t in ("1.0", "0.6")}
    one = passes["1.0"]
    x = {k: v["speedup"] for k, v in r["rows"].items()}
    s = r["rows"]["64_T1.0"]["seconds"]
    assert all(v["same_samples"] for v in r["rows"].values())
    return (f"{one['engine']['count']} passes over the logits and {one['engine']['host_syncs']} host synchronisation "
            f"instead of {one['reference']['count']} and {one['reference']['host_syncs']} at T = 1, "
            f"{passes['0.6']['engine']['count']} passes instead of {passes['0.6']['reference']['count']} at T = 0.6 "
            f"(float32 logits; a bf16 model's add one pass to both, the copy to float32; `benchmarks/sampling.py`, "
            f"which also checks the samples agree). On this {r['threads']}-core CPU, where the Exp(1) variates alone "
            f"take {s['exponential'] / s['engine']:.2f} of the new step ({s['exponential'] * 1e3:.0f} of "
            f"{s['engine'] * 1e3:.0f} ms at 64 rows), that is {x['64_T1.0']:.2f}× at 64 rows and "
            f"{x['512_T1.0']:.2f}× at 512 (T = 1; {x['64_T0.6']:.2f}× and {x['512_T0.6']:.2f}× at T = 0.6;")


def _fused(r: dict) -> str:
    rows = r["rows"].values()
    x = {k: v["fused_speedup"] for k, v in r["rows"].items()}
    e = {k: v["speedup"] for k, v in r["rows"].items()}
    return (f"token in a share of {min(v['fused_same_token_share'] for v in rows):.4f} of the rows, log-probs within "
            f"{max(v['fused_logprob_max_error'] for v in rows):.1e}): {x['64_T1.0']:.2f}× at 64 rows and "
            f"{x['512_T1.0']:.2f}× at 512 against `torch.multinomial` on this CPU (T = 1). At the training default "
            f"(T = 0.6, top-p 0.9: a draw from a top-k window, no variates over the vocabulary) the eager step is "
            f"{e['64_T0.6_p0.9']:.2f}× and {e['512_T0.6_p0.9']:.2f}×, the fused one {x['64_T0.6_p0.9']:.2f}× and "
            f"{x['512_T0.6_p0.9']:.2f}×")


DIALOGUE_BENCH = "results/benchmarks/dialogue/cpu.json"


def _span(values: list, fmt: str = "{}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _dialogue_row(key: str) -> Callable[[dict], str]:
    """A row of docs/performance.md's dialogue table: the workload, both sides' tokens/s, their ratio per repeat."""
    def render(r: dict) -> str:
        d = r[key]
        runs = [x["dialogue"] for x in d["runs"]]
        what = (f"dialogues ({runs[0]['dialogues']}, {_span([x['turns'] for x in runs])} turns, "
                f"{_span([x['tokens'] for x in runs])} policy tokens a repeat)" if key == "dialogues" else
                f"replays ({_span([x['continuations'] for x in runs])} continuations, "
                f"{_span([x['tokens'] for x in runs])} policy tokens a repeat)")
        return (f"| {what} | {d['dialogue_tokens_per_s']:.1f} tok/s | {d['single_tokens_per_s']:.1f} tok/s | "
                f"**{d['ratio']:.2f}×** ({_span(d['ratios'], '{:.2f}')}) |")
    return render


EXAMPLES = "results/examples/results.json"


def _example(example: str) -> Callable[[dict], str]:
    """An example's in-run test pass@1, release -> after 10 iterations, mean over seeds (chat template)."""
    def render(results: dict) -> str:
        m = {r["algo"]: r for r in results["over_seeds"] if r["example"] == example and r["prompt_format"] == "auto"}
        return (f"{m['vineppo']['start_test_pass@1']['mean']:.3f} → {m['vineppo']['final_test_pass@1']['mean']:.3f} "
                f"(VinePPO), {m['grpo']['final_test_pass@1']['mean']:.3f} (GRPO)")
    return render


def _example_row(example: str, algo: str, fmt: str) -> Callable[[dict], str]:
    """A row of results/examples/README.md's table: mean ± sd over seeds."""
    def render(results: dict) -> str:
        [m] = [r for r in results["over_seeds"] if (r["example"], r["algo"], r["prompt_format"]) == (example, algo, fmt)]
        sd = lambda k, f: f"{m[k]['mean']:{f}} ± {m[k]['std']:{f.lstrip('+')}}"  # noqa: E731
        return (f"| {example} | {algo} | {'auto (chat)' if fmt == 'auto' else fmt} | "
                f"{m['start_test_pass@1']['mean']:.3f} | {sd('final_test_pass@1', '.3f')} | {sd('gain', '+.3f')} | "
                f"{sd('wall_clock_s', '.0f')} |")
    return render


AGENTS = ("results/agents/release-calculator-no-demo.jsonl", "results/agents/release-calculator.jsonl",
          "results/agents/release-guess-number-rules-only.jsonl", "results/agents/release-guess-number.jsonl")
DEMO = ("results/agents/release-calculator-questions.jsonl", "results/agents/release-calculator-demo.jsonl")


def _calls(rows: list[dict]) -> str:
    """The replies of a calculator evaluation that call the tool, and those that copy the worked example's numbers."""
    replies = _replies(rows)
    return (f"{sum('<calc>' in t for t in replies)} of {len(replies)} replies call the tool, "
            f"{sum('<calc>12 * 34' in t for t in replies)} of them with the demo's numbers")


def _replies(rows: list[dict]) -> list[str]:
    """Every sampled and greedy reply of a `vineppo eval` JSONL."""
    return [t for r in rows for t in r["sample_texts"]] + [r["greedy_text"] for r in rows]


RULES_RESTATED = "I'm thinking"  # how the released model's guess-number replies begin when it plays the other side


def _moves(rows: list[dict]) -> dict[str, int]:
    """The guesses that follow a "Higher." or "Lower." in the game's replies: the right way, the same number, the
    wrong way (a turn's guess is its last number), their total and the replies read."""
    n = {"right": 0, "same": 0, "wrong": 0}
    for text in _replies(rows):
        first = re.findall(r"\d+", text.split("\n")[0])
        prev = int(first[-1]) if first else None
        answers = re.findall(r"\n(Higher\.|Lower\.|Reply with one number from 1 to 8\.)\nassistant\n([^\n]*)", text)
        for said, turn in answers:
            numbers = re.findall(r"\d+", turn)
            guess = int(numbers[-1]) if numbers else None
            if said != "Reply with one number from 1 to 8." and None not in (prev, guess):
                n["same" if guess == prev else "right" if (guess > prev) == (said == "Higher.") else "wrong"] += 1
            prev = guess
    return {**n, "total": sum(n.values()), "replies": len(_replies(rows))}


AGENT_STUDY = "results/agents/study.json"


def _agent_row(task: str, name: str, run: str, counts: tuple[str, ...]) -> Callable[[dict], str]:
    """A row of an agents study table in results/agents/README.md: each seed's final pass@1 (mean), training
    seconds, the per-iteration agent counts and the phases' median seconds."""
    def render(study: dict) -> str:
        g = study[task]
        final = g["final_pass@1"][run]
        finals = ", ".join(f"{v:.3f}" for v in final["values"])
        seconds = ", ".join(f"{v:.0f}" for v in g["train_s"][run])
        per = ", ".join(f"{g['per_iteration'][run][f'agent/{k}']:.1f}" for k in counts)
        phases = ", ".join(f"{g['median_phase_s'][run][k]:.1f}" for k in ("sampling", "credit", "update"))
        return f"| {name} | {finals} ({final['mean']:.3f}) | {seconds} | {per} | {phases} |"
    return render


def _cost(task: str) -> Callable[[dict], str]:
    """VinePPO's training seconds over GRPO's at equal iterations, summed over the seeds of H1."""
    def render(study: dict) -> str:
        s = study[task]["train_s"]
        return f"{sum(s['iterations-vineppo']) / sum(s['iterations-grpo']):.2f}× GRPO's training seconds"
    return render


def _finals(task: str, text: str) -> Callable[[dict], str]:
    """`text` with an agents study's mean final pass@1 ({grpo}, {vineppo}, {seconds}: VinePPO at GRPO's seconds),
    H1's seed count ({n}) and the verdicts ({h1}, {h2})."""
    def render(study: dict) -> str:
        g = study[task]
        means = {k: f"{g['final_pass@1'][run]['mean']:.3f}" for k, run in
                 (("grpo", "iterations-grpo"), ("vineppo", "iterations-vineppo"), ("seconds", "seconds-vineppo"))
                 if run in g["final_pass@1"]}
        verdicts = {h: (g[f"{h}_vineppo_minus_grpo"] or {}).get("verdict") for h in ("h1", "h2")}
        return text.format(**means, **verdicts, n=len(g["h1_vineppo_minus_grpo"]["seeds"]))
    return render


def _hypothesis(task: str, h: str) -> Callable[[dict], str]:
    """An agents study's H1 or H2: the mean difference ± SE, per seed, and the verdict."""
    def render(study: dict) -> str:
        d = study[task][f"{h}_vineppo_minus_grpo"]
        per_seed = ", ".join(f"{v:+.3f}" for v in d["values"])
        return f"VinePPO − GRPO = {d['mean']:+.3f} ± {d['se']:.3f} ({per_seed}): *{d['verdict']}*"
    return render


def _per_seed_cost(task: str) -> Callable[[dict], str]:
    """VinePPO's training seconds over GRPO's at equal iterations, seed by seed."""
    def render(study: dict) -> str:
        s = study[task]["train_s"]
        return "per seed " + ", ".join(f"{v / g:.2f}×" for v, g in zip(s["iterations-vineppo"], s["iterations-grpo"]))
    return render


def _budget(task: str, lead: str) -> Callable[[dict, dict], str]:
    """H2's budget (the `time_budget_s` its runs were given), VinePPO's iterations in it and the overshoot."""
    def render(study: dict, config: dict) -> str:
        g, budget = study[task], config["time_budget_s"]
        its = g["iterations"]["seconds-vineppo"]
        return lead.format(budget) + " VinePPO ran {}, {} and {} iterations (the budget is checked between " \
            "iterations, so the runs passed it by up to {:.0f} s) and reached {:.3f}".format(
                *its, max(g["train_s"]["seconds-vineppo"]) - budget, g["final_pass@1"]["seconds-vineppo"]["mean"])
    return render


def _game_memory(before: dict, after: dict) -> str:
    """GRPO seed 0's peak resident GB on the guessing game: without the memory fixes, with the trim alone, with both."""
    runs = before["runs"]
    return "peaked at {:.1f} GB without either fix, {:.1f} GB with the trim alone and {:.1f} GB with both".format(
        runs["iterations-grpo-s0 without either fix"]["peak_gb"],
        runs["iterations-grpo-s0 with malloc_trim only"]["peak_gb"], after["runs"]["iterations-grpo-s0"]["peak_gb"])


def _scores(rows: list[dict], text: str) -> str:
    """`text` with {pass1}, {pass4}, {greedy}: an evaluation's means over its problems."""
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return text.format(pass1=f"{mean('pass@1'):.3f}", pass4=f"{mean('pass@k'):.3f}", greedy=f"{mean('greedy'):.3f}")


def _release_row(rows: list[dict], tool: bool = True) -> str:
    """A row of results/agents/README.md: pass@1, pass@4, greedy, replies with a call (a tool task), cut off."""
    finishes = [f for r in rows for f in r["sample_finish"]]
    calls = f"{sum('<calc>' in t for t in _replies(rows))} of {len(_replies(rows))}" if tool else "—"
    return _scores(rows, f"| {{pass1}} | {{pass4}} | {{greedy}} | {calls} | "
                         f"{sum(f == 'length' for f in finishes)} of {len(finishes)} samples |")


AGENT_VALUES, AGENT_CREDIT = "results/agents/values-guess-number.json", "results/agents/credit-guess-number.json"


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _turn_values(text: str) -> Callable[[dict], str]:
    """`text` with the guessing game's per-turn value study: its size, the truth's noise, each method's MAE (overall:
    {k1}, {k3}, {k9}, {grpo}, {rloo}, {tempo}; per turn: {k3_turns}, {k9_turns}, {grpo_turns}), the mean truths."""
    def render(v: dict) -> str:
        turns = sorted(v["per_turn"], key=int)
        per = {t: v["per_turn"][t] for t in turns}
        fields = {name: f"{v['mae'][m]:.3f}" for name, m in (("k1", "vineppo_k1"), ("k3", "vineppo_k3"),
                                                              ("k9", "vineppo_k9"), ("grpo", "grpo"), ("rloo", "rloo"),
                                                              ("tempo", "tempo"))}
        fields.update({f"{name}_turns": " / ".join(f"{per[t]['mae'][m]:.3f}" for t in turns)
                       for name, m in (("k3", "vineppo_k3"), ("k9", "vineppo_k9"), ("grpo", "grpo"))})
        return text.format(**fields, states=v["states"], games=len({r["problem"] for r in v["rows"]}),
                           per_game=v["settings"]["responses_per_problem"], gt_k=v["settings"]["gt_k"],
                           se=f"{v['truth_se']:.3f}", turns=_and([str(int(t) + 1) for t in turns]),
                           counts=_and([str(per[t]["states"]) for t in turns]),
                           truths=_and([f"{per[t]['true_mean']:.3f} at turn {int(t) + 1}" for t in turns]),
                           seconds=f"{v['timing']['sampling_s'] + v['timing']['monte_carlo_s']:.0f}")
    return render


# the guessing game's per-turn studies as the pages quote them
QUOTED_VALUES = dict(states=16, games=2, per_game=8, gt_k=32, se="0.071", seconds="672", k1="0.262", k3="0.132",
                     k9="0.112", grpo="0.117", rloo="0.131", tempo="0.152", turns="1 and 2", counts="10 and 6",
                     k3_turns="0.124 / 0.144", k9_turns="0.127 / 0.087", grpo_turns="0.128 / 0.099",
                     truths="0.222 at turn 1 and 0.193 at turn 2")
QUOTED_CREDIT = dict(seconds="603", games=64, problems=8, per_game=8, lost=50, first=13, analysed=6, unblamed=4,
                     k3_n=2, k9_n=5, truth_n=6, grpo_n=3, k3_d="0.109", k9_d="0.177", grpo_d="0.371")


def _turn_credit(text: str) -> Callable[[dict], str]:
    """`text` with the guessing game's credit-over-turns study: the games, the lost ones, the analysed ones, and per
    method the lost games it blamed ({k3_n}, ...) and its mean distance to the truth's shares ({k3_d}, ...)."""
    def render(c: dict) -> str:
        names = (("k3", "vineppo_k3"), ("k9", "vineppo_k9"), ("grpo", "grpo"), ("truth", "truth"))
        over = c["overall"]
        return text.format(games=c["responses"], problems=c["settings"]["problems"], per_game=c["settings"]["samples"],
                           lost=c["wrong"], first=c["wrong_in_one_turn"], analysed=sum(c["analysed"].values()),
                           unblamed=sum(c["analysed"].values()) - over["vineppo_k3"]["n"],
                           seconds=f"{c['timing']['sampling_s'] + c['timing']['advantages_s']:.0f}",
                           **{f"{k}_n": over[m]["n"] for k, m in names},
                           **{f"{k}_d": f"{over[m]['mean']:.3f}" for k, m in names if k != "truth"})
    return render


FIRST_RUN = "results/first-run/first-run.json"


def _first_run(r: dict) -> tuple[str, str]:
    """The start and final test pass@1 of the first-run measurement."""
    return f"{r['summary']['start_test_pass@1']:.2f}", f"{r['summary']['final_test_pass@1']:.2f}"


PREP = "results/regimes/prep"


def _h8(r: dict) -> str:
    """H8's cost sentence of the regimes study's prep README."""
    e, v, s = (r[m]["median_iteration_s"] for m in ("vineppo-entropy", "vineppo", "vineppo-scale"))
    return f"took {e:.2f} s against {v:.2f} s for `vineppo` and {s:.2f} s for `vineppo-scale`: {e / v:.2f}× VinePPO's"


REGIMES = "results/regimes/study.json"
REGIME_METHODS = ("vineppo", "vineppo-scale", "vineppo-entropy", "tempo", "grpo", "grpo-scale", "dr-grpo")
REGIME_STEP = ("vineppo", "vineppo-scale", "vineppo-entropy", "tempo")


def _pts(d: dict, sign: bool = True) -> str:
    """A mean ± SE in points of pass@1 ('+1.2 ± 0.8'), bold when the protocol's rule shows it; 'none' without a
    value, '(1 seed)' without an SE."""
    if d.get("mean") is None:
        return "none"
    text = f"{100 * d['mean']:{'+' if sign else ''}.1f}" + (f" ± {100 * d['se']:.1f}" if d["se"] is not None
                                                              else " (1 seed)")
    return f"**{text}**" if sign and d.get("verdict") == "shown" else text


def _regimes_finals(study: dict) -> str:
    """The regimes report's table of final test pass@1 per condition and method (%)."""
    rows = []
    for c, r in study["conditions"].items():
        f = r["final_pass@1"]
        rows.append(f"| `{c}` | " + " | ".join(_pts(f[m], False) for m in REGIME_METHODS) + " |")
    return "\n".join(rows)


def _regimes_diffs(study: dict) -> str:
    """The regimes report's table of each per-step method's difference to Dr. GRPO and GRPO, per condition."""
    conds = list(study["conditions"])
    rows = []
    for m in REGIME_STEP:
        for b in ("dr-grpo", "grpo"):
            rows.append(f"| `{m}` − `{b}` | " + " | ".join(_pts(study["conditions"][c]["differences"][f"{m} - {b}"])
                                                       for c in conds) + " |")
    return "\n".join(rows)


def _regimes_norm(study: dict) -> str:
    """H6's table: scale minus whitening within VinePPO and GRPO, per condition and over every pair."""
    rows = []
    for k, name in (("vineppo-scale - vineppo", "`vineppo-scale` − `vineppo`"), ("grpo-scale - grpo", "`grpo-scale` − `grpo`")):
        d = study["normalisation"][k]
        rows.append(f"| {name} | " + " | ".join(_pts(v) for v in d["per_condition"].values()) +
                    f" | {_pts(d)} ({d['pairs']} pairs) |")
    return "\n".join(rows)


def _regimes_signals(study: dict) -> str:
    """H7's table: each condition's flat-group share of Dr. GRPO's groups, VinePPO's non-zero tokens and mixed
    states, and the lead the correlation reads, then Spearman's rho."""
    lead = {row["condition"]: row["lead"] for row in study["lead_against_flat_groups"]["rows"]}
    rows = []
    for c, r in study["conditions"].items():
        sig, vine = r["signals"]["dr-grpo"], r["signals"]["vineppo-scale"]
        rows.append(f"| `{c}` | {sig['signal/flat_groups']:.2f} | {sig['signal/nonzero_tokens']:.2f} | "
                    f"{vine['signal/nonzero_tokens']:.2f} | {vine['signal/mixed_states']:.2f} | {100 * lead[c]:+.1f} |")
    rho = study["lead_against_flat_groups"]["spearman"]
    return "\n".join(rows) + f"\n\nSpearman's rho over the {len(rows)} conditions: " + \
        (f"{rho:+.2f}" if rho is not None else "none (fewer than 3)")


def _regimes_matched(study: dict) -> str:
    """H9's table: the matched training accuracy per condition and test pass@1 there."""
    rows = []
    for c, r in study["conditions"].items():
        at, d = r["pass@1_at_matched_accuracy"], r["matched_differences"]
        rows.append(f"| `{c}` | {r['matched_accuracy']:.3f} | " + " | ".join(_pts(at[m], False) for m in
                    ("vineppo-scale", "dr-grpo", "grpo")) + f" | {_pts(d['vineppo-scale - dr-grpo'])} | "
                    f"{_pts(d['vineppo-scale - grpo'])} |")
    return "\n".join(rows)


def _regimes_equal_iterations(study: dict) -> str:
    """Beside the protocol's tests: test pass@1 at the last iteration every run of a condition evaluated, and the
    iterations its runs reached in their seconds (mean over seeds)."""
    rows = []
    for c, r in study["conditions"].items():
        at = r["pass@1_at_equal_iterations"]
        rows.append(f"| `{c}` at iteration {r['equal_iterations']} | " + " | ".join(
            f"{_pts(at[m], False)} ({statistics.mean(r['iterations'][m]):.0f})" for m in REGIME_METHODS) + " |")
    return "\n".join(rows)


def _regimes_entropy(study: dict) -> str:
    """H8's quality: `vineppo-entropy` − `vineppo-scale` per condition."""
    return ", ".join(f"`{c}` {_pts(r['entropy_states'])}" for c, r in study["conditions"].items())


def _regimes_heldout(study: dict) -> str:
    """The held-out shift's table: pass@1 on chains of 5-6 operations per condition, and VinePPO's differences."""
    rows = []
    for c, r in study["heldout"].items():
        f, d = r["pass@1"], r["differences"]
        rows.append(f"| `{c}` | " + " | ".join(_pts(f[m], False) for m in REGIME_METHODS) + " | " +
                    " | ".join(_pts(d[f"vineppo-scale - {b}"]) for b in ("dr-grpo", "grpo")) + " |")
    return "\n".join(rows)


def _regimes_mental_math(study: dict) -> str:
    """The mental-math case's table: iteration 2's advantages under each normalisation, then lengths, entropy, test."""
    mm = study["mental_math"]
    norms = ("whiten", "scale", "none")

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(mm[n]) for n in norms) + " |"

    def at(key: str, fmt: str, its: tuple[str, ...]) -> Callable[[dict], str]:
        return lambda r: " / ".join(format(r[key][i], fmt) for i in its)

    return "\n".join([
        row("iteration 2: raw advantage, token mean (std)", lambda r: "{:+.3f} ({:.3f})".format(
            r["iteration_2"]["advantage/mean"], r["iteration_2"]["advantage/std"])),
        row("iteration 2: tokens with a raw advantage of exactly 0",
            lambda r: f"{1 - r['iteration_2']['signal/nonzero_tokens']:.3f}"),
        row("iteration 2: of the batch's tokens, zeros the normalisation moved",
            lambda r: f"{r['iteration_2']['signal/shifted_zeros']:.3f}"),
        row("iteration 2: the advantage the loss weighs, mean", lambda r: f"{r['iteration_2']['advantage/loss_mean']:+.3f}"),
        row("response tokens at iterations 3 / 10", at("response_tokens", ".1f", ("3", "10"))),
        row("entropy at iterations 3 / 10", at("entropy", ".3f", ("3", "10"))),
        row("test pass@1 at iterations 5 / 10", at("test_pass@1", ".3f", ("5", "10")))])


def _regimes_zero_shift(study: dict) -> str:
    """Where whitening puts an exact zero in the mental-math case's second iteration (report.py: -mean / std)."""
    whiten = study["mental_math"]["whiten"]
    return (f"Whitening subtracts the raw token mean ({whiten['iteration_2']['advantage/mean']:+.3f}) from every token "
            f"and divides by the std: each exact zero becomes {whiten['zero_after_whitening']:+.3f}")


def _grpo_plain(rows: list[dict]) -> str:
    """The filed GRPO run of the mental-math example in plain format, seed 0: its iteration-2 raw advantage mean and
    its test pass@1 at iteration 10."""
    by = {r["iteration"]: r for r in rows}
    return (f"raw advantage mean {by[2]['advantage/mean']:+.3f} at iteration 2, test pass@1 "
            f"{by[10]['test/pass@1']:.3f} at iteration 10")


def _long_iterations(study: dict) -> tuple[int, ...]:
    """`long`'s iterations in 180 s: VinePPO's fewest and most, its seconds an iteration (rounded to 10 s), GRPO's."""
    c = study["conditions"]["long"]
    its, secs = c["iterations"]["vineppo"], c["train_s"]["vineppo"]
    per = [s / i for s, i in zip(secs, its)]
    return (min(its), max(its), 10 * round(min(per) / 10), 10 * round(max(per) / 10), min(c["iterations"]["grpo"]),
            max(c["iterations"]["grpo"]))


def _vine_iterations(study: dict) -> str:
    """The range over the conditions of VinePPO's iterations over GRPO's in the same seconds (means over seeds)."""
    ratios = [statistics.mean(r["iterations"]["vineppo"]) / statistics.mean(r["iterations"]["grpo"])
              for r in study["conditions"].values()]
    return f"{min(ratios):.2f}-{max(ratios):.2f} of GRPO's iterations"


TRL = "results/trl/trl.json"
TRL_NAMES = {"grpo": "GRPO", "tempo": "TEMPO", "vineppo": "VinePPO"}


def _trl(text: str) -> Callable[[dict], str]:
    """`text` with the TRL measurement's figures from trl.json: a table row per method ({row_grpo}, ...), the
    paired differences ({trl_vine}, {trl_tempo}, {nat_vine}, {nat_tempo}, {behind}, {grpo_s}), the step ratios and
    the phases' seconds ({ratio_trl}, {ratio_native}, {ratio_of}, {mc_trl}, {mc_native}, ...), the starts."""
    def pm(d: dict, sign: bool = True) -> str:
        return f"{d['mean']:{'+' if sign else ''}.3f} ± {d['se']:.3f}"

    def render(r: dict) -> str:
        trl, nat = r["arith"]["trl"], r["arith"]["native"]
        f = {}
        for m, name in TRL_NAMES.items():
            a, b = trl["methods"][m], nat["methods"][m]
            ph = a["seconds_per_step_by_phase"]
            f[f"row_{m}"] = (f"| {name} | {pm(a['final_pass@1'], False)} | {a['seconds_per_step']['mean']:.2f} "
                             f"({ph['generation']:.2f} / {ph.get('mc', ph.get('credit')):.2f} / {ph['update']:.2f}) | "
                             f"{pm(b['final_pass@1'], False)} | {b['seconds_per_step']['mean']:.2f} |")
        f.update(trl_vine=pm(trl["vineppo/grpo"]["equal_steps"]), trl_tempo=pm(trl["tempo/grpo"]["equal_steps"]),
                 nat_vine=pm(nat["vineppo/grpo"]["equal_steps"]), nat_tempo=pm(nat["tempo/grpo"]["equal_steps"]),
                 behind=f"{-trl['vineppo/grpo']['at_grpo_seconds']['mean']:.3f} ± "
                        f"{trl['vineppo/grpo']['at_grpo_seconds']['se']:.3f}",
                 grpo_s=f"{trl['methods']['grpo']['curve'][-1]['seconds']:.0f}",
                 ratio_trl=f"{trl['vineppo/grpo']['step_ratio']:.2f}", ratio_native=f"{nat['vineppo/grpo']['step_ratio']:.2f}",
                 ratio_of=f"{r['arith']['vineppo_step_ratio_trl_over_native']:.2f}",
                 tempo_trl=f"{trl['tempo/grpo']['step_ratio']:.2f}", tempo_native=f"{nat['tempo/grpo']['step_ratio']:.2f}",
                 mc_trl=f"{trl['methods']['vineppo']['seconds_per_step_by_phase']['mc']:.2f}",
                 mc_native=f"{nat['methods']['vineppo']['seconds_per_step_by_phase']['credit']:.2f}",
                 grpo_x=f"{trl['methods']['grpo']['seconds_per_step']['mean'] / nat['methods']['grpo']['seconds_per_step']['mean']:.1f}",
                 fin_grpo=f"{trl['methods']['grpo']['final_pass@1']['mean']:.3f}",
                 fin_tempo=f"{trl['methods']['tempo']['final_pass@1']['mean']:.3f}",
                 fin_vine=f"{trl['methods']['vineppo']['final_pass@1']['mean']:.3f}")
        for side, result in (("trl", trl), ("native", nat)):  # GRPO's step and start, in TRL and natively
            grpo = result["methods"]["grpo"]
            f.update({f"grpo_{side}": f"{grpo['seconds_per_step']['mean']:.2f}",
                      f"gen_{side}": f"{grpo['seconds_per_step_by_phase']['generation']:.2f}",
                      f"up_{side}": f"{grpo['seconds_per_step_by_phase']['update']:.2f}",
                      f"start_{side}": f"{grpo['curve'][0]['test_pass@1']:.3f}"})
        return text.format(**f)
    return render


QUOTED_TRL = dict(
    row_grpo="| GRPO | 0.450 ± 0.006 | 2.09 (0.81 / 0.00 / 1.28) | 0.461 ± 0.012 | 0.40 |",
    row_tempo="| TEMPO | 0.452 ± 0.020 | 2.09 (0.82 / 0.00 / 1.27) | 0.444 ± 0.004 | 0.41 |",
    row_vineppo="| VinePPO | 0.448 ± 0.011 | 9.15 (0.83 / 7.06 / 1.27) | 0.430 ± 0.005 | 0.67 |",
    trl_vine="-0.002 ± 0.017", trl_tempo="+0.002 ± 0.024", nat_vine="-0.031 ± 0.016", nat_tempo="-0.017 ± 0.008",
    behind="0.060 ± 0.005", grpo_s="167", ratio_trl="4.38", ratio_native="1.68", ratio_of="2.61", tempo_trl="1.00",
    tempo_native="1.02", mc_trl="7.06", mc_native="0.27", grpo_trl="2.09", grpo_native="0.40", grpo_x="5.2",
    gen_trl="0.81", gen_native="0.11", up_trl="1.28", up_native="0.29", start_trl="0.158", start_native="0.162",
    fin_grpo="0.450", fin_tempo="0.452", fin_vine="0.448")


EXAMPLE_RUNS = tuple(f"results/examples/mental-math/{a}-s{s}-metrics.jsonl" for a in ("grpo", "vineppo") for s in (0, 1))


def _trl_mental_math(r: dict, *runs: list[dict]) -> str:
    """The mental-math paragraph of results/trl/README.md: TRL's curve ends, seconds a step, and the native runs'."""
    mm = r["mental-math"]
    end = {m: mm[m]["curve"][-1]["test_pass@1"] for m in ("grpo", "tempo", "vineppo")}
    step = {m: mm[m]["seconds_per_step_total"] for m in ("grpo", "tempo", "vineppo")}
    native = [statistics.mean([x for x in rows if "time/train_s" in x][-1]["time/train_s"] / 20 for rows in pair)
              for pair in (runs[:2], runs[2:])]
    return (f"went from {mm['grpo']['curve'][0]['test_pass@1']:.3f} to {end['grpo']:.3f} (GRPO), {end['tempo']:.3f} "
            f"(TEMPO) and {end['vineppo']:.3f} (VinePPO), one seed each, so not a comparison of the methods. A step took "
            f"{step['grpo']:.1f} s (GRPO), {step['tempo']:.1f} s (TEMPO) and {step['vineppo']:.1f} s (VinePPO: "
            f"{mm['vineppo']['seconds_per_step']['mc']:.1f} s of it Monte Carlo), {mm['vineppo/grpo step_ratio']:.2f}× "
            f"GRPO's; TRL's generation and scoring took {mm['grpo']['seconds_per_step']['generation']:.1f} s a step and "
            f"its update {mm['grpo']['seconds_per_step']['update']:.1f} s. `vineppo train`'s filed runs of the same "
            f"example ([`results/examples/`](../examples/README.md), one core each) took {native[0]:.1f} s (GRPO) and "
            f"{native[1]:.1f} s (VinePPO) a step: TRL on two threads was {step['grpo'] / native[0]:.1f}× slower than "
            "the native trainer on one.")


FIGURES = [
    Figure("README.md", "18.0 / 3.9 / 6.4", SFT_EVALS, _pass1),
    Figure("README.md", "47.7 / 40.6 / 38.7", FINAL_EVALS, _pass1),
    Figure("README.md", "+30 to +37 points", SFT_EVALS + FINAL_EVALS, _gain_range),
    Figure("README.md", "73% / 97% / 93%", SFT_EVALS, _share(".0f")),
    Figure("README.md", "0.2% / 0.7% / 0.1%", FINAL_EVALS, _share(".1f")),
    Figure("README.md", "+3.3 / +0.1 / +1.4", CLEAN, _clean_gains),
    Figure("README.md", "VinePPO 47.1 ± 2.5, Dr. GRPO 46.4 ± 1.7, GRPO 46.2 ± 1.9, DPO+ 45.9, GRPO-TRL 44.9, "
           "RLOO 44.1, PPO 42.8, RestEM 39.3", (COMPARE,), _ranking),
    Figure("results/README.md", "0.61-0.73 (GRPO), 0.61-0.81 (VinePPO)", (REAL,),
           lambda r: _real(r).split(" → ")[1].replace(" (GRPO) and ", " (GRPO), ")),
    Figure("results/README.md", "12-22 minutes per run", (REAL,), _real_minutes),
    Figure("README.md", "218 s, 0.158 → 0.480 in-run", (FRESH,), _fresh),
    Figure("docs/performance.md", "218 s on an idle 2-core CPU from a fresh clone (40 iterations plus the evaluations "
           "and start-up; 183 s of training), test pass@1 0.158 → 0.480", (FRESH,),
           lambda r: f"{r['wall_clock_s']:.0f} s on an idle 2-core CPU from a fresh clone (40 iterations plus the "
                     f"evaluations and start-up; {r['summary']['train_s']:.0f} s of training), test pass@1 "
                     f"{r['summary']['sft_test_pass@1']:.3f} → {r['summary']['final_test_pass@1']:.3f}"),
    Figure("docs/results.md", "18.0 | 12.8 | 72.9% | 47.7 | 49.4 | 0.2% | +29.7", (SFT_EVALS[0], FINAL_EVALS[0]),
           lambda a, b: _row(a, b)),
    Figure("docs/results.md", "3.9 | 2.4 | 96.5% | 40.6 | 41.6 | 0.7% | +36.7", (SFT_EVALS[1], FINAL_EVALS[1]),
           lambda a, b: _row(a, b)),
    Figure("docs/results.md", "6.4 | 3.2 | 93.0% | 38.7 | 38.2 | 0.1% | +32.3", (SFT_EVALS[2], FINAL_EVALS[2]),
           lambda a, b: _row(a, b)),
    Figure("docs/results.md", "| AdamW SFT, seed 0 / 1 / 2 | 0.426 / 0.340 / 0.304 | 0.459 / 0.341 / 0.318 | "
           "**+3.3 / +0.1 / +1.4** |", CLEAN, lambda *e: f"| AdamW SFT, seed 0 / 1 / 2 | {_slash([x['pass@1'] for x in e[:3]], '.3f')} | "
           f"{_slash([x['pass@1'] for x in e[3:]], '.3f')} | **{_clean_gains(*e)}** |"),
    Figure("docs/performance.md", "| update, tokens × epochs / s | 6,353 | bare forward + backward 7,785 | **0.82** "
           "of the limit (0.77-0.89) |", (UPDATE,), _update_row),
    Figure("docs/performance.md", "| GRPO iteration, completion tokens/s (sampling 0.49 s + update 1.42 s) | 2,447 | "
           "TRL 1.16 `GRPOTrainer` 1,258 | **1.95×** TRL (1.85-2.04) |", (UPDATE,), _trl_row),
    Figure("docs/performance.md", "5,436,967 (from free memory) | 68,436 tok/s | 88,299 tok/s | 79% / 84% |",
           GPU_ROLLOUTS[:1], lambda r: _gpu_row(r).replace(" |", " (from free memory) |", 1)),
    Figure("docs/performance.md", "| 262,144 | 20,317 tok/s | 15,469 tok/s | 17% / 13% |", GPU_ROLLOUTS[1:],
           lambda r: "| " + _gpu_row(r)),
    Figure("docs/performance.md", "9 passes over the logits and 1 host synchronisation instead of 12 and 2 at T = 1, "
           "10 passes instead of 12 at T = 0.6 (float32 logits; a bf16 model's add one pass to both, the copy to "
           "float32; `benchmarks/sampling.py`, which also checks the samples agree). On this 2-core CPU, where the "
           "Exp(1) variates alone take 0.81 of the new step (141 of 174 ms at 64 rows), that is 1.10× at 64 rows and "
           "1.40× at 512 (T = 1; 1.06× and 1.59× at T = 0.6;", (SAMPLING,), _sampling),
    Figure("docs/performance.md", "token in a share of 1.0000 of the rows, log-probs within 2.3e-05): 1.29× at 64 "
           "rows and 1.89× at 512 against `torch.multinomial` on this CPU (T = 1). At the training default (T = 0.6, "
           "top-p 0.9: a draw from a top-k window, no variates over the vocabulary) the eager step is 1.01× and "
           "1.06×, the fused one 2.68× and 2.90×", (SAMPLING,), _fused),
    Figure("docs/models-and-gpus.md", "GRPO 0.168 → 0.525, VinePPO 0.168 → 0.475", RERUN, _rerun),
    Figure("README.md", "0.244 → 0.685 (GRPO) and 0.720 (VinePPO) in about 7 minutes of run", (REAL,) + F32,
           lambda real, g, v, gs, vs: f"{real['base']['strict']:.3f} → {g['pass@1']:.3f} (GRPO) and "
                                      f"{v['pass@1']:.3f} (VinePPO) in about "
                                      f"{max(gs['wall_clock_s'], vs['wall_clock_s']) / 60:.0f} minutes of run"),
    Figure("docs/models-and-gpus.md", "GRPO 0.168 → 0.525, VinePPO 0.168 → 0.475", RERUN, _rerun),
    Figure("docs/results.md", "1.00× (1.37 s against 1.38 s; VinePPO 1.67×)", (CHEAP,), _cheap_cost),
    Figure("docs/results.md", "0.90× (4.6× the tokens an iteration at 8.62× GRPO's iteration)", (CHEAP,), _cheap_tree),
    Figure("docs/results.md", "MAE 0.090 against 0.044 (VinePPO K = 9: 0.075)", (CHEAP,), _cheap_values),
    Figure("docs/results.md", "0.63 against 0.48, +0.15 ± 0.11 (truth 0.70, VinePPO 0.71)", (CHEAP,), _cheap_credit),
    Figure("docs/results.md", "45.1 ± 0.7 | 44.5 ± 2.5 | 41.2 ± 1.0 | 44.5 ± 0.8 | 43.1 ± 0.5", (CHEAP,),
           _cheap_row("default")),
    Figure("docs/results.md", "43.7 ± 1.5 | 38.8 ± 0.6 | 45.8 ± 1.4 | 47.9 ± 0.7 | 46.3 ± 1.1", (CHEAP,),
           _cheap_row("skip")),
    Figure("docs/results.md", "8.8 ± 1.3 | 8.7 ± 0.1 | 8.1 ± 0.6 | 10.0 ± 0.6 | 9.4 ± 0.6", (CHEAP,), _cheap_row("long")),
    Figure("docs/results.md", "48.6 ± 3.2 | 33.3 ± 1.3 | 46.9 ± 4.8 | 46.8 ± 2.5 | 55.3 ± 5.9", (CHEAP,),
           _cheap_row("pairs")),
    Figure("README.md", "`tempo` costs 1.00× a GRPO iteration and `vineppo-tree` 8.62×", (CHEAP,), _cheap_readme),
    *(Figure(page, text, (EXAMPLES,), _example(ex)) for page in ("examples/README.md", "docs/results.md")
      for ex, text in (("mental-math", "0.355 → 0.893 (VinePPO), 0.922 (GRPO)"),
                       ("capitals", "0.551 → 0.762 (VinePPO), 0.735 (GRPO)"))),
    Figure("results/README.md", "0.355 → 0.893 / 0.922", (EXAMPLES,),
           lambda r: _example("mental-math")(r).replace(" (VinePPO), ", " / ").removesuffix(" (GRPO)")),
    *(Figure("results/examples/README.md", text, (EXAMPLES,), _example_row(*key)) for key, text in (
        (("mental-math", "vineppo", "auto"), "| mental-math | vineppo | auto (chat) | 0.355 | 0.893 ± 0.017 | "
                                             "+0.539 ± 0.055 | 693 ± 27 |"),
        (("mental-math", "grpo", "auto"), "| mental-math | grpo | auto (chat) | 0.355 | 0.922 ± 0.035 | "
                                          "+0.568 ± 0.072 | 589 ± 16 |"),
        (("mental-math", "vineppo", "plain"), "| mental-math | vineppo | plain | 0.000 | 0.449 ± 0.635 | "
                                              "+0.449 ± 0.635 | 332 ± 307 |"),
        (("mental-math", "grpo", "plain"), "| mental-math | grpo | plain | 0.000 | 0.814 ± 0.020 | +0.814 ± 0.020 | "
                                           "446 ± 65 |"),
        (("capitals", "vineppo", "auto"), "| capitals | vineppo | auto (chat) | 0.551 | 0.762 ± 0.042 | "
                                          "+0.211 ± 0.046 | 424 ± 11 |"),
        (("capitals", "grpo", "auto"), "| capitals | grpo | auto (chat) | 0.551 | 0.735 ± 0.004 | +0.185 ± 0.008 | "
                                       "367 ± 26 |"))),
    Figure("results/agents/README.md", "| 0.000 | 0.000 | 0.000 | 0 of 300 | 115 of 240 samples |", AGENTS[:1],
           _release_row),
    Figure("results/agents/README.md", "| 0.108 | 0.367 | 0.050 | 109 of 300 | 60 of 240 samples |", AGENTS[1:2],
           _release_row),
    *(Figure("results/agents/README.md", text, AGENTS[i:i + 1], lambda rows: _release_row(rows, tool=False))
      for i, text in ((2, "| 0.000 | 0.000 | 0.000 | — | 256 of 256 samples |"),
                      (3, "| 0.336 | 0.609 | 0.391 | — | 170 of 256 samples |"))),
    Figure("results/agents/README.md", "| 0.858 | 0.983 | 0.983 | 275 of 300 | 1 of 240 samples |", DEMO[1:],
           _release_row),
    Figure("results/agents/README.md", "give the same 300 replies as the first row, text for text", DEMO[:1] + AGENTS[:1],
           lambda again, first: f"give the same {len(_replies(first))} replies as the first row, text for text"
           if _replies(again) == _replies(first) else "give other replies"),
    Figure("results/agents/README.md", "275 of 300 replies call the tool, 0 of them with the demo's numbers", DEMO[1:],
           _calls),
    Figure("examples/calculator/README.md", "calls the tool in 275 of 300 replies, never with the demo's numbers, and "
           "pass@1 is 0.858 (pass@4 0.983, greedy 0.983), against 0.000", DEMO[1:] + DEMO[:1],
           lambda demo, alone: _calls(demo).replace(" replies call the tool, 0 of them with", " replies, never with")
           .join(["calls the tool in ", ""]) + _scores(demo, ", and pass@1 is {pass1} (pass@4 {pass4}, greedy {greedy})")
           + _scores(alone, ", against {pass1}")),
    Figure("docs/results.md", "(`--demo demo.json`) | 0.858 | 0.983 | 275 of 300 replies call the tool, none with the "
           "demo's numbers |", DEMO[1:], lambda rows: _scores(rows, "(`--demo demo.json`) | {pass1} | {pass4} | ")
           + _calls(rows).replace(", 0 of them with", ", none with") + " |"),
    Figure("results/README.md", "before the questions instead (`--demo`), pass@1 0.858;", DEMO[1:],
           lambda rows: _scores(rows, "before the questions instead (`--demo`), pass@1 {pass1};")),
    Figure("docs/usage.md", "on the questions alone goes from 0.000 to 0.858", DEMO,
           lambda alone, demo: _scores(alone, "on the questions alone goes from {pass1} to ") + _scores(demo, "{pass1}")),
    Figure("results/agents/README.md", "52 of them with the example's numbers", AGENTS[1:2],
           lambda rows: f"{sum('<calc>12 * 34' in t for t in _replies(rows))} of them with the example's numbers"),
    *(Figure(page, "109 of 300 replies call the tool", AGENTS[1:2],
             lambda rows: f"{sum('<calc>' in t for t in _replies(rows))} of {len(_replies(rows))} replies call the tool")
      for page in ("examples/calculator/README.md", "results/agents/README.md")),
    Figure("examples/README.md", "in 109 of 300 replies once the prompt shows one call, pass@1 0.108", AGENTS[1:2],
           lambda rows: f"in {sum('<calc>' in t for t in _replies(rows))} of {len(_replies(rows))} replies once the "
                        f"prompt shows one call, pass@1 {sum(r['pass@1'] for r in rows) / len(rows):.3f}"),
    *(Figure(page, text.format(pass1="0.108", pass4="0.367"), AGENTS[1:2], lambda rows, t=text: _scores(rows, t))
      for page, text in (("docs/results.md", "| {pass1} | {pass4} | whether it calls the tool"),
                         ("README.md", "(pass@1 {pass1} before training;"))),
    *(Figure(page, text.format(pass1="0.336", pass4="0.609", greedy="0.391"), AGENTS[3:],
             lambda rows, t=text: _scores(rows, t))
      for page, text in (("docs/results.md", "| {pass1} | {pass4} | whether a guess uses the answer"),
                         ("README.md", "[`guess-number/`](examples/guess-number/README.md) ({pass1};"),
                         ("examples/README.md", "the released model plays: pass@1 {pass1}"),
                         ("results/README.md", "pass@1 {pass1} (pass@4 {pass4})"),
                         ("examples/guess-number/README.md", "pass@1 {pass1} (pass@4 {pass4}, greedy {greedy})"))),
    *(Figure(page, text.format(total=497, right=289, same=180, wrong=28, replies=320), AGENTS[3:],
             lambda rows, t=text: t.format(**_moves(rows)))
      for page, text in (("docs/results.md", "{right} of {total} move the right way, {same} repeat"),
                         ("examples/guess-number/README.md", "{right} of {total} move the way the answer says and "
                                                             "{same} repeat"),
                         ("results/agents/README.md", "of the {total} guesses that follow a \"Higher.\" or \"Lower.\" "
                          "in the {replies} replies, {right} move the right way, {same} repeat the number just "
                          "guessed and {wrong} move the wrong way"))),
    *(Figure("results/agents/README.md", text, (AGENT_STUDY,),
             _agent_row("calculator", name, run, ("turns", "tool_calls", "cut_off")))
      for name, run, text in (
          ("GRPO", "iterations-grpo",
           "| GRPO | 0.983, 0.992, 0.992 (0.989) | 849, 773, 1010 | 119.1, 55.2, 10.6 | 29.1, 0.0, 55.6 |"),
          ("VinePPO", "iterations-vineppo",
           "| VinePPO | 0.992, 0.988, 0.992 (0.990) | 1262, 1064, 1285 | 116.7, 53.0, 11.2 | 30.3, 33.8, 51.8 |"),
          ("VinePPO, GRPO's seconds (H2)", "seconds-vineppo", "| VinePPO, GRPO's seconds (H2) | 0.950, 0.988, 0.983 "
           "(0.974) | 1050, 1046, 1082 | 112.2, 48.5, 15.6 | 35.8, 44.4, 73.3 |"))),
    Figure("results/agents/README.md", "From the released model's 0.108, 0.104 and 0.092", (AGENT_STUDY,),
           lambda study: "From the released model's {:.3f}, {:.3f} and {:.3f}".format(
               *study["calculator"]["start_test_pass@1"]["values"])),
    *(Figure(page, text, (AGENT_STUDY,), _hypothesis("calculator", h))
      for page in ("results/agents/README.md", "docs/results.md")
      for h, text in (("h1", "VinePPO − GRPO = +0.001 ± 0.004 (+0.008, -0.004, +0.000): *not shown*"),
                      ("h2", "VinePPO − GRPO = -0.015 ± 0.009 (-0.033, -0.004, -0.008): *not shown*"))),
    *(Figure(page, "1.37× GRPO's training seconds", (AGENT_STUDY,), _cost("calculator"))
      for page in ("results/agents/README.md", "docs/results.md", "examples/calculator/README.md")),
    Figure("results/agents/README.md", "per seed 1.49×, 1.38×, 1.27×", (AGENT_STUDY,), _per_seed_cost("calculator")),
    Figure("results/agents/README.md", "(1010 s, its seed-2 run) VinePPO ran 7, 7 and 8 iterations (the budget is "
           "checked between iterations, so the runs passed it by up to 72 s) and reached 0.974",
           (AGENT_STUDY, "results/agents/runs/calculator/seconds-vineppo-s0/config.yaml"),
           _budget("calculator", "({:.0f} s, its seed-2 run)")),
    Figure("results/agents/README.md", "train reward 0.5625 against 0.5469 at the fifth, test pass@1 0.917 against "
           "0.921 there", tuple(f"results/agents/runs/calculator/{r}-vineppo-s0/metrics.jsonl"
                                for r in ("seconds", "iterations")),
           lambda short, full: "train reward {:.4f} against {:.4f} at the fifth, test pass@1 {:.3f} against {:.3f} "
           "there".format(*(rows[5]["train/reward"] for rows in (short, full)),
                          *(rows[5]["test/pass@1"] for rows in (short, full)))),
    *(Figure(page, text.format(grpo="0.989", vineppo="0.990", seconds="0.974", n=3, h1="not shown", h2="not shown"),
             (AGENT_STUDY,), _finals("calculator", text))
      for page, text in (
        ("docs/results.md", "(GRPO {grpo}, VinePPO {vineppo})"),
        ("docs/results.md", "GRPO's seconds VinePPO reached {seconds}"),
        ("examples/calculator/README.md", "GRPO reaches test pass@1 {grpo} and VinePPO over turns {vineppo} (the "
                                          "difference {h1} at 2 standard errors)"),
        ("examples/calculator/README.md", "with GRPO's seconds VinePPO reaches {seconds} ({h2})"),
        ("examples/README.md", "GRPO {grpo}, VinePPO over turns {vineppo}, {n} seeds"),
        ("README.md", "before training; GRPO {grpo}, VinePPO over turns {vineppo}: both saturate)"),
        ("results/README.md", "test pass@1 GRPO {grpo}, VinePPO {vineppo} after 10 iterations ({h1}) and {seconds} at "
                              "GRPO's seconds ({h2}), {n} seeds"))),
    *(Figure(page, text.format(grpo="0.788", vineppo="0.664", seconds="0.587", n=3, h1="not shown", h2="shown"),
             (AGENT_STUDY,), _finals("guess-number", text))
      for page, text in (
        ("examples/README.md", "GRPO {grpo}, VinePPO over turns {vineppo}, {n} seeds"),
        ("examples/guess-number/README.md", "GRPO reaches test pass@1 {grpo} and VinePPO over turns {vineppo} (the "
                                            "difference {h1} at 2 standard errors)"),
        ("examples/guess-number/README.md", "with GRPO's seconds VinePPO reaches {seconds}"),
        ("results/README.md", "GRPO {grpo}, VinePPO {vineppo} at equal iterations ({h1}) and {seconds} at GRPO's "
                              "seconds ({h2}, against VinePPO), {n} seeds"))),
    Figure("examples/guess-number/README.md", "2.07× GRPO's training seconds", (AGENT_STUDY,), _cost("guess-number")),
    Figure("results/agents/README.md", "seed 0's GRPO run peaked at 19.1 GB and its VinePPO run at 22.9 GB, on a "
           "machine of 24 GB; with the fixes below, seed 1's peaked at 11.0 and 10.7 GB, seed 2's at 11.5 and 10.6 GB "
           "and H2's runs at 11.3, 11.2 and 11.3 GB",
           ("results/agents/memory-calculator.json",),
           lambda m: "seed 0's GRPO run peaked at {:.1f} GB and its VinePPO run at {:.1f} GB, on a machine of 24 GB; "
           "with the fixes below, seed 1's peaked at {:.1f} and {:.1f} GB, seed 2's at {:.1f} and {:.1f} GB and H2's "
           "runs at {:.1f}, {:.1f} and {:.1f} GB".format(
               *(m["runs"][f"iterations-{a}-s{s}"]["peak_gb"] for s in SEEDS for a in ("grpo", "vineppo")),
               *(m["runs"][f"seconds-vineppo-s{s}"]["peak_gb"] for s in SEEDS))),
    Figure("results/agents/README.md", "312 of 320 replies", AGENTS[2:3],
           lambda rows: f"{sum(t.startswith(RULES_RESTATED) for t in _replies(rows))} of {len(_replies(rows))} replies"),
    *(Figure("results/agents/README.md", text, (AGENT_STUDY,), _agent_row("guess-number", name, method, ("turns", "cut_off")))
      for name, method, text in (
          ("GRPO", "iterations-grpo",
           "| GRPO | 0.777, 0.930, 0.656 (0.788) | 427, 415, 416 | 160.4, 29.9 | 21.5, 0.0, 20.4 |"),
          ("VinePPO", "iterations-vineppo",
           "| VinePPO | 0.566, 0.738, 0.688 (0.664) | 927, 844, 830 | 158.3, 29.5 | 21.5, 43.3, 20.8 |"),
          ("VinePPO, GRPO's seconds (H2)", "seconds-vineppo", "| VinePPO, GRPO's seconds (H2) | 0.613, 0.605, 0.543 "
           "(0.587) | 505, 427, 438 | 159.4, 36.4 | 22.6, 54.5, 21.6 |"))),
    *(Figure(page, "VinePPO − GRPO = -0.124 ± 0.078 (-0.211, -0.191, +0.031): *not shown*", (AGENT_STUDY,),
             _hypothesis("guess-number", "h1")) for page in ("results/agents/README.md", "docs/results.md")),
    *(Figure(page, "VinePPO − GRPO = -0.201 ± 0.064 (-0.164, -0.324, -0.113): *shown*", (AGENT_STUDY,),
             _hypothesis("guess-number", "h2")) for page in ("results/agents/README.md", "docs/results.md")),
    Figure("results/agents/README.md", "416 s) VinePPO ran 5, 4 and 5 iterations (the budget is checked between "
           "iterations, so the runs passed it by up to 89 s) and reached 0.587",
           (AGENT_STUDY, "results/agents/runs/guess-number/seconds-vineppo-s0/config.yaml"),
           _budget("guess-number", "{:.0f} s)")),
    Figure("docs/results.md", "seconds VinePPO reached 0.587 in 4-5 iterations", (AGENT_STUDY,),
           lambda study: "seconds VinePPO reached {:.3f} in {}-{} iterations".format(
               (g := study["guess-number"])["final_pass@1"]["seconds-vineppo"]["mean"],
               min(g["iterations"]["seconds-vineppo"]), max(g["iterations"]["seconds-vineppo"]))),
    *(Figure(page, "2.07× GRPO's training seconds", (AGENT_STUDY,), _cost("guess-number"))
      for page in ("results/agents/README.md", "docs/results.md")),
    Figure("results/agents/README.md",
           "peaked at 21.0 GB without either fix, 20.6 GB with the trim alone and 8.8 GB with both",
           ("results/agents/memory-guess-number-before-fix.json", "results/agents/memory-guess-number.json"),
           _game_memory),
    Figure("docs/results.md", "to 0.788 (mean of 0.777, 0.930 and 0.656) in 10 iterations, VinePPO over turns to 0.664",
           (AGENT_STUDY,), lambda study: "to {:.3f} (mean of {}, {} and {}) in 10 iterations, VinePPO over turns to "
           "{:.3f}".format((g := study["guess-number"]["final_pass@1"])["iterations-grpo"]["mean"],
                           *(f"{v:.3f}" for v in g["iterations-grpo"]["values"]), g["iterations-vineppo"]["mean"])),
    Figure("README.md", "GRPO 0.788, VinePPO over turns 0.664, and 0.587 in GRPO's seconds, 3 seeds", (AGENT_STUDY,),
           lambda study: "GRPO {:.3f}, VinePPO over turns {:.3f}, and {:.3f} in GRPO's seconds, {} seeds".format(
               *((g := study["guess-number"])["final_pass@1"][r]["mean"]
                 for r in ("iterations-grpo", "iterations-vineppo", "seconds-vineppo")),
               len(g["h2_vineppo_minus_grpo"]["seeds"]))),
    Figure("docs/results.md", "(8.8 GB at peak for the same GRPO run)", ("results/agents/memory-guess-number.json",),
           lambda m: f"({m['runs']['iterations-grpo-s0']['peak_gb']:.1f} GB at peak for the same GRPO run)"),
    Figure("results/agents/README.md", "VinePPO's runs peaked at 10.8, 12.8 and 8.8 GB, its equal-seconds runs at "
           "10.9, 12.7 and 8.2 GB", ("results/agents/memory-guess-number.json",),
           lambda m: "VinePPO's runs peaked at {:.1f}, {:.1f} and {:.1f} GB, its equal-seconds runs at {:.1f}, {:.1f} "
           "and {:.1f} GB".format(*(m["runs"][f"{r}-vineppo-s{s}"]["peak_gb"]
                                    for r in ("iterations", "seconds") for s in SEEDS))),
    *(Figure("docs/performance.md", text, (DIALOGUE_BENCH,), _dialogue_row(key)) for key, text in (
        ("dialogues", "| dialogues (8, 16-18 turns, 243-293 policy tokens a repeat) | 50.3 tok/s | 69.5 tok/s | "
                      "**0.72×** (0.69-0.80) |"),
        ("replays", "| replays (32-36 continuations, 774-941 policy tokens a repeat) | 51.5 tok/s | 205.4 tok/s | "
                    "**0.25×** (0.25-0.28) |"))),
    Figure("results/benchmarks/README.md", "dialogue rollouts at 0.72× single-turn sampling's tokens/s and VinePPO's "
           "replays of them at 0.25×", (DIALOGUE_BENCH,),
           lambda r: f"dialogue rollouts at {r['dialogues']['ratio']:.2f}× single-turn sampling's tokens/s and "
                     f"VinePPO's replays of them at {r['replays']['ratio']:.2f}×"),
    Figure("docs/models-and-gpus.md", "0.381 in float32 and 0.530 in bf16", BF16_EVALS,
           lambda f32, bf16: f"{f32['pass@1']:.3f} in float32 and {bf16['pass@1']:.3f} in bf16"),
    *(Figure("results/agents/README.md", text.format(**QUOTED_VALUES), (AGENT_VALUES,), _turn_values(text)) for text in (
        "{states} states, one turn start drawn from each of {states} of its games ({games} test games × {per_game}, T = 0.6); "
        "{seconds} s of sampling and continuations",
        "the mean absolute error against the truth is VinePPO K = 3 {k3}, K = 9 {k9}, K = 1 {k1}, GRPO's group mean "
        "{grpo} (RLOO {rloo}, TEMPO {tempo}); per turn (turns {turns}: {counts} states;",
        "K = 3 {k3_turns}, K = 9 {k9_turns}, group mean {grpo_turns}. The truth's own standard error averages {se}",
        "({truths}) than K = 3 errs", "mean reward of {gt_k} continuations that resume the game")),
    *(Figure("examples/guess-number/README.md", text.format(**QUOTED_VALUES), (AGENT_VALUES,), _turn_values(text))
      for text in ("on {states} turn starts of the released model's games, against a truth of {gt_k} continuations "
                   "each (its standard error {se} on average), VinePPO K = 3, the study's setting, has a mean absolute "
                   "error of {k3}, against {k9} for K = 9 and {grpo} for GRPO's group mean (per turn, turns {turns}: "
                   "{k3_turns}, {k9_turns} and {grpo_turns})",)),
    *(Figure(page, text.format(**QUOTED_CREDIT), (AGENT_CREDIT,), _turn_credit(text)) for page, text in (
        ("results/agents/README.md", "{seconds} s): of {games} games ({problems} test games × {per_game}) {lost} were "
         "lost, {first} of them in their first turn; of the first {analysed} lost games of 2 or 3 turns, VinePPO K = 3 "
         "put negative advantage on {k3_n} (in the other {unblamed}"),
        ("results/agents/README.md", "K = 9 on {k9_n}, the truth on {truth_n} and GRPO on {grpo_n}"),
        ("results/agents/README.md", "from the truth's was K = 3 {k3_d}, K = 9 {k9_d}, GRPO {grpo_d}"),
        ("examples/guess-number/README.md", "of {analysed} lost games it gave {unblamed} no credit at all"))),
    *(Figure("results/README.md", text.format(**QUOTED_TRL), (TRL,), _trl(text)) for text in (
        "test pass@1 VinePPO {fin_vine}, TEMPO {fin_tempo}, GRPO {fin_grpo}, 3 seeds); a VinePPO step costs {ratio_trl}× "
        "a GRPO step in TRL against {ratio_native}× natively, its Monte Carlo {mc_trl} s a step through TRL's "
        "generation against {mc_native} s",)),
    *(Figure("docs/results.md", text.format(**QUOTED_TRL), (TRL,), _trl(text)) for text in (
        "{row_grpo}", "{row_tempo}", "{row_vineppo}", "(VinePPO − GRPO {trl_vine}, not shown)",
        "VinePPO is {behind} behind (shown): a VinePPO step costs {ratio_trl}× a GRPO step there, against "
        "{ratio_native}× natively", "at {mc_trl} s a step where vineppo's engine takes {mc_native} s")),
    *(Figure("docs/trl.md", text.format(**QUOTED_TRL), (TRL,), _trl(text)) for text in (
        "{row_grpo}", "{row_tempo}", "{row_vineppo}",
        "A VinePPO step costs {ratio_trl}× a GRPO step in TRL against {ratio_native}× in `vineppo train`",
        "the continuations at {mc_trl} s a step against the native engine's {mc_native} s")),
    Figure("README.md", "test pass@1 VinePPO {fin_vine}, TEMPO {fin_tempo}, GRPO {fin_grpo}); a VinePPO step costs "
           "{ratio_trl}× a GRPO step in TRL against {ratio_native}× natively".format(**QUOTED_TRL), (TRL,),
           _trl("test pass@1 VinePPO {fin_vine}, TEMPO {fin_tempo}, GRPO {fin_grpo}); a VinePPO step costs "
                "{ratio_trl}× a GRPO step in TRL against {ratio_native}× natively")),
    *(Figure("results/trl/README.md", text.format(**QUOTED_TRL), (TRL,), _trl(text)) for text in (
        "{row_grpo}", "{row_tempo}", "{row_vineppo}",
        "VinePPO − GRPO at 80 steps is {trl_vine} and TEMPO − GRPO {trl_tempo}",
        "At GRPO's {grpo_s} training seconds VinePPO had made about 20 steps and was {behind} behind",
        "VinePPO − GRPO {nat_vine} at equal iterations (not shown), TEMPO − GRPO {nat_tempo} (shown",
        "A VinePPO step costs {ratio_trl}× a GRPO step in TRL against {ratio_native}× in `vineppo train`: {ratio_of} "
        "times the native ratio", "{mc_trl} s a step in TRL against {mc_native} s natively",
        "TEMPO costs what GRPO costs in both ({tempo_trl}× and {tempo_native}×)",
        "A GRPO step takes {grpo_trl} s in TRL and {grpo_native} s in `vineppo train` ({grpo_x}×): generation and "
        "scoring {gen_trl} against {gen_native} s", "the update {up_trl} against {up_native} s",
        "the start's test pass@1: {start_trl} in TRL's runs, {start_native} in the native ones")),
    Figure(f"{PREP}/README.md", "took 2.73 s against 2.79 s for `vineppo` and 2.88 s for `vineppo-scale`: 0.98× "
           "VinePPO's", (f"{PREP}/iteration.json",), _h8),
    Figure(f"{PREP}/README.md", "1.05 s against 1.13 s", (f"{PREP}/iteration.json",),
           lambda r: f"{r['vineppo-entropy']['median_credit_s']:.2f} s against {r['vineppo']['median_credit_s']:.2f} s"),
    Figure(f"{PREP}/README.md", "160 new tokens: pass@1 0.205", (f"{PREP}/start-train.json",),
           lambda r: f"160 new tokens: pass@1 {r['pass@1']:.3f}"),
    Figure(f"{PREP}/README.md", "the 615 of those 2,000", (f"{PREP}/start-train.json",),
           lambda r: "the {} of those {:,}".format(
               sum(1 for line in (ROOT / PREP / "hard-ids.txt").read_text().splitlines() if not line.startswith("#")),
               r["problems"])),
    Figure(f"{PREP}/README.md", "`cutoff_tokens` 37 (the 60th percentile of the careful samples' lengths; cuts 0.384 "
           "of them), `long_tokens` 168", (f"{PREP}/select.json",),
           lambda r: f"`cutoff_tokens` {r['cutoff_tokens']} (the {100 * r['cutoff_tokens_from']['quantile']:.0f}th "
                     f"percentile of the careful samples' lengths; cuts {r['cutoff_tokens_from']['cut_share']:.3f} of "
                     f"them), `long_tokens` {r['long_tokens']}"),
    Figure(f"{PREP}/README.md", "500 training problems × 8: pass@1 0.050", (f"{PREP}/long-train.json",),
           lambda r: f"{r['problems']} training problems × {r['samples']}: pass@1 {r['pass@1']:.3f}"),
    Figure("README.md", "6.6 minutes from the command to its exit on an idle 2-core CPU, mental-math 0.41 → 0.84",
           (FIRST_RUN,), lambda r: f"{r['process_wall_s'] / 60:.1f} minutes from the command to its exit on an idle "
                                   "2-core CPU, mental-math {} → {}".format(*_first_run(r))),
    Figure("docs/usage.md", "CPU, took 397 s from the command to its exit", (FIRST_RUN,),
           lambda r: f"CPU, took {r['process_wall_s']:.0f} s from the command to its exit"),
    Figure("results/README.md", "397 s from the command to its exit, alone on an idle 2-core CPU (the end of iteration "
           "1 at 82 s); test pass@1 0.41 → 0.84", (FIRST_RUN,),
           lambda r: f"{r['process_wall_s']:.0f} s from the command to its exit, alone on an idle 2-core CPU (the end "
                     f"of iteration 1 at {r['end_of_iteration_1_s']:.0f} s); test pass@1 "
                     "{} → {}".format(*_first_run(r))),
    Figure("results/trl/README.md", (
        "went from 0.344 to 0.549 (GRPO), 0.627 (TEMPO) and 0.693 (VinePPO), one seed each, so not a "
        "comparison of the methods. A step took 95.6 s (GRPO), 96.4 s (TEMPO) and 120.0 s (VinePPO: 22.7 s of "
        "it Monte Carlo), 1.26× GRPO's; TRL's generation and scoring took 48.2 s a step and its update 47.3 "
        "s. `vineppo train`'s filed runs of the same example ([`results/examples/`](../examples/README.md), "
        "one core each) took 23.6 s (GRPO) and 28.4 s (VinePPO) a step: TRL on two threads was 4.0× slower "
        "than the native trainer on one."), (TRL, *EXAMPLE_RUNS), _trl_mental_math),
    # the regimes study's report and summary (results/regimes/study.json)
    *(Figure(page, '| `hard` | 45.5 ± 1.9 | 44.3 ± 0.6 | 47.6 ± 1.4 | 43.8 ± 0.6 | 45.7 ± 1.8 | 44.7 ± 1.5 | 46.1 ± 1.4 |\n| `cutoff` | 30.3 ± 0.2 | 30.6 ± 0.0 | 31.3 ± 0.4 | 30.5 ± 0.6 | 31.2 ± 1.1 | 30.9 ± 1.2 | 30.2 ± 0.7 |\n| `groups-2` | 47.1 ± 0.4 | 47.0 ± 0.4 | 47.3 ± 0.9 | 45.5 ± 0.9 | 48.7 ± 0.7 | 44.7 ± 0.3 | 44.6 ± 1.5 |\n| `groups-4` | 46.5 ± 1.6 | 46.8 ± 1.2 | 47.2 ± 0.4 | 44.8 ± 0.9 | 44.0 ± 1.2 | 46.1 ± 1.3 | 45.7 ± 0.8 |\n| `long` | 4.8 ± 0.4 | 4.0 ± 0.1 | 4.9 ± 0.4 | 4.8 ± 0.2 | 5.8 ± 0.5 | 5.5 ± 0.3 | 5.4 ± 0.6 |',
             (REGIMES,), _regimes_finals) for page in ("results/regimes/README.md", "docs/results.md")),
    Figure('results/regimes/README.md', '| `hard` at iteration 20 | 45.5 ± 1.0 (24) | 45.6 ± 1.0 (24) | 46.9 ± 1.1 (25) | 45.5 ± 1.0 (40) | 45.6 ± 1.6 (39) | 46.9 ± 0.7 (39) | 47.6 ± 0.6 (44) |\n| `cutoff` at iteration 25 | 30.0 ± 1.4 (30) | 29.2 ± 0.7 (30) | 30.2 ± 0.6 (30) | 30.5 ± 0.4 (48) | 30.0 ± 0.8 (47) | 30.4 ± 0.7 (48) | 30.5 ± 0.3 (53) |\n| `groups-2` at iteration 10 | 46.6 ± 0.7 (11) | 46.5 ± 0.7 (11) | 47.7 ± 1.1 (11) | 45.2 ± 1.1 (25) | 45.2 ± 0.2 (25) | 44.4 ± 1.9 (26) | 44.7 ± 0.5 (28) |\n| `groups-4` at iteration 10 | 46.8 ± 1.0 (15) | 45.8 ± 0.4 (15) | 47.4 ± 1.0 (15) | 44.5 ± 0.8 (30) | 43.9 ± 1.4 (28) | 45.4 ± 1.9 (29) | 44.9 ± 1.6 (33) |\n| `long` at iteration 0 | 4.2 ± 0.2 (2) | 4.2 ± 0.2 (2) | 4.2 ± 0.2 (7) | 4.2 ± 0.2 (17) | 4.2 ± 0.2 (17) | 4.2 ± 0.2 (17) | 4.2 ± 0.2 (19) |',
           (REGIMES,), _regimes_equal_iterations),
    Figure('results/regimes/README.md', '| `vineppo` − `dr-grpo` | -0.6 ± 0.5 | +0.1 ± 0.5 | +2.5 ± 1.3 | +0.8 ± 1.0 | -0.6 ± 1.0 |\n| `vineppo` − `grpo` | -0.2 ± 1.2 | -0.9 ± 0.9 | **-1.5 ± 0.7** | +2.5 ± 2.2 | -1.0 ± 0.5 |\n| `vineppo-scale` − `dr-grpo` | -1.8 ± 1.9 | +0.4 ± 0.7 | +2.3 ± 1.8 | +1.0 ± 1.2 | -1.4 ± 0.7 |\n| `vineppo-scale` − `grpo` | -1.4 ± 2.4 | -0.6 ± 1.1 | -1.7 ± 1.1 | +2.8 ± 2.3 | **-1.7 ± 0.4** |\n| `vineppo-entropy` − `dr-grpo` | +1.5 ± 1.0 | **+1.1 ± 0.4** | +2.7 ± 2.4 | +1.5 ± 1.2 | -0.5 ± 0.5 |\n| `vineppo-entropy` − `grpo` | +2.0 ± 2.1 | +0.1 ± 1.2 | -1.4 ± 1.7 | **+3.2 ± 1.6** | -0.9 ± 0.9 |\n| `tempo` − `dr-grpo` | **-2.3 ± 1.1** | +0.3 ± 0.5 | +0.9 ± 1.1 | **-0.9 ± 0.2** | -0.6 ± 0.6 |\n| `tempo` − `grpo` | -1.9 ± 1.3 | -0.8 ± 0.6 | **-3.1 ± 0.3** | +0.8 ± 1.1 | **-1.0 ± 0.3** |',
           (REGIMES,), _regimes_diffs),
    Figure('results/regimes/README.md', '| `vineppo-scale` − `vineppo` | -1.2 ± 2.4 | +0.3 ± 0.2 | -0.2 ± 0.5 | +0.3 ± 1.0 | **-0.8 ± 0.3** | -0.3 ± 0.5 (15 pairs) |\n| `grpo-scale` − `grpo` | -1.0 ± 1.0 | -0.3 ± 2.0 | **-4.0 ± 0.9** | **+2.2 ± 0.2** | -0.2 ± 0.7 | -0.7 ± 0.7 (15 pairs) |',
           (REGIMES,), _regimes_norm),
    Figure('results/regimes/README.md', "| `hard` | 0.26 | 0.75 | 0.65 | 0.61 | -1.2 |\n| `cutoff` | 0.70 | 0.26 | 0.23 | 0.17 | +0.3 |\n| `groups-2` | 0.80 | 0.19 | 0.42 | 0.42 | +2.4 |\n| `groups-4` | 0.64 | 0.34 | 0.42 | 0.39 | +0.9 |\n| `long` | 0.82 | 0.15 | 0.11 | 0.10 | -1.0 |\n\nSpearman's rho over the 5 conditions: +0.30",
           (REGIMES,), _regimes_signals),
    Figure('results/regimes/README.md', '| `hard` | 0.562 | 46.5 ± 0.5 | 47.4 ± 0.6 | 45.5 ± 1.5 | -0.8 ± 0.5 | +1.0 ± 2.1 |\n| `cutoff` | 0.256 | 29.6 ± 1.8 | 30.5 ± 0.4 | 30.3 ± 0.5 | -0.8 ± 2.0 | -0.7 ± 1.6 |\n| `groups-2` | 0.398 | 45.2 ± 0.4 | 44.8 ± 0.3 | 44.8 ± 0.4 | +0.4 ± 0.6 | +0.3 ± 0.7 |\n| `groups-4` | 0.436 | 46.2 ± 0.7 | 45.6 ± 1.4 | 45.4 ± 1.2 | +0.5 ± 1.8 | +0.8 ± 1.2 |\n| `long` | 0.043 | 4.2 (1 seed) | 5.8 ± 0.5 | 4.9 ± 0.4 | -1.0 (1 seed) | none |',
           (REGIMES,), _regimes_matched),
    Figure('results/regimes/README.md', '| `hard` | 7.7 ± 0.4 | 6.5 ± 0.3 | 6.5 ± 0.3 | 7.1 ± 0.7 | 7.8 ± 0.3 | 7.1 ± 0.3 | 7.8 ± 0.7 | **-1.3 ± 0.5** | **-1.3 ± 0.1** |\n| `groups-2` | 7.6 ± 0.5 | 7.7 ± 0.6 | 7.6 ± 0.2 | 7.9 ± 1.0 | 7.4 ± 0.5 | 7.5 ± 0.2 | 7.7 ± 1.1 | +0.0 ± 1.7 | +0.3 ± 1.0 |\n| `groups-4` | 7.0 ± 0.4 | 7.1 ± 0.3 | 6.8 ± 0.6 | 6.6 ± 0.6 | 7.8 ± 0.7 | 6.8 ± 0.4 | 6.7 ± 0.6 | +0.4 ± 0.8 | -0.7 ± 1.1 |',
           (REGIMES,), _regimes_heldout),
    Figure('results/regimes/README.md', "| iteration 2: raw advantage, token mean (std) | -0.088 (0.353) | -0.088 (0.353) | -0.088 (0.353) |\n| iteration 2: tokens with a raw advantage of exactly 0 | 0.426 | 0.426 | 0.426 |\n| iteration 2: of the batch's tokens, zeros the normalisation moved | 0.426 | 0.000 | 0.000 |\n| iteration 2: the advantage the loss weighs, mean | +0.000 | -0.193 | -0.088 |\n| response tokens at iterations 3 / 10 | 1.0 / 1.0 | 10.8 / 11.9 | 6.5 / 12.6 |\n| entropy at iterations 3 / 10 | 0.033 / 0.005 | 0.678 / 0.344 | 0.583 / 0.376 |\n| test pass@1 at iterations 5 / 10 | 0.000 / 0.000 | 0.668 / 0.852 | 0.447 / 0.799 |",
           (REGIMES,), _regimes_mental_math),
    Figure('results/regimes/README.md', 'Whitening subtracts the raw token mean (-0.088) from every token and divides by the std: each exact zero becomes +0.249',
           (REGIMES,), _regimes_zero_shift),
    Figure('results/regimes/README.md', '`hard` +3.3 ± 1.7, `cutoff` +0.7 ± 0.4, `groups-2` +0.3 ± 0.6, `groups-4` +0.4 ± 1.1, `long` +0.9 ± 0.6',
           (REGIMES,), _regimes_entropy),
    *(Figure(page, "0.10-0.63 of GRPO's iterations", (REGIMES,), _vine_iterations)
      for page in ("results/regimes/README.md", "docs/results.md")),
    Figure("results/regimes/README.md", "raw advantage mean +0.173 at iteration 2, test pass@1 0.828 at iteration 10",
           ("results/examples/mental-math/grpo-plain-s0-metrics.jsonl",), _grpo_plain),
    Figure("results/regimes/README.md", "over the 15 pairs, within VinePPO (-0.3 ± 0.5) or within GRPO (-0.7 ± 0.7)",
           (REGIMES,), lambda r: "over the {} pairs, within VinePPO ({}) or within GRPO ({})".format(
               r["normalisation"]["vineppo-scale - vineppo"]["pairs"],
               *(_pts(r["normalisation"][k]) for k in ("vineppo-scale - vineppo", "grpo-scale - grpo")))),
    Figure("results/regimes/README.md", "s VinePPO ran 1-2 iterations (a VinePPO iteration on these chains takes "
           "about 70-110 s on one thread), GRPO 14-22", (REGIMES,),
           lambda r: "s VinePPO ran {}-{} iterations (a VinePPO iteration on these chains takes about {}-{} s on one "
                     "thread), GRPO {}-{}".format(*_long_iterations(r))),
    Figure("docs/results.md", "VinePPO ran 1-2 iterations in 180 s to GRPO's 14-22", (REGIMES,),
           lambda r: "VinePPO ran {0}-{1} iterations in 180 s to GRPO's {4}-{5}".format(*_long_iterations(r))),
    Figure("results/regimes/README.md", "a `vineppo-entropy` iteration took 0.98× VinePPO's", (REGIMES,),
           lambda r: f"a `vineppo-entropy` iteration took {r['iteration']['entropy_over_vineppo']:.2f}× VinePPO's"),
    Figure("docs/results.md", "that cuts 38% of its careful solutions", (f"{PREP}/select.json",),
           lambda r: f"that cuts {100 * r['cutoff_tokens_from']['cut_share']:.0f}% of its careful solutions"),
    Figure("docs/results.md", "VinePPO whitened reinforced empty replies and stayed at 0.000, scaled it reached 0.852 at "
           "iteration 10", (REGIMES,), lambda r: "VinePPO whitened reinforced empty replies and stayed at {:.3f}, scaled "
           "it reached {:.3f} at iteration 10".format(r["mental_math"]["whiten"]["test_pass@1"]["10"],
                                                       r["mental_math"]["scale"]["test_pass@1"]["10"])),
    Figure("results/README.md", "Whitening wrecks the mental-math plain seed-0 run (0.000), scaled advantages reach 0.852",
           (REGIMES,), lambda r: "Whitening wrecks the mental-math plain seed-0 run ({:.3f}), scaled advantages reach "
           "{:.3f}".format(r["mental_math"]["whiten"]["test_pass@1"]["10"], r["mental_math"]["scale"]["test_pass@1"]["10"])),
]


def _row(sft: dict, final: dict) -> str:
    """A row of docs/results.md's main-job table, from SFT pass@1 to the gain."""
    cells = [f"{100 * sft['pass@1']:.1f}", f"{100 * sft['greedy']:.1f}",
             f"{100 * sft['behaviours']['premature']['share']:.1f}%", f"{100 * final['pass@1']:.1f}",
             f"{100 * final['greedy']:.1f}", f"{100 * final['behaviours']['premature']['share']:.1f}%",
             f"{100 * (final['pass@1'] - sft['pass@1']):+.1f}"]
    return " | ".join(cells)


# ------------------------------------------------------------------------------------------------------ tests

def test_every_quoted_figure_matches_its_results_file():
    assert wrong_figures(ROOT, FIGURES) == []


def _copy(tmp_path: Path, figures: list[Figure]) -> Path:
    for rel in {f.page for f in figures} | {s for f in figures for s in f.sources}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.page}:{f.text[:24]}")
def test_a_figure_changed_on_its_page_alone_is_caught(tmp_path, figure):
    root = _copy(tmp_path, [figure])
    page = root / figure.page
    text = page.read_text(encoding="utf-8")
    digit = re.search(r"\d", figure.text)
    planted = figure.text[:digit.start()] + str((int(digit.group()) + 1) % 10) + figure.text[digit.end():]
    # the page's own spelling of the figure may wrap a line; plant over the folded match
    pattern = r"\s+".join(re.escape(w) for w in figure.text.split())
    page.write_text(re.sub(pattern, planted, text, count=1), encoding="utf-8")
    assert wrong_figures(root, [figure]) and wrong_figures(ROOT, [figure]) == []


def test_a_results_file_changed_alone_is_caught(tmp_path):
    figure = next(f for f in FIGURES if f.text == "47.7 / 40.6 / 38.7")  # final pass@1 of the three seeds
    root = _copy(tmp_path, [figure])
    source = root / figure.sources[0]
    data = json.loads(source.read_text())
    data["pass@1"] += 0.01
    source.write_text(json.dumps(data))
    assert wrong_figures(root, [figure]) == [
        f"README.md: '47.7 / 40.6 / 38.7', but {', '.join(figure.sources)} give '48.7 / 40.6 / 38.7'"]


def test_a_missing_results_file_is_named(tmp_path):
    figure = FIGURES[0]
    root = _copy(tmp_path, [figure])
    (root / figure.sources[2]).unlink()
    [message] = wrong_figures(root, [figure])
    assert figure.sources[2] in message and "cannot be read" in message


@pytest.mark.parametrize("task", ["guess-number", "calculator"])
def test_the_agent_studies_equal_seconds_runs_repeat_their_seeds_h1_runs_until_they_stop(task):
    """results/agents/README.md says so: a run is set by its seed and the code (whatever the machine), so H2's runs
    are H1's runs stopped early. The calculator's seed-0 H1 run came from an earlier commit: equal for 4 iterations."""
    runs = ROOT / f"results/agents/runs/{task}"
    for seed in SEEDS:
        short, full = (_load(runs / f"{r}-vineppo-s{seed}/metrics.jsonl") for r in ("seconds", "iterations"))
        rewards = [[r["train/reward"] for r in rows if "train/reward" in r] for rows in (short, full)]
        tests = [{r["iteration"]: r["test/pass@1"] for r in rows if "test/pass@1" in r} for rows in (short, full)]
        if task == "calculator" and seed == 0:
            assert rewards[0][:4] == rewards[1][:4] and rewards[0][4] != rewards[1][4]
            continue
        shared = tests[0].keys() & tests[1].keys()
        assert rewards[0] == rewards[1][:len(rewards[0])] and len(rewards[0]) >= 4
        assert {i: tests[0][i] for i in shared} == {i: tests[1][i] for i in shared} and len(shared) >= 1
