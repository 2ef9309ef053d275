"""A/B of the engine's decode attention in one process: the working tree's against a git revision's, alternating.

    python benchmarks/attention_ab.py [--model DIR|FILE.gguf|pkg:NAME] [--before REV] [--rounds 6]
                                      [--prompts 64] [--max-new-tokens N] [--threads 2]

The workload is `benchmarks/rollouts.py`'s (the random Llama without --model). Each round runs the native engine
once with each implementation (order alternating by round), so both see the same drifting machine; the two give
the same samples (the token counts must match). Prints one JSON line per run and a last line with the medians,
their ratio and the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import rollouts
import torch
from transformers import AttentionInterface

from vineppo.engine import attention


def _revision_attention(rev: str):
    """`decode_attention` of engine/attention.py at git revision `rev` (registered under the same name)."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:src/vineppo/engine/attention.py"],
                         capture_output=True, text=True, check=True).stdout
    ns = {"__name__": "attention_at_" + rev}
    exec(compile(src, f"{rev}:attention.py", "exec"), ns)  # noqa: S102 - our own file at another revision
    return ns["decode_attention"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--before", default="a4b2d90", help="git revision whose decode attention is 'before'")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=rollouts.N_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    impl = {"before": _revision_attention(args.before), "after": attention.decode_attention}
    torch.set_num_threads(args.threads)
    if args.model:
        model, tok, seqs, bounds, params, _ = rollouts.model_setup(args.model, n_prompts=args.prompts,
                                                                 max_new=args.max_new_tokens or 256)
    else:
        model, tok, seqs, bounds, params, _ = rollouts.random_setup(n_prompts=args.prompts,
                                                                  max_new=args.max_new_tokens or 60)
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            AttentionInterface.register(attention.NAME, impl[name])
            tps, info = rollouts.run_native(model, tok, seqs, bounds, params)
            runs[name].append(tps)
            print(json.dumps({"round": r, "impl": name, "tokens_per_s": tps, "tokens": info["tokens"]}), flush=True)
    AttentionInterface.register(attention.NAME, attention.decode_attention)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"workload": args.model or "random", "median": med,
                      "ratio_after_over_before": med["after"] / med["before"],
                      "paired_ratios": [a / b for a, b in zip(runs["after"], runs["before"])], "runs": runs}))


if __name__ == "__main__":
    main()
