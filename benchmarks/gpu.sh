#!/usr/bin/env bash
# The GPU measurements of results/benchmarks/gpu/, from the repository root:
#   bash benchmarks/gpu.sh OUT_DIR [full|short|smoke]
# Every step writes its own JSON file (with its command and versions), so a failed step loses only its own result;
# log.txt says what ran and when. Nothing is downloaded: random weights of Qwen2.5-0.5B's shape, the shipped SFT model.
#  1. sampling: the engine's sampling step against the same draw through torch.multinomial (rows of both workloads);
#  2. rollouts: the engine on the generate and Monte Carlo workloads, CUDA graphs (budget from free memory), the same
#     with the sampling step compiled (Engine(fused_sampling=True)), then eager steps at a budget of 262,144;
#  3. update: one PPO update at the shape, micro-batches of 8 episodes, then cut by tokens;
#  4. iteration: VinePPO, VinePPO with tree rollouts and GRPO iterations at the shape, the main job's preset with the
#     engine's budget from free memory and micro-batches cut by tokens (random weights: rewards are 0, the phases are
#     timed, not learning; benchmarks/iteration.py --shape says how);
#  5. the main job (`vineppo train --device cuda`): its summary and metrics.
# Modes: full (default), short (one timed repeat, no eager path and one update, 2 iterations: meant for one
# 10-minute call; neither mode has been timed on a GPU yet), smoke (every step on the CPU at the tiny shape, workloads
# scaled down: checks the script, measures nothing).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [full|short|smoke]}
mode=${2:-full}
case $mode in
  full)  dev=cuda shape=qwen2.5-0.5b scale=1 reps=3 iters=3 rows=512,2304 vocab=151936 threads=8 job=() ;;
  short) dev=cuda shape=qwen2.5-0.5b scale=1 reps=1 iters=2 rows=512,2304 vocab=151936 threads=8 job=() ;;
  smoke) dev=cpu shape=tiny scale=0.05 reps=1 iters=2 rows=8 vocab=1000 threads=2
         job=(--iterations 1 --eval-problems 8 --prompts-per-iter 2 --samples-per-prompt 2) ;;
  *) echo "gpu.sh: mode must be full, short or smoke, got '$mode'" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/log.txt"
step() { echo "== $(date +%T) $*" | tee -a "$log"; }
step "mode $mode, device $dev, shape $shape"
[ "$dev" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1
tests="cuda or ring or bit_for_bit or fused"  # short: not the fused step's (compiles); sampling.json checks its draws
[ "$mode" = short ] && tests="(cuda or ring or bit_for_bit) and not fused"
[ "$dev" = cuda ] && { step tests; $py -m pytest -p no:cacheprovider -q tests/test_engine.py -k "$tests" >>"$log" 2>&1; }
step sampling
$py benchmarks/sampling.py --device "$dev" --rows "$rows" --vocab "$vocab" --json >"$out/sampling.json" 2>>"$log"
step rollouts graphs
$py benchmarks/rollouts.py --shape "$shape" --device "$dev" --repeats "$reps" --scale "$scale" --json \
    >"$out/rollouts-graphs.json" 2>>"$log"
step rollouts graphs, fused sampling
$py benchmarks/rollouts.py --shape "$shape" --device "$dev" --repeats "$reps" --scale "$scale" --fused-sampling \
    --json >"$out/rollouts-graphs-fused.json" 2>>"$log"
if [ "$mode" != short ]; then
  step rollouts eager
  $py benchmarks/rollouts.py --shape "$shape" --device "$dev" --decode split --token-budget 262144 --repeats 1 \
      --scale "$scale" --profile-tokens 16 --json >"$out/rollouts-eager.json" 2>>"$log"
  step update micro-batch 8
  $py benchmarks/update.py --shape "$shape" --device "$dev" --micro-batch 8 --repeats 1 --scale "$scale" --json \
      >"$out/update-micro8.json" 2>>"$log"
fi
step update micro-batch tokens
$py benchmarks/update.py --shape "$shape" --device "$dev" --micro-batch-tokens 24576 --repeats "$reps" \
    --scale "$scale" --json >"$out/update-tokens.json" 2>>"$log"
step iteration
train=(--token-budget 0 --micro-batch-tokens 24576)  # on a GPU: the engine's budget from free memory, few large passes
[ "$mode" = smoke ] && train=(--prompts-per-iter 2 --samples-per-prompt 4 --max-new-tokens 60)
$py benchmarks/iteration.py --shape "$shape" --device "$dev" --algos vineppo,vineppo-tree --iterations "$iters" \
    --rounds 1 --threads "$threads" --json -- "${train[@]}" >"$out/iteration.json" 2>>"$log"
step main job
run=$(mktemp -d)/run
t0=$(date +%s.%N)
$py -m vineppo train --device "$dev" --out "$run" "${job[@]}" >>"$log" 2>&1
$py - "$run" "$out/main-job.json" "$t0" "vineppo train --device $dev ${job[*]}" <<'EOF' 2>>"$log"
import json, sys, time
end = time.time()
from pathlib import Path
import torch
from shapes import device_name, versions
run, dest, t0, command = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
Path(dest).write_text(json.dumps({"command": command.strip(), "wall_s": end - t0, "versions": versions(),
    "device": device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    "summary": json.loads((run / "summary.json").read_text()), "metrics": metrics}))
EOF
step done
