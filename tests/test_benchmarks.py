"""Every script in benchmarks/ runs, at a tiny size, and prints the JSON object its --json promises: a benchmark
that breaks fails here, not when someone next needs its figures. About a minute in all on 2 cores."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SFT = str(ROOT / "src" / "vineppo" / "assets" / "sft-arith")
TRAIN = ["--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens", "64", "--mc-k", "2",
         "--eval-problems", "0"]  # what the benchmarks that run `vineppo train` pass it: one small iteration

# script -> (its flags for a smoke run, keys its JSON must hold); one entry per way of running it
SMOKE = {
    "rollouts.py": (["--prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--naive-fraction", "0.5"],
                    ["native_tokens_per_s", "naive_tokens_per_s", "fraction_of_limit"]),
    "rollouts.py --shape": (["--shape", "tiny", "--device", "cpu", "--scale", "0.02", "--repeats", "1",
                             "--profile-tokens", "0"], ["generate", "monte_carlo"]),
    "breakdown.py": (["--prompts", "2", "--max-new-tokens", "8"], ["share_by_part"]),
    "engine_ab.py": (["--before-src", str(ROOT / "src"), "--prompts", "2", "--max-new-tokens", "8", "--rounds", "1"],
                     ["ratio_of_medians", "samples_that_differ"]),
    "update.py": (["--model", SFT, "--prompts", "2", "--max-new-tokens", "32", "--repeats", "1"],
                  ["update_tokens_per_s", "limit_tokens_per_s", "fraction_of_limit", "iteration_tokens_per_s"]),
    "update.py --shape": (["--shape", "tiny", "--device", "cpu", "--scale", "0.02", "--repeats", "1"],
                          ["seconds", "train_tflops"]),
    "memory.py": (["--configs", "default", "--layers", "1", "--episodes", "2", "--prompt", "8", "--response", "8",
                   "--micro-batch", "2"], ["rows"]),
    "iteration.py": (["--iterations", "1", "--rounds", "1", "--", *TRAIN], ["vineppo", "grpo"]),
    "dtype.py": (["--iterations", "1", "--rounds", "1", "--", "--config", "arith-tiny", *TRAIN],
                 ["float32", "bfloat16", "speedup_bf16_median_iteration"]),
}
LIBRARIES = {"common.py", "shapes.py"}  # imported by the scripts, not run


def run_script(name: str, flags: list[str], timeout: int = 300) -> dict:
    """Run benchmarks/NAME with `flags`, one thread, --json; its JSON object (the last line of its output)."""
    before, after = (flags[:flags.index("--")], flags[flags.index("--"):]) if "--" in flags else (flags, [])
    cmd = [sys.executable, str(BENCH / name), *before, "--threads", "1", "--json", *after]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", list(SMOKE))
def test_each_benchmark_runs_at_a_tiny_size_and_prints_its_json(entry):
    flags, keys = SMOKE[entry]
    result = run_script(entry.split()[0], flags)
    assert isinstance(result, dict) and all(k in result for k in keys), sorted(result)


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")} - LIBRARIES
    assert scripts == {entry.split()[0] for entry in SMOKE}, "add the new script to SMOKE (or LIBRARIES)"


def test_the_gpu_script_parses_and_passes_only_flags_its_benchmarks_take():
    """benchmarks/gpu.sh needs a GPU; here: its shell syntax, and each flag it gives a benchmark is one it has."""
    text = "\n".join(ln for ln in (BENCH / "gpu.sh").read_text().splitlines() if not ln.lstrip().startswith("#"))
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], capture_output=True).returncode == 0
    calls = re.findall(r"benchmarks/(\w+\.py)((?:\\\n|[^\n])*)", text)
    assert len(calls) >= 4
    for script, rest in calls:
        help_text = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                                   cwd=ROOT).stdout
        for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", rest):
            assert flag in help_text, f"gpu.sh passes {flag} to {script}, which does not take it"
