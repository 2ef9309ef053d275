#!/usr/bin/env bash
# The GPU measurements of results/benchmarks/gpu/, from the repository root:  bash benchmarks/gpu.sh OUT_DIR
# The engine on both workloads of benchmarks/shapes.py at the Qwen2.5-0.5B shape (CUDA graphs, budget from free
# memory; then eager steps at a budget of 262,144), the PPO update at that shape (micro-batches of 8 episodes, then
# cut by tokens), and the main job (`vineppo train`) on the GPU. Nothing is downloaded: random weights, the
# shipped SFT model. Each step writes its own file, so a failed step loses only its own result.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/log.txt"
step() { echo "== $(date +%T) $*" >>"$log"; }
step device; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1
step tests; $py -m pytest -p no:cacheprovider -q tests/test_engine.py -k "cuda or ring" >>"$log" 2>&1
step rollouts graphs
$py benchmarks/rollouts.py --shape qwen2.5-0.5b --device cuda --json >"$out/rollouts-graphs.json" 2>>"$log"
step rollouts eager
$py benchmarks/rollouts.py --shape qwen2.5-0.5b --device cuda --decode split --token-budget 262144 --repeats 1 \
    --profile-tokens 16 --json >"$out/rollouts-eager.json" 2>>"$log"
step update micro-batch 8
$py benchmarks/update.py --shape qwen2.5-0.5b --device cuda --micro-batch 8 --repeats 1 --json >"$out/update-micro8.json" 2>>"$log"
step update micro-batch tokens
$py benchmarks/update.py --shape qwen2.5-0.5b --device cuda --micro-batch-tokens 24576 --json \
    >"$out/update-tokens.json" 2>>"$log"
step main job
run=$(mktemp -d)/run
{ time $py -m vineppo train --device cuda --out "$run"; } >>"$log" 2>&1
cp "$run/summary.json" "$out/main-job-summary.json" 2>>"$log"
cp "$run/metrics.jsonl" "$out/main-job-metrics.jsonl" 2>>"$log"
step done
