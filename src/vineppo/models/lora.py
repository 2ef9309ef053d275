"""LoRA (`--lora-r`) through peft: the policy trains low-rank adapters on frozen base weights, and the KL
reference is the same model with its adapters switched off, so no second copy of the weights is held.

Run checkpoints hold the adapters (peft's adapter_model.safetensors and adapter_config.json);
`vineppo export RUN --out DIR` merges them into the base weights as a plain transformers folder.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from vineppo.core.config import NEEDS_PEFT, peft_installed
from vineppo.core.errors import UserError
from vineppo.models import parallel


def active(model: nn.Module | None) -> bool:
    """True for a model with LoRA adapters (peft imported, and the model or the one DDP wraps a PeftModel)."""
    peft = sys.modules.get("peft")
    return peft is not None and model is not None and isinstance(parallel.unwrap(model), peft.PeftModel)


def add_adapters(model: nn.Module, r: int, alpha: float, targets: str) -> nn.Module:
    """`model` with fresh rank-r adapters on `targets` (comma-separated module names, or all-linear); base frozen."""
    if not peft_installed():
        raise UserError(f"--lora-r: {NEEDS_PEFT}")
    from peft import LoraConfig, get_peft_model  # optional dependency

    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=names, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model ..."
        raise UserError(f"--lora-targets {targets}: {str(e).splitlines()[0][:200]}") from None


def reset_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every adapter afresh as peft does (A random, seeded; B zero): the model is its base again."""
    from peft.tuners.lora import LoraLayer  # optional dependency

    torch.manual_seed(seed)
    for m in parallel.unwrap(model).modules():
        if isinstance(m, LoraLayer):
            for name in m.lora_A:
                m.reset_lora_parameters(name, True)


class AdaptersOff:
    """The KL reference of a LoRA policy: the same model called with its adapters disabled (the base model)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)

    def modules(self):
        """The policy's modules (what vineppo.training.ppo.can_share and models.pretrained look through)."""
        return self.policy.modules()


def load_adapters(model: nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load adapter weights saved by peft into `model`; (adapter keys not in `weights`, keys of `weights` unused)."""
    from peft import set_peft_model_state_dict  # optional dependency

    model = parallel.unwrap(model)
    result = set_peft_model_state_dict(model, weights)
    missing = [k for k in result.missing_keys if "lora_" in k]
    return missing, list(result.unexpected_keys)

