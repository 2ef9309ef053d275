"""The rollout engine of this checkout against another revision's, on the Monte Carlo workload of `rollouts.py`.

    python benchmarks/engine_ab.py --before REV [--model DIR|FILE.gguf|HUB_ID] [--prompts 64] [--max-new-tokens N]
                                   [--rounds 3] [--threads 2] [--json]
    python benchmarks/engine_ab.py --before-src DIR ...     # another copy's src/ folder, no git

REV is checked out into a temporary git worktree (``--before-src``: the package in DIR is run as it is). Each round runs the engine of each side once, in a fresh
process, alternating (before, after, before, ...), so both see the same drifting machine; the medians and the
per-round ratios are reported, with how many samples the two sides drew differently from the same seed. A change
that sums the same floats in another order can tip a near-tie of a flat distribution (a random model's) the
other way; that sample then differs, and so may the rows that share its batch afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child process, with the side's src/ first on sys.path and this folder for rollouts.py's workload.
CHILD = r"""
import json, sys, time
import torch
from common import NullTok, set_threads
from rollouts import model_setup, random_setup
from vineppo.engine import Engine
from vineppo.models.causal_lm import seeded_generator
a = json.loads(sys.argv[1])
set_threads(a["threads"])
if a["model"]:
    model, tok, seqs, bounds, params, _ = model_setup(a["model"], n_prompts=a["prompts"], max_new=a["max_new"] or 256)
else:
    model, tok, seqs, bounds, params, _ = random_setup(n_prompts=a["prompts"], max_new=a["max_new"] or 60)
eng = Engine(model, tok or NullTok())
try:
    from vineppo.engine import Request
    job = lambda g: eng.continuations(Request(seqs, bounds, 9, params, generator=g))
except ImportError:  # a side from before the one continuation request: positional arguments
    job = lambda g: eng.continuations(seqs, bounds, 9, params, generator=g)
t0 = time.perf_counter()
out = job(seeded_generator(model, 0))
dt = time.perf_counter() - t0
ids = [s.token_ids for per in out for samples in per for s in samples]
print(json.dumps({"tokens": sum(map(len, ids)), "seconds": dt, "samples": ids}))
"""


def run_side(src: Path, args) -> dict:
    """One engine run of the checkout whose package is in ``src``, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(ROOT / "benchmarks")]))
    spec = json.dumps({"threads": args.threads, "model": args.model, "prompts": args.prompts,
                       "max_new": args.max_new_tokens})
    done = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"engine run of {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def before_src(args):
    """The src/ folder of the side before: --before-src as given, or --before checked out into a temporary git
    worktree (removed after)."""
    if args.before_src:
        yield Path(args.before_src).resolve()
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before], check=True,
                       capture_output=True)
        try:
            yield tree / "src"
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--before", help="git revision to compare against (e.g. HEAD~1, a commit)")
    side.add_argument("--before-src", help="a src/ folder to compare against (another copy of the package)")
    ap.add_argument("--model", default="", help="a model folder, .gguf file or hub id (default: tiny random Llama)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with before_src(args) as src:
        runs = {"before": [], "after": []}
        for r in range(args.rounds):
            for side, folder in (("before", src), ("after", ROOT / "src")):
                runs[side].append(run_side(folder, args))
                print(f"round {r + 1} {side}: {runs[side][-1]['tokens'] / runs[side][-1]['seconds']:,.0f} tokens/s",
                      file=sys.stderr)
    first = {side: xs[0]["samples"] for side, xs in runs.items()}
    differ = sum(a != b for a, b in zip(first["before"], first["after"]))
    if any(x["samples"] != xs[0]["samples"] for xs in runs.values() for x in xs):
        raise SystemExit("one side drew different samples in different rounds: not deterministic")
    speed = {side: [x["tokens"] / x["seconds"] for x in xs] for side, xs in runs.items()}
    res = {"before": args.before or args.before_src, "model": args.model or "random-llama-h256-l4", "threads": args.threads,
           "tokens": runs["after"][0]["tokens"], "samples": len(first["after"]), "samples_that_differ": differ,
           "tokens_before": runs["before"][0]["tokens"],
           "before_tokens_per_s": statistics.median(speed["before"]),
           "after_tokens_per_s": statistics.median(speed["after"]),
           "per_round_ratio": [a / b for a, b in zip(speed["after"], speed["before"])],
           "before_runs_tokens_per_s": speed["before"], "after_runs_tokens_per_s": speed["after"]}
    res["ratio_of_medians"] = res["after_tokens_per_s"] / res["before_tokens_per_s"]
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['model']}: before {res['before_tokens_per_s']:,.0f} tokens/s, after {res['after_tokens_per_s']:,.0f}"
              f" ({res['ratio_of_medians']:.2f}x; per round {', '.join(f'{x:.2f}' for x in res['per_round_ratio'])});"
              f" {differ} of {len(first['after'])} samples differ")


if __name__ == "__main__":
    main()
