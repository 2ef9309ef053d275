"""The real-model study's table and figure, from its runs' metrics and evaluations.

    python results/real-model/report.py RUNS_DIR [--out results/real-model]

RUNS_DIR holds `<algo>-s<seed>/metrics.jsonl` (the runs of `vineppo train --config smollm2-cpu`),
`eval-<algo>-s<seed>.json(l)` (`vineppo eval` of each final checkpoint) and `eval-base.json(l)` (the released
checkpoint under the same evaluation). Writes `table.md`, `runs.json` and `strict-vs-seconds.png` to --out.
Each sampled response is read four ways: right; wrong with the problem's own operation; wrong with another
operation (the one-shot example's `+` counted apart); no answer line (rambling or cut at the token cap).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from vineppo.tasks import get_task

KNOBS = "min_ops=1,max_ops=1,digits=1,premature=0"
SHOT_OP = "+"  # the one-shot example (the first train problem) is '8 + 1 = 9'
OP = re.compile(r"\d+\s*([-+*/x])\s*\d+")


def kinds(rows: list[dict], ops: dict[str, str]) -> dict[str, float]:
    """Shares of the sampled responses: right, own-op wrong, other-op wrong (shot's op), no answer line; and cut
    at the token cap."""
    counts = dict.fromkeys(("right", "own_op_wrong", "other_op_wrong", "shot_op_wrong", "no_answer", "truncated"), 0)
    n = 0
    for row in rows:
        for text, ok, parsable, finish in zip(row["sample_texts"], row["sample_correct"], row["sample_parsable"],
                                              row["sample_finish"]):
            n += 1
            counts["truncated"] += finish == "length"
            m = OP.search(text.split("####")[0])
            if ok:
                counts["right"] += 1
            elif not parsable:
                counts["no_answer"] += 1
            elif m and m.group(1).replace("x", "*") == ops[row["id"]]:
                counts["own_op_wrong"] += 1
            else:
                counts["other_op_wrong"] += 1
                counts["shot_op_wrong"] += bool(m and m.group(1) == SHOT_OP)
    return {k: v / n for k, v in counts.items()}


def evaluation(folder: Path, name: str, ops: dict[str, str]) -> dict:
    """Strict, lenient and parsable pass@1 of one `vineppo eval` output, with the response kinds."""
    scores = json.loads((folder / f"{name}.json").read_text().strip().splitlines()[-1])
    rows = [json.loads(line) for line in (folder / f"{name}.jsonl").open()]
    return {"strict": scores["pass@1"], "lenient": scores["lenient_pass@1"], "parsable": scores["parsable"],
            **kinds(rows, ops)}


def run(folder: Path) -> dict:
    """In-run test pass@1 against training seconds, and the mean seconds per iteration by phase."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    curve = [(r.get("time/train_s", 0.0), r["test/pass@1"]) for r in rows if "test/pass@1" in r]
    gained = [r for r in rows if r.get("test/pass@1", -1.0) >= curve[0][1] + 0.10]  # +10 points over iteration 0
    steps = [r for r in rows if "time/update_s" in r]
    split = {k: statistics.mean(r[f"time/{k}_s"] for r in steps) for k in ("sampling", "credit", "update")}
    last = rows[-1]
    return {"curve": curve, "seconds_per_iteration": split, "train_s": last["time/train_s"],
            "wall_clock_s": last["time/wall_clock_s"], "iterations": len(steps),
            "plus_10_at": [gained[0]["iteration"], gained[0]["time/wall_clock_s"]] if gained else None}


def main() -> None:
    """Write table.md, runs.json and the figure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path, default=Path("results/real-model"))
    args = ap.parse_args()
    tests = get_task("arith").load("test", KNOBS, 0)
    ops = {ex.id: OP.search(ex.solution).group(1) for ex in tests}
    base = evaluation(args.runs, "eval-base", ops)
    out = {"base": base, "runs": {}}
    header = ("method", "seed", "in-run pass@1, first -> last eval", "strict", "lenient", "parsable",
              "other-op wrong (shot's +)", "no answer line", "+10 points at (iteration, s)", "wall-clock s",
              "s/iteration: sampling / MC / update")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             f"| released checkpoint | - | - | {base['strict']:.3f} | {base['lenient']:.3f} | {base['parsable']:.3f} "
             f"| {base['other_op_wrong']:.3f} ({base['shot_op_wrong']:.3f}) | {base['no_answer']:.3f} | - | - | - |"]
    for folder in sorted(p for p in args.runs.iterdir() if (p / "metrics.jsonl").is_file()):
        algo, seed = folder.name.rsplit("-s", 1)
        r, e = run(folder), evaluation(args.runs, f"eval-{folder.name}", ops)
        out["runs"][folder.name] = {**r, "final_eval": e}
        s, at = r["seconds_per_iteration"], r["plus_10_at"]
        at = f"{at[0]}, {at[1]:.0f}" if at else "not reached"
        lines.append(f"| {algo} | {seed} | {r['curve'][0][1]:.3f} -> {r['curve'][-1][1]:.3f} | {e['strict']:.3f} | "
                     f"{e['lenient']:.3f} | {e['parsable']:.3f} | {e['other_op_wrong']:.3f} ({e['shot_op_wrong']:.3f}) | {e['no_answer']:.3f} | {at} | "
                     f"{r['wall_clock_s']:.0f} | {s['sampling']:.1f} / {s['credit']:.1f} / {s['update']:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    (args.out / "runs.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out["runs"], args.out / "strict-vs-seconds.png")
    print("\n".join(lines))


def plot(runs: dict, path: Path) -> None:
    """Strict test pass@1 against training seconds, one line per run, a colour per method."""
    import matplotlib  # heavy: loaded only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"grpo": "tab:orange", "vineppo": "tab:blue"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in runs.items():
        algo = name.rsplit("-s", 1)[0]
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", color=colours.get(algo, "grey"), alpha=0.8,
                label=algo if name.endswith("-s0") else None)
    ax.set_xlabel("training seconds (sampling, credit, update; one core)")
    ax.set_ylabel("strict test pass@1 (100 problems x 4, T = 0.35)")
    ax.set_title("SmolLM2-135M-Instruct, RL from the release")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
