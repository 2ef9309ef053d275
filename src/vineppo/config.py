"""Training configuration: one dataclass (a comment per field), YAML presets, command-line overrides.

Precedence, lowest first: the dataclass defaults (the paper's settings for 1B-7B models), the YAML
preset or file (`--config`), the chosen algorithm's defaults (ALGOS), the preset's `algos: {NAME: ...}`
section for that algorithm, then `--field value` flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from vineppo.errors import UserError

PRESETS = Path(__file__).parent / "configs"

# --algo NAME -> the estimator and the settings that make it that algorithm.
ALGOS: dict[str, dict] = {
    "vineppo": {"estimator": "vine", "gae_lambda": 0.0},
    "ppo": {"estimator": "gae", "gae_lambda": 1.0},
    "grpo": {"estimator": "grpo"},
    "rloo": {"estimator": "rloo"},
}


@dataclass
class TrainConfig:
    algo: str = "vineppo"  # vineppo | ppo | grpo | rloo: picks the estimator and its defaults
    estimator: str = "vine"  # credit estimator by registry name (set by algo)
    task: str = "arith"  # task registry name
    data: str | None = None  # local training file for the task (None: the task's default source)
    model: str = "auto"  # SFT model: folder, .gguf file or hub id; "auto" trains/caches the task's tiny SFT model
    prompt_format: str = "auto"  # plain | chat | fewshot:N | auto (the model's recorded format, else chat if it has one)
    out: str | None = None  # run folder (None: a fresh folder under runs/)
    seed: int = 0  # one seed for sampling, prompt order and minibatch order
    data_seed: int = 0  # seed of generated data sets (arith) and splits: fixed, so every seed sees one test set
    device: str = "auto"  # auto | cpu | cuda
    iterations: int = 1000  # RL iterations (sample -> credit -> update)
    prompts_per_iter: int = 64  # prompts per iteration, drawn with replacement
    samples_per_prompt: int = 8  # responses per prompt (a group for GRPO/RLOO)
    temperature: float = 0.6  # sampling temperature; log-probs use logits / temperature too
    top_p: float = 0.9  # nucleus sampling
    max_new_tokens: int = 1024  # response length cap; a truncated response gets reward 0
    mc_k: int = 9  # VinePPO: continuations per state
    mc_max_states: int = 25  # VinePPO: estimated states per response; later ones take V = the reward
    gamma: float = 1.0  # discount
    gae_lambda: float = 0.0  # GAE lambda (0 for VinePPO, 1 for PPO)
    epochs: int = 2  # passes over the iteration's episodes
    minibatch: int = 64  # episodes per optimiser step
    micro_batch: int = 8  # episodes per forward/backward (memory, not maths)
    lr: float = 1e-6  # policy learning rate (AdamW)
    critic_lr: float = 1e-6  # PPO critic learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm
    clip: float = 0.2  # PPO ratio clip
    value_clip: float = 0.2  # PPO critic value clip
    kl_coef: float = 1e-4  # weight of the k3 KL to the frozen SFT reference
    whiten_advantages: bool = True  # normalise advantages over the batch
    eval_every: int = 10  # iterations between test evaluations (0: only at start and end)
    eval_split: str = "test"  # split evaluated during training
    eval_data: str | None = None  # local file for the evaluation split (None: the task's default source)
    eval_problems: int = 500  # problems evaluated (the first N of the split)
    eval_samples: int = 16  # samples per problem for pass@1
    eval_temperature: float = 0.35  # evaluation sampling temperature
    save_every: int = 10  # iterations between checkpoints (always one at the end)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    token_budget: int = 65536  # engine: max rows x tokens in one decode batch
    tensorboard: bool = True  # write TensorBoard event files
    wandb: str | None = None  # Weights & Biases project name (None: off)


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


def resolve(preset: dict, overrides: dict) -> TrainConfig:
    """Merge defaults, algorithm defaults, preset and overrides into a checked TrainConfig."""
    known = {f.name for f in fields(TrainConfig)} | {"algos"}
    for source, values in (("config", preset), ("flag", overrides)):
        for key in values:
            if key not in known:
                raise UserError(f"unknown {source} setting {key!r}")
    algo = overrides.get("algo", preset.get("algo", TrainConfig.algo))
    if algo not in ALGOS:
        raise UserError(f"--algo {algo!r}: choose one of {', '.join(ALGOS)}")
    general = {k: v for k, v in preset.items() if k != "algos"}
    merged = {**general, **ALGOS[algo], **(preset.get("algos") or {}).get(algo, {}), **overrides}
    return TrainConfig(**merged)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per TrainConfig field (all optional: unset flags do not override)."""
    for f in fields(TrainConfig):
        kind = {"int": int, "float": float, "bool": _bool}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                            help=_comment(f.name))


def overrides_from(args: argparse.Namespace) -> dict:
    """The TrainConfig fields that were set on the command line."""
    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}


def save(cfg: TrainConfig, path: Path) -> None:
    """Write the resolved configuration as YAML."""
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def load(path: Path) -> TrainConfig:
    """Read a configuration saved by `save`."""
    return TrainConfig(**yaml.safe_load(path.read_text()))


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _comment(name: str) -> str:
    """The field's comment in this file's source, used as its --help text."""
    for line in Path(__file__).read_text().splitlines():
        if line.strip().startswith(f"{name}:") and "#" in line:
            return line.split("#", 1)[1].strip()
    return ""
