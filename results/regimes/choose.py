"""The regimes study's chosen conditions (PROTOCOL.md), from the start models' own samples:

    python results/regimes/choose.py hard EVAL.jsonl --out $SCRATCH/hard-ids.txt
        the training problems whose pass rate under the start model (its samples at the training temperature, as
        `vineppo eval --split train` wrote them) is in [0.05, 0.30]
    python results/regimes/choose.py budget EVAL.jsonl --model MODEL --quantile 0.6 --key cutoff_tokens --out $SCRATCH
        the --max-new-tokens that cuts a share 1 - quantile of the start model's careful solutions (in tokens,
        counted with the model's tokenizer, its end-of-sequence token included; `--margin N` adds N), into
        $SCRATCH/select.json

Each writes what it chose and the figures it chose it from; `--json` prints them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

BAND = (0.05, 0.30)  # the pass rates of a hard prompt (PROTOCOL.md, condition hard)


def rows(path: Path) -> list[dict]:
    """The per-problem rows of a `vineppo eval` JSONL."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hard(path: Path, out: Path) -> dict:
    """Write the ids of the problems whose share of right samples is in BAND; the figures of the choice."""
    found = rows(path)
    chosen = [r["id"] for r in found if BAND[0] <= r["pass@1"] <= BAND[1]]
    samples = found[0]["samples"]
    out.write_text(f"# problems whose start-model pass rate over {samples} samples is in [{BAND[0]}, {BAND[1]}] "
                   f"(results/regimes/choose.py hard)\n" + "\n".join(chosen) + "\n")
    rates = [r["pass@1"] for r in found]
    return {"problems": len(found), "samples": samples, "chosen": len(chosen), "band": list(BAND),
            "mean_rate_all": sum(rates) / len(rates),
            "mean_rate_chosen": sum(r["pass@1"] for r in found if r["id"] in set(chosen)) / max(len(chosen), 1),
            "all_wrong": sum(r == 0 for r in rates) / len(rates)}


def budget(path: Path, model: str, quantile: float, margin: int = 0) -> dict:
    """The token length at `quantile` of the careful samples (EOS counted), plus `margin`: a cap there cuts the
    longer ones."""
    from vineppo.models.causal_lm import load_model  # torch and transformers: only for the tokenizer

    tokenizer = load_model(model, device="cpu", verbose=False)[1]
    lengths = sorted(len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
                     for r in rows(path) for text, how in zip(r["sample_texts"], r["sample_behaviour"])
                     if how == "careful")
    at = lengths[min(len(lengths) - 1, math.ceil(quantile * len(lengths)) - 1)] + margin
    return {"careful_samples": len(lengths), "quantile": quantile, "margin": margin, "tokens": at,
            "cut_share": sum(n > at for n in lengths) / len(lengths), "longest": lengths[-1],
            "median": lengths[len(lengths) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("hard", "budget"))
    ap.add_argument("eval_jsonl", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="hard: the ids file; budget: the folder of select.json")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantile", type=float, default=0.6)
    ap.add_argument("--margin", type=int, default=0, help="budget: tokens added to the quantile's length")
    ap.add_argument("--key", default="cutoff_tokens", help="budget: the key of select.json it sets")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.what == "hard":
        found = hard(args.eval_jsonl, args.out)
    else:
        found = budget(args.eval_jsonl, args.model, args.quantile, args.margin)
        select = args.out / "select.json"
        chosen = json.loads(select.read_text()) if select.exists() else {}
        chosen[args.key] = found["tokens"]
        chosen[args.key + "_from"] = found
        select.write_text(json.dumps(chosen, indent=2) + "\n")
    print(json.dumps(found, indent=2) if args.json else found)


if __name__ == "__main__":
    main()
