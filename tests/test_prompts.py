"""Prompt formats (plain, chat, fewshot:N, auto), the format recorded by SFT, and the engine's end-of-turn stops."""

import json

import pytest

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.engine import Engine
from vineppo.models.causal_lm import tiny_config, train_tokenizer
from vineppo.models.prompts import SAVED, Prompter, save_format, saved_dtype
from vineppo.tasks import Task, get_task, register
from vineppo.tasks.arith import load_arith
from vineppo.training.sft import SFTConfig, collate, run_sft, tokenize_examples

ARITH = get_task("arith")
MINI = register(Task(name="arith-mini-prompts", grade=ARITH.grade, split_steps=ARITH.split_steps,
                     load=lambda split, path=None, seed=0: load_arith(split, path, seed,
                                                                      size=64 if split == "train" else 4)))
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plain_tok():
    exs = MINI.load("train", None, 0)
    return train_tokenizer([MINI.prompt(e) + MINI.target(e) for e in exs], vocab_size=300)


@pytest.fixture
def chat_tok():
    """A ChatML tokenizer: <|im_end|> is EOS, <|endoftext|> stays a special token, as in SmolLM2."""
    tok = train_tokenizer([MINI.prompt(e) + MINI.target(e) for e in MINI.load("train", None, 0)], vocab_size=300)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    tok.chat_template = CHATML
    return tok


def test_plain_is_the_tiny_format_unchanged(plain_tok):
    ex = MINI.load("test", None, 0)[0]
    p = Prompter(MINI, plain_tok)  # auto: no chat template -> plain
    assert p.format == "plain"
    assert p.prompt(ex) == plain_tok(MINI.prompt(ex))["input_ids"]
    eos = plain_tok.eos_token_id
    assert p.target(ex) == plain_tok(" " + ex.solution, add_special_tokens=False)["input_ids"] + [eos]


def test_chat_prompt_and_target(chat_tok):
    ex = MINI.load("test", None, 0)[0]
    p = Prompter(MINI, chat_tok)
    assert p.format == "chat"
    text = chat_tok.decode(p.prompt(ex))
    assert text == f"<|im_start|>user\n{MINI.instruction}\n\n{ex.problem}<|im_end|>\n<|im_start|>assistant\n"
    assert "####" in MINI.instruction and "boxed" in get_task("math").instruction
    target = p.target(ex)
    assert chat_tok.decode(target) == ex.solution + "<|im_end|>" and target[-1] == chat_tok.eos_token_id
    # SFT: the loss is on the assistant turn (and its end-of-turn token) only
    (ids, n_prompt), = tokenize_examples(p, [ex], 10_000)
    labels = collate([(ids, n_prompt)], chat_tok.pad_token_id)["labels"][0].tolist()
    assert [t for t in labels if t != -100] == target and n_prompt == len(p.prompt(ex))


@pytest.mark.parametrize("fmt", ["plain", "chat", "fewshot:2"])
def test_batched_encode_is_the_prompts(chat_tok, fmt):
    exs = MINI.load("test", None, 0)
    p = Prompter(MINI, chat_tok, fmt)
    assert p.encode(exs) == [p.prompt(ex) for ex in exs]


def test_fewshot_prompt(plain_tok):
    train, ex = MINI.load("train", None, 0), MINI.load("test", None, 0)[0]
    text = Prompter(MINI, plain_tok, "fewshot:2").text(ex)
    assert text == "".join(f"Problem:\n{s.problem}\n\nSolution: {s.solution}\n\n" for s in train[:2]) + MINI.prompt(ex)
    own = Prompter(MINI, plain_tok, "fewshot:2").text(train[0])  # a shot never shows the problem's own solution
    assert own.count("Solution:") == 3 and train[0].solution not in own and train[2].problem in own


@pytest.mark.parametrize("spec,msg", [("fewshot:0", "fewshot:N"), ("chatty", "--prompt-format"),
                                      ("chat", "no chat template")])
def test_bad_formats_are_one_line_errors(plain_tok, spec, msg):
    with pytest.raises(UserError, match=msg) as e:
        Prompter(MINI, plain_tok, spec)
    assert "\n" not in str(e.value)


def test_bad_format_in_a_train_config_is_refused_before_anything_loads():
    with pytest.raises(UserError, match=r"^--prompt-format: must be plain, chat, fewshot:N") as e:
        configs.validate(configs.TrainConfig(prompt_format="fewshot:0"))
    assert "\n" not in str(e.value)
    assert configs.validate(configs.TrainConfig(prompt_format="fewshot:3")).prompt_format == "fewshot:3"


def test_sft_records_the_format_and_eval_reuses_it(tmp_path, plain_tok):
    out = run_sft(SFTConfig("arith-mini-prompts", out=tmp_path / "sft", max_steps=1, batch_size=4, hidden=16,
                            layers=1, prompt_format="fewshot:1", progress=False))
    assert json.loads((out / SAVED).read_text()) == {"prompt_format": "fewshot:1"}
    assert Prompter(MINI, plain_tok, None, model=out).format == "fewshot:1"  # no flag: the recorded format
    assert Prompter(MINI, plain_tok, "plain", model=out).format == "plain"  # a flag overrides it
    save_format(tmp_path, "chat")
    with pytest.raises(UserError, match="no chat template"):
        Prompter(MINI, plain_tok, model=tmp_path)
    (tmp_path / SAVED).write_text('{"prompt_format": 3}')
    with pytest.raises(UserError, match=SAVED):
        Prompter(MINI, plain_tok, model=tmp_path)
    save_format(tmp_path, "plain", "bfloat16")
    assert saved_dtype(tmp_path) == "bfloat16" and saved_dtype(out) is None  # an SFT folder records no dtype
    (tmp_path / SAVED).write_text('{"prompt_format": "plain", "dtype": "int8"}')
    with pytest.raises(UserError, match="dtype"):
        saved_dtype(tmp_path)


def test_every_end_of_turn_token_stops(chat_tok):
    from transformers import AutoModelForCausalLM

    eos = chat_tok.eos_token_id
    config = tiny_config("llama", len(chat_tok), eos, hidden=16, layers=1, heads=2, mlp=32)
    model = AutoModelForCausalLM.from_config(config)
    stops = Engine(model, chat_tok).eos_token_ids
    assert {eos, chat_tok.convert_tokens_to_ids("<|endoftext|>")} <= set(stops)
