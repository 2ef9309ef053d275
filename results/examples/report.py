"""The examples' results: per run, the in-run test pass@1 and mean reward at each evaluation, against seconds.

    python results/examples/report.py RUNS --out results/examples

RUNS holds one run folder per example and algorithm, named <example>-<algo>, and the `vineppo eval` outputs
eval-<example>-<release|vineppo|grpo>.json(l) (as results/examples/commands.txt makes them). Writes
results.json (every evaluation of every run, the gain, when it first reached +10 points, the command; the
evaluations of the released model and the final checkpoints with what their samples look like) and table.md,
and copies each run's metrics.jsonl, config.yaml and summary.json beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

EXAMPLES = ("mental-math", "capitals")
ALGOS = ("vineppo", "grpo")


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
                       f"--out RUNS/{example}-{algo}",
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
        lines.append(f"| {r['example']} | {r['algo']} | {path} | {r['gain']:+.3f} | {at} | {r['wall_clock_s']:.0f} |")
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
    for example in EXAMPLES:
        for algo in ALGOS:
            folder = args.runs / f"{example}-{algo}"
            if not (folder / "summary.json").is_file():
                continue
            results.append(run_result(folder, example, algo))
            (args.out / example).mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "config.yaml", "summary.json"):  # the run folder's path as RUNS/...
                text = (folder / name).read_text().replace(str(args.runs.resolve()), "RUNS")
                text = text.replace(str(args.runs), "RUNS")
                (args.out / example / f"{algo}-{name}").write_text(text)
    evals = [e for ex in EXAMPLES for m in ("release", *ALGOS) if (e := eval_result(args.runs, ex, m))]
    (args.out / "results.json").write_text(json.dumps({"runs": results, "evaluations": evals}, indent=2) + "\n")
    text = table(results) + "\n" + eval_table(evals)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
