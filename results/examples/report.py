"""The examples' results: per run, the in-run test pass@1 and mean reward at each evaluation, against seconds.

    python results/examples/report.py RUNS --out results/examples

RUNS holds one run folder per example and algorithm, named <example>-<algo> (as results/examples/commands.txt
makes them) or <example>-<algo>[-plain]-s<seed> (as examples/measure.sh makes them: seeds, and runs with
--prompt-format plain), and the `vineppo eval` outputs eval-<example>-<model>.json(l), <model> being release,
release-<format> or the rest of a run folder's name. Writes results.json (every evaluation of every run, the
gain, when it first reached +10 points, the command; the mean and spread over seeds of each example, algorithm
and format; the evaluations of the released model and the final checkpoints with what their samples look like)
and table.md, and copies each run's metrics.jsonl, config.yaml and summary.json beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

EXAMPLES = ("mental-math", "capitals")
ALGOS = ("vineppo", "grpo")
RUN = re.compile(r"(?P<example>mental-math|capitals)-(?P<algo>vineppo|grpo)(?P<plain>-plain)?(-s(?P<seed>\d+))?")


def run_result(folder: Path, example: str, algo: str) -> dict:
    """One run's evaluations (iteration, seconds, test pass@1, mean train reward so far) and its summary."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [{"iteration": r["iteration"], "wall_clock_s": round(r.get("time/wall_clock_s", 0.0), 1),
              "test_pass@1": r["test/pass@1"]} for r in rows if "test/pass@1" in r]
    start = evals[0]["test_pass@1"]
    ten = next((e for e in evals[1:] if e["test_pass@1"] >= start + 0.10), None)
    summary = json.loads((folder / "summary.json").read_text())
    return {"example": example, "algo": algo,
            "command": f"vineppo train --config examples/{example}/train.yaml --algo {algo} "
                       f"--out RUNS/{folder.name}",
            "start_test_pass@1": start, "final_test_pass@1": evals[-1]["test_pass@1"],
            "gain": evals[-1]["test_pass@1"] - start, "plus_10_points_at": ten,
            "train_reward": [round(r["train/reward"], 4) for r in rows if "train/reward" in r],
            "evaluations": evals, "wall_clock_s": round(summary["wall_clock_s"], 1),
            "median_s_per_iteration": {k: round(statistics.median(r.get(f"time/{k}_s", 0.0) for r in rows[1:]), 1)
                                       for k in ("sampling", "credit", "update")}}


def eval_result(runs: Path, example: str, model: str) -> dict | None:
    """`vineppo eval` of one model on an example's test set: its scores, and how its samples end and how long
    they are (cut off at the token limit; words per reply)."""
    path = runs / f"eval-{example}-{model}.json"
    if not path.is_file():
        return None
    scores = json.loads(path.read_text())
    rows = [json.loads(line) for line in (runs / f"eval-{example}-{model}.jsonl").read_text().splitlines()]
    texts = [t for r in rows for t in r["sample_texts"]]
    finishes = [f for r in rows for f in r["sample_finish"]]
    return {"example": example, "model": model, **{k: scores[k] for k in ("pass@1", "pass@k", "greedy", "reward")},
            "cut_off": sum(f == "length" for f in finishes) / len(finishes),
            "words": sum(len(t.split()) for t in texts) / len(texts),
            "at_most_3_words": sum(len(t.split()) <= 3 for t in texts) / len(texts)}


def table(results: list[dict]) -> str:
    """A Markdown table: one row per run."""
    lines = ["| example | algo | test pass@1, release -> iteration 5 -> 10 | gain | +10 points at (iteration, s) | "
             "run's wall-clock s |", "|---|---|---|---|---|---|"]
    for r in results:
        path = " -> ".join(f"{e['test_pass@1']:.3f}" for e in r["evaluations"])
        ten = r["plus_10_points_at"]
        at = f"{ten['iteration']}, {ten['wall_clock_s']:.0f}" if ten else "not reached"
        algo = r["algo"] + (" (plain)" if r.get("prompt_format") == "plain" else "") + f", seed {r.get('seed', 0)}"
        lines.append(f"| {r['example']} | {algo} | {path} | {r['gain']:+.3f} | {at} | {r['wall_clock_s']:.0f} |")
    return "\n".join(lines) + "\n"


