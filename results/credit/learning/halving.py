"""Learning speed on the skip task: per run, the first iteration (and its logged wall-clock) at which the
skipped-operation share of the training samples falls to half its first-iteration value (the SFT model's
samples), as in the six-method comparison, and the test
pass@1 and skip share before and after. Usage: python results/credit/learning/halving.py RUN_DIR..."""

import json
import sys
from pathlib import Path


def row(run: Path) -> str:
    """One markdown table row for the run folder `run`."""
    m = sorted((json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()),
               key=lambda r: r["iteration"])
    start = m[1]["train/behaviour/skip"]  # iteration 1 samples from the SFT model
    hit = next((r for r in m[2:] if r["train/behaviour/skip"] <= start / 2), None)
    when = f"{hit['iteration']} | {hit['iteration'] * 128} | {hit['time/wall_clock_s']:.0f}" if hit else "not in 20 | | "
    end = m[-1]
    return (f"| {run.name} | {when} | {m[0]['test/pass@1']:.3f} → {end['test/pass@1']:.3f} | "
            f"{m[0]['test/behaviour/skip']:.3f} → {end['test/behaviour/skip']:.3f} | {end['time/wall_clock_s']:.0f} |")


if __name__ == "__main__":
    print("| run | halved at iteration | responses | seconds | test pass@1 | test skip share | run seconds |")
    print("|---|---|---|---|---|---|---|")
    for d in sys.argv[1:]:
        print(row(Path(d)))
