"""The SFT model that ships with the package (the main job's start): present, small, the one its README names,
trained with today's defaults, and showing the two behaviours the default `arith` data teaches."""

import json
import re

import pytest

from vineppo.cli import main
from vineppo.models.causal_lm import load_model
from vineppo.training import runs
from vineppo.training.sft import SHIPPED, TINY_DEFAULTS, default_model, default_sft_dir, is_saved_model


def test_shipped_model_is_small_and_is_the_default_start_of_arith():
    assert is_saved_model(SHIPPED)
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size <= 5 * 2**20, f"{size / 2**20:.1f} MB"
    assert default_model("arith") == SHIPPED
    # other data (here the clean task) is another model: it is trained by `vineppo sft`, never the shipped one
    assert default_model("arith", data="premature=0") == default_sft_dir("arith", "premature=0")
    assert default_model("gsm8k") == default_sft_dir("gsm8k")


def test_shipped_model_matches_its_readme_and_todays_defaults():
    readme = (SHIPPED / "README.md").read_text()
    assert "vineppo sft --out src/vineppo/assets/sft-arith" in readme
    fingerprint = re.search(r"sha256 ([0-9a-f]{64})", readme).group(1)
    assert runs.weights_digest(str(SHIPPED)) == fingerprint
    config = json.loads((SHIPPED / "sft_config.json").read_text())
    assert (config["task"], config["model"], config["data"], config["seed"]) == ("arith", "tiny", None, 0)
    assert {k: config[k] for k in TINY_DEFAULTS} == TINY_DEFAULTS


def test_shipped_model_loads_and_answers_in_the_taught_behaviours(tmp_path, capsys):
    model, tokenizer = load_model(SHIPPED, device="cpu", verbose=False)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000 and tokenizer.eos_token_id is not None
    with pytest.raises(SystemExit) as done:  # no --model: the default, the shipped model
        main(["eval", "--limit", "24", "--samples", "0", "--device", "cpu", "--out", str(tmp_path / "e.jsonl"), "--json"])
    assert done.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shares = {name: row["share"] for name, row in summary["greedy_behaviours"].items()}
    assert shares["careful"] + shares["premature"] >= 0.9, shares  # it writes what its references taught it
    assert summary["greedy"] > 0
