"""`vineppo export RUN --out DIR`: a run's checkpoint as a plain transformers model folder.

A LoRA run's checkpoints hold only the adapters; export loads the run's starting model, adds the adapters
into its weights (peft's merge_and_unload) and saves the result, which loads with
`AutoModelForCausalLM.from_pretrained(DIR)` alone. A full fine-tuning checkpoint is already such a folder;
export writes it without the optimiser and run state.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.models.causal_lm import load_model
from vineppo.models.prompts import save_format, saved_record
from vineppo.training import runs
from vineppo.training.sft import default_model


def export(run: Path, out: Path, checkpoint: str | None = None) -> dict:
    """Write checkpoint `checkpoint` (default: the latest) of `run` as a model folder in `out`; returns a summary."""
    ckpt = run / "checkpoints" / checkpoint if checkpoint else runs.latest(run)
    if ckpt is None or not ckpt.is_dir():
        raise UserError(f"{run}: no checkpoint {checkpoint or 'yet'} (not a run folder, or one that stopped before "
                        f"its first checkpoint)")
    runs.make_folder(out, f"--out {out}")
    adapters = (ckpt / "adapter_config.json").is_file()
    if adapters:
        if not configs.peft_installed():
            raise UserError(f"{ckpt} holds LoRA adapters; merging them {configs.NEEDS_PEFT}")
        from peft import PeftModel  # optional dependency

        base, tokenizer = load_model(_start_model(run), device="cpu", verbose=False)
        model = PeftModel.from_pretrained(base, str(ckpt)).merge_and_unload()
    else:
        model, tokenizer = load_model(ckpt, device="cpu", verbose=False)
    try:
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        record = saved_record(ckpt)
        if record:  # the format (and dtype) the run trained in, so eval and train of the export do as it learned
            save_format(out, record["prompt_format"], record.get("dtype"))
    except OSError as e:
        raise UserError(f"cannot write the model in {out}: {runs.reason(e)}") from None
    return {"checkpoint": str(ckpt), "out": str(out), "merged_adapters": adapters}


def _start_model(run: Path) -> str:
    """The model the run started from (its record, else its config), which a LoRA checkpoint's adapters modify."""
    record = run / runs.START
    if record.is_file():
        return json.loads(record.read_text())["model"]
    cfg = configs.load(run / "config.yaml")
    if cfg.model != "auto":
        return cfg.model

    return str(default_model(cfg.task, cfg.data))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo export`."""
    p.add_argument("run", metavar="RUN", help="run folder of `vineppo train`")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the model into")
    p.add_argument("--checkpoint", default=None, metavar="NAME", help="checkpoint folder name (default: latest)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo export`."""
    summary = export(Path(args.run), Path(args.out), args.checkpoint)
    print(json.dumps(summary) if args.json else f"model written to {summary['out']} (from {summary['checkpoint']})")
    return 0
