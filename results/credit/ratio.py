"""Hypothesis 6's quantity: VinePPO K = 9's share of the negative advantage mass on the unreliable line over
GRPO's (and RLOO's), with a delta-method standard error from the two means' standard errors, per credit.json.

Usage: python results/credit/ratio.py CREDIT_JSON...   (the `credit.json` files of `vineppo analyze-credit`)
"""

import json
import math
import sys


def ratio(summary: dict, num: str, den: str) -> tuple[float, float]:
    """mean(num) / mean(den) of the behaviour label's share, and its standard error."""
    a, b = summary["behaviour"][num]["share"], summary["behaviour"][den]["share"]
    r = a["mean"] / b["mean"]
    return r, r * math.sqrt((a["se"] / a["mean"]) ** 2 + (b["se"] / b["mean"]) ** 2)


if __name__ == "__main__":
    print("| credit.json | VinePPO K=9 share | GRPO share | K=9 / GRPO | K=9 / RLOO | truth / GRPO |")
    print("|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        s = json.load(open(path))["summary"]
        k9, grpo = s["behaviour"]["vineppo_k9"]["share"], s["behaviour"]["grpo"]["share"]
        cells = [f"{r:.2f} ± {se:.2f}" for r, se in (ratio(s, "vineppo_k9", "grpo"), ratio(s, "vineppo_k9", "rloo"),
                                                     ratio(s, "truth", "grpo"))]
        print(f"| {path} | {k9['mean']:.3f} ± {k9['se']:.3f} | {grpo['mean']:.3f} ± {grpo['se']:.3f} | "
              + " | ".join(cells) + " |")
