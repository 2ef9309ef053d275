"""Every script in benchmarks/ runs, at a tiny size, and prints the JSON object its --json promises: a benchmark
that breaks fails here, not when someone next needs its figures; so does the GPU script, in its CPU smoke mode.
About two minutes in all on 2 cores."""

import json
import os
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
    "iteration.py --shape": (["--shape", "tiny", "--iterations", "1", "--rounds", "1", "--", *TRAIN],
                             ["vineppo", "grpo", "versions", "command"]),
    "sampling.py": (["--rows", "4", "--vocab", "300", "--repeats", "1"], ["rows", "passes_T1.0", "versions"]),
    "dtype.py": (["--iterations", "1", "--rounds", "1", "--", "--config", "arith-tiny", *TRAIN],
                 ["float32", "bfloat16", "speedup_bf16_median_iteration"]),
    "dialogue.py": (["--prompts", "2", "--samples", "2", "--turns", "2", "--max-new-tokens", "8", "--repeats", "1"],
                    ["dialogues", "replays", "versions", "command"]),
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


def test_the_gpu_script_in_smoke_mode_runs_every_step_and_writes_every_file(tmp_path):
    """A GPU is lent for minutes at a time: the script it runs is checked here, every step on the CPU at the tiny
    shape. Each step's file holds its command and the versions it ran with; the sampling step drew the same samples
    as torch.multinomial in fewer passes over the logits."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(BENCH / "gpu.sh"), str(tmp_path), "smoke"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    files = {"sampling", "rollouts-graphs", "rollouts-graphs-fused", "rollouts-eager", "update-micro8", "update-tokens", "iteration", "main-job"}
    assert {p.stem for p in tmp_path.glob("*.json")} == files, (tmp_path / "log.txt").read_text()[-3000:]
    for name in files:
        got = json.loads((tmp_path / f"{name}.json").read_text())
        assert got["command"].split()[0] in ("python", "vineppo") and "torch" in got["versions"], name
    sampling = json.loads((tmp_path / "sampling.json").read_text())
    assert all(row["same_samples"] for row in sampling["rows"].values())
    passes = sampling["passes_T1.0"]
    assert passes["engine"]["count"] < passes["reference"]["count"]
    assert passes["engine"]["host_syncs"] < passes["reference"]["host_syncs"]
    iteration = json.loads((tmp_path / "iteration.json").read_text())
    assert set(iteration) >= {"vineppo", "vineppo-tree", "grpo"} and iteration["shape"] == "tiny"
    assert json.loads((tmp_path / "main-job.json").read_text())["summary"]["iterations"] == 1
