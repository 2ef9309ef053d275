"""bf16 autocast against float32 on the CPU at hand: an iteration's time and the first update's KL, per dtype.

    python benchmarks/dtype.py [--algo grpo] [--iterations 2] [--rounds 2] [--threads 2] [--json] [-- TRAIN FLAGS]

Each round runs `vineppo train --dtype float32` and `--dtype bfloat16` once each (alternating, one at a time, in
fresh processes, the same seed), by default on the real-checkpoint preset (`-- --config smollm2-cpu`), and reads
the iterations' time/sampling_s, time/credit_s and time/update_s and iteration 1's `kl` from metrics.jsonl.
Whether bf16 pays depends on the CPU's bf16 matrix instructions (x86 flags avx512_bf16, amx_bf16;
without them it is emulated), so the output records them. The first update's KL is the correctness side: the policy starts as its reference, so it is ~0 unless
a dtype path is broken. The CPU's model name and its bf16 flags go into the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from iteration import run, run_arguments, summary


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and its bf16 matrix instructions (x86 flags avx512_bf16, amx_bf16); Linux, else ''."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else ["--config", "smollm2-cpu"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="grpo")
    run_arguments(ap)
    ap.set_defaults(iterations=2)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    runs: dict[str, list] = {"float32": [], "bfloat16": []}
    kl: dict[str, list] = {"float32": [], "bfloat16": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for dtype in runs:
                out = Path(tmp) / f"{dtype}-{r}"
                runs[dtype].append(run(args.algo, out, args, [*extra, "--dtype", dtype]))
                rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                kl[dtype].append(next(row["kl"] for row in rows if "kl" in row))
                print(f"round {r + 1} {dtype}: {summary(runs[dtype][-1:])['median_iteration_s']:.2f} s per iteration, "
                      f"iteration 1 kl {kl[dtype][-1]:.4g}", file=sys.stderr)
    name, flags = cpu_info()
    res = {"cpu": name, "cpu_bf16_flags": flags, "algo": args.algo, "iterations": args.iterations,
           "rounds": args.rounds, "threads": args.threads, "train_flags": extra,
           **{dtype: summary(runs[dtype]) | {"iteration_1_kl": kl[dtype]} for dtype in runs}, "runs": runs}
    res["speedup_bf16_median_iteration"] = res["float32"]["median_iteration_s"] / res["bfloat16"]["median_iteration_s"]
    res["speedup_bf16_median_update"] = res["float32"]["median_update_s"] / res["bfloat16"]["median_update_s"]
    if args.json:
        print(json.dumps(res))
        return
    for dtype in runs:
        s = res[dtype]
        print(f"{dtype:8s} median iteration {s['median_iteration_s']:.2f} s (sampling {s['median_sampling_s']:.2f}, "
              f"update {s['median_update_s']:.2f}); iteration 1 kl {', '.join(f'{k:.4g}' for k in kl[dtype])}")
    print(f"bf16 speed-up on {res['cpu'] or 'this CPU'} (bf16 flags: {', '.join(res['cpu_bf16_flags']) or 'none'}): "
          f"iteration {res['speedup_bf16_median_iteration']:.2f}x, update {res['speedup_bf16_median_update']:.2f}x")


if __name__ == "__main__":
    main()
