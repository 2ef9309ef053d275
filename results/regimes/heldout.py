"""The regimes study's held-out shift (PROTOCOL.md, H9): every final model of the conditions trained on chains of 2-4
operations (hard, groups-2, groups-4) evaluated on chains of 5-6 operations, one `vineppo eval` at a time.

    python results/regimes/heldout.py --runs $SCRATCH/study --out $SCRATCH/heldout [--conditions hard] [--threads 1]

Writes OUT/<condition>/<method>-s<seed>.json (the eval's scores) and .jsonl (its per-problem rows); an existing
JSON is kept, so a stopped evaluation continues where it stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CONDITIONS = ("hard", "groups-2", "groups-4")
SHIFT = ["--data", "min_ops=5,max_ops=6", "--limit", "200", "--samples", "4", "--temperature", "0.35",
         "--max-new-tokens", "160", "--seed", "0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="a share of them, e.g. for two side by side")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each evaluation")
    args = ap.parse_args()
    conditions = args.conditions.split(",")
    if unknown := set(conditions) - set(CONDITIONS):
        ap.error(f"--conditions: {', '.join(sorted(unknown))} is not one of {', '.join(CONDITIONS)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for condition in conditions:
        for run in sorted((args.runs / condition).glob("*-s*")):
            latest = run / "checkpoints" / "latest"
            if not run.is_dir() or not latest.exists():
                continue
            out = args.out / condition / f"{run.name}.json"
            if out.exists():
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            model = run / "checkpoints" / latest.read_text().strip()
            cmd = [sys.executable, "-m", "vineppo", "eval", "--model", str(model), *SHIFT, "--out",
                   str(out.with_suffix(".jsonl")), "--json"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
            out.write_text(done.stdout)
            print(f"{condition} {run.name}: done", flush=True)


if __name__ == "__main__":
    main()