def over_seeds(results: list[dict]) -> list[dict]:
    """Per example, algorithm and prompt format: the mean and standard deviation over its seeds of the start, final
    and gain of in-run test pass@1 and of the run's wall-clock seconds."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["example"], r["algo"], r["prompt_format"]), []).append(r)
    out = []
    for (example, algo, fmt), rs in groups.items():
        spread = {k: {"mean": statistics.fmean(r[k] for r in rs),
                      "std": statistics.stdev(r[k] for r in rs) if len(rs) > 1 else 0.0}
                  for k in ("start_test_pass@1", "final_test_pass@1", "gain", "wall_clock_s")}
        out.append({"example": example, "algo": algo, "prompt_format": fmt, "seeds": sorted(r["seed"] for r in rs),
                    **spread})
    return out


def seeds_table(methods: list[dict]) -> str:
    """A Markdown table: one row per example, algorithm and prompt format, mean ± std over seeds."""
    lines = ["| example | algo | prompt format | seeds | start | final | gain | wall-clock s |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        cell = lambda k, f: f"{m[k]['mean']:{f}} ± {m[k]['std']:{f.lstrip('+')}}"  # noqa: E731
        lines.append(f"| {m['example']} | {m['algo']} | {m['prompt_format']} | {len(m['seeds'])} | "
                     f"{cell('start_test_pass@1', '.3f')} | {cell('final_test_pass@1', '.3f')} | {cell('gain', '+.3f')} "
                     f"| {cell('wall_clock_s', '.0f')} |")
    return "\n".join(lines) + "\n"


def eval_table(evals: list[dict]) -> str:
    """A Markdown table: one row per evaluated model."""
    lines = ["| example | model | pass@1 | pass@4 | greedy | mean reward | cut off | words per reply | "
             "replies of at most 3 words |", "|---|---|---|---|---|---|---|---|---|"]
    for e in evals:
        lines.append(f"| {e['example']} | {e['model']} | {e['pass@1']:.3f} | {e['pass@k']:.3f} | {e['greedy']:.3f} | "
                     f"{e['reward']:.3f} | {e['cut_off']:.3f} | {e['words']:.1f} | {e['at_most_3_words']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/examples"))
    args = parser.parse_args()
    results = []
    for folder in sorted(args.runs.iterdir()):
        found = RUN.fullmatch(folder.name)
        if not found or not (folder / "summary.json").is_file():
            continue
        example, algo = found["example"], found["algo"]
        result = run_result(folder, example, algo)
        result.update(seed=int(found["seed"] or 0), prompt_format="plain" if found["plain"] else "auto",
                      command=result["command"] + (" --prompt-format plain" if found["plain"] else "") +
                      (f" --seed {found['seed']}" if found["seed"] else ""))
        results.append(result)
        (args.out / example).mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml", "summary.json"):  # the run folder's path as RUNS/...
            text = (folder / name).read_text().replace(str(args.runs.resolve()), "RUNS")
            text = text.replace(str(args.runs), "RUNS")
            (args.out / example / f"{folder.name.removeprefix(example + '-')}-{name}").write_text(text)
    models = sorted({p.stem.removeprefix(f"eval-{ex}-") for ex in EXAMPLES for p in args.runs.glob(f"eval-{ex}-*.json")})
    evals = [e for ex in EXAMPLES for m in models if (e := eval_result(args.runs, ex, m))]
    methods = over_seeds(results)
    (args.out / "results.json").write_text(json.dumps({"runs": results, "over_seeds": methods, "evaluations": evals},
                                                      indent=2) + "\n")
    text = table(results) + "\n" + seeds_table(methods) + "\n" + eval_table(evals)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
