"""Learning speed on the skip task: per run, the first iteration (and its logged wall-clock) at which the
skipped-operation share of the training samples falls to half its first-iteration value (the SFT model's
samples), as in the six-method comparison, the responses sampled until then, and the test pass@1 and
skip share before and after. Usage: python results/credit/learning/halving.py RUN_DIR..."""

import sys
from pathlib import Path

from vineppo.compare import load_run


def row(run: Path) -> str:
    """One markdown table row for the run folder `run`."""
    m = load_run(run)["metrics"]  # sorted by iteration; iteration 0 is the SFT model's evaluation
    start = m[1]["train/behaviour/skip"]  # iteration 1 samples from the SFT model
    hit = next((r for r in m[2:] if r["train/behaviour/skip"] <= start / 2), None)
    if hit:
        responses = sum(r["episodes"] for r in m[1:hit["iteration"] + 1])
        when = f"{hit['iteration']} | {responses:.0f} | {hit['time/wall_clock_s']:.0f}"
    else:
        when = f"not in {m[-1]['iteration']} | | "
    end = m[-1]
    return (f"| {run.name} | {when} | {m[0]['test/pass@1']:.3f} → {end['test/pass@1']:.3f} | "
            f"{m[0]['test/behaviour/skip']:.3f} → {end['test/behaviour/skip']:.3f} | {end['time/wall_clock_s']:.0f} |")


if __name__ == "__main__":
    print("| run | halved at iteration | responses | seconds | test pass@1 | test skip share | run seconds |")
    print("|---|---|---|---|---|---|---|")
    for d in sys.argv[1:]:
        print(row(Path(d)))
