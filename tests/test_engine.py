"""Tests of the rollout engine on tiny random models (nothing is downloaded)."""

import contextlib
import copy
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

from vineppo.engine import TOP_K, Engine, Request, Sample, SamplingParams
from vineppo.engine.sampling import draw, sample

torch.set_num_threads(1)

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 \n+-=:.,?!ABCDEFGHIJKLMNOPQRSTUVWXYZ()*/#")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def char_tokenizer():
    """One token per character of CHARS, plus <pad> 0, <eos> 1, <unk> 2."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def _make(kind, vocab, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, **common)
        m = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, **common)
        m = Qwen2ForCausalLM(cfg)
    else:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
        m = GPT2LMHeadModel(cfg)
    return m.eval()


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def model(request, tok):
    return _make(request.param, len(tok))


@pytest.fixture(scope="module")
def llama(tok):
    return _make("llama", len(tok))


@pytest.fixture(scope="module")
def peaked(tok):
    """A Llama whose next-token distributions are far from uniform (so top-p matters)."""
    m = _make("llama", len(tok), seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 80, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompts, max_new):
    """Hugging Face greedy generation of a left-padded batch; outputs cut after EOS."""
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        am[r, P - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, do_sample=False, max_new_tokens=max_new, pad_token_id=0)[:, P:]
    res = []
    for row in out.tolist():
        if 1 in row:
            row = row[: row.index(1) + 1]
        res.append(row)
    return res


def _record_batches(model):
    """Attach a hook recording (rows, attention-mask length) of every forward call."""
    seen = []

    def hook(mod, args, kwargs):
        am = kwargs.get("attention_mask")
        seen.append((am.shape[0], am.shape[-1]))  # a 2-D mask [rows, keys] or a 4-D one [rows, 1, 1, keys]

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def test_greedy_matches_hf_generate(model, tok):
    prompts = _prompts([5, 17, 2, 11, 9])
    ref = _hf_greedy(model, prompts, 24)
    out = Engine(model, tok).generate(prompts, 2, GREEDY)
    assert len(out) == len(prompts)
    for r in range(len(prompts)):
        assert len(out[r]) == 2
        for s in out[r]:
            assert isinstance(s, Sample)
            assert s.token_ids == ref[r]
            assert s.text == tok.decode(ref[r], skip_special_tokens=True)
            assert s.finish_reason == ("stop" if ref[r][-1] == 1 else "length")
    # and each prompt alone (no padding) gives the same tokens
    for r, p in enumerate(prompts[:2]):
        assert _hf_greedy(model, [p], 24)[0] == ref[r]


def test_eos_stop_string_and_length(llama, tok):
    for seed in range(3, 30):  # a prompt whose greedy response does not hit the real EOS within 30 tokens
        prompt = _prompts([8], seed=seed)[0]
        base = Engine(llama, tok).generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=30))[0][0]
        if base.finish_reason == "length" and len(set(base.token_ids[:12])) > 4:
            break
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    # length
    short = Engine(llama, tok).generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=7))[0][0]
    assert short.token_ids == base.token_ids[:7] and short.finish_reason == "length"
    # EOS: declare the 6th generated token an EOS token -> the sample ends at its first occurrence
    t = base.token_ids[5]
    first = base.token_ids.index(t)
    m2 = copy.deepcopy(llama)
    m2.generation_config.eos_token_id = t
    s = Engine(m2, tok).generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=30))[0][0]
    assert s.token_ids == base.token_ids[: first + 1] and s.finish_reason == "stop"
    # stop string: two characters of the text ending at position 12 -> ends at its first completion
    text = base.text
    stop = text[10:12]
    end = next(m for m in range(1, len(text) + 1) if stop in text[:m])
    s = Engine(llama, tok).generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=30, stop=(stop,)))[0][0]
    assert s.token_ids == base.token_ids[:end] and s.finish_reason == "stop"
    assert s.text.endswith(stop) and s.text.count(stop) == 1
    # a stop string that never occurs changes nothing
    s = Engine(llama, tok).generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=30, stop=("@@",)))[0][0]
    assert s.token_ids == base.token_ids and s.finish_reason == "length"


def test_logprobs_match_full_forward(model, tok):
    prompts = _prompts([4, 13, 8])
    for params in (SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12), GREEDY):
        g = torch.Generator().manual_seed(0)
        out = Engine(model, tok).generate(prompts, 3, params, generator=g)
        for p, samples in zip(prompts, out):
            for s in samples:
                assert len(s.logprobs) == len(s.token_ids)
                with torch.no_grad():
                    lg = model(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1].float()
                if params.temperature > 0:
                    lg = lg / params.temperature
                ref = torch.log_softmax(lg, -1).gather(1, torch.tensor(s.token_ids).view(-1, 1)).view(-1)
                assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs, ref)


def _nucleus(logits, T, top_p):
    p = torch.softmax(logits.double() / T, -1)
    sp, si = p.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < top_p
    q = torch.zeros_like(p)
    q[si[keep]] = sp[keep]
    return (q / q.sum()).numpy()


def _chi2_gof(counts, probs):
    counts = np.asarray(counts, float)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the nucleus"
    m = probs > 0
    exp = probs[m] * counts.sum()
    obs = counts[m]
    # pool small bins
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("scale", [40.0, 3.0])
def test_first_token_frequencies_follow_top_p(tok, scale):
    """scale 40: the nucleus is inside the top TOP_K tokens (top-k path); scale 3: it is not (full sort path)."""
    m = _make("llama", len(tok), seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    prompt = _prompts([10], seed=5)[0]
    T, top_p = 0.8, 0.7
    with torch.no_grad():
        logits = m(torch.tensor([prompt])).logits[0, -1]
    top_mass = torch.softmax(logits.double() / T, -1).topk(TOP_K).values.sum()
    assert (top_mass >= top_p) == (scale > 10), "the test should exercise the intended sampling path"
    probs = _nucleus(logits, T, top_p)
    n_kept = int((probs > 0).sum())
    assert 2 <= n_kept < len(tok) - 5, "test model should give a nucleus that excludes tokens"
    g = torch.Generator().manual_seed(123)
    out = Engine(m, tok).generate([prompt], 3000, SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1),
                                  generator=g)[0]
    counts = np.bincount([s.token_ids[0] for s in out], minlength=len(tok))
    assert _chi2_gof(counts, probs) > 1e-3
    # the test can fail: the same counts reject the distribution without top-p filtering
    full = torch.softmax(logits.double() / T, -1).numpy()
    assert _chi2_gof(counts, full) < 1e-3


@pytest.mark.parametrize("spread", [0.01, 0.2])
def test_top_p_on_a_flat_row_widens_the_window_and_stays_exact(spread):
    """A 5,000-token vocabulary where the top TOP_K hold far less than top_p (spread 0.01: the nucleus spans ~230
    tokens, inside the widened 256 window) or all of it (0.2): frequencies follow the exact nucleus either way, and
    the log-probs are those of the full softmax."""
    V, T, top_p = 5000, 0.8, 0.9
    logits = -spread * torch.arange(V, dtype=torch.float32)
    probs = _nucleus(logits, T, top_p)
    wide = int((probs > 0).sum()) > TOP_K
    assert wide == (spread < 0.1), "the test should exercise the intended window"
    g = torch.Generator().manual_seed(0)
    tok, lp, _ = sample(logits.expand(20000, V), SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1), g)
    assert torch.allclose(lp, torch.log_softmax(logits / T, -1)[tok], atol=1e-5)
    counts = np.bincount(tok.numpy(), minlength=V)
    assert _chi2_gof(counts, probs) > 1e-3
    if wide:  # the test can fail: a window cut at TOP_K would never draw the nucleus's tail
        assert counts[TOP_K:].sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1.0, 0.6, 1.3])
def test_sampling_draws_what_torch_multinomial_draws_bit_for_bit(dtype, T):
    """The step's own draw (no checks of the whole tensor, in place) against the same step through
    torch.multinomial, from generators of the same seed: the same tokens and log-probs, to the bit. Top-p's
    window is drawn by the same ``draw``, checked here on unnormalised probabilities with zeros (its cut)."""
    for seed, (N, V) in enumerate([(3, 50), (64, 1000), (16, 32000)]):
        logits = (3 * torch.randn(N, V, generator=torch.Generator().manual_seed(seed))).to(dtype)
        before = logits.clone()
        x = logits.float() / T
        lse = torch.logsumexp(x, -1, keepdim=True)
        want = torch.multinomial((x - lse).exp(), 1, generator=torch.Generator().manual_seed(seed)).view(-1)
        tok, lp, _ = sample(logits, SamplingParams(temperature=T, top_p=1.0, max_new_tokens=1),
                            torch.Generator().manual_seed(seed))
        assert torch.equal(tok, want), (N, V)
        assert torch.equal(lp, (x.gather(1, want.view(-1, 1)) - lse).view(-1))
        sample(logits, SamplingParams(temperature=T, top_p=0.9, max_new_tokens=1), torch.Generator())
        assert torch.equal(logits, before), "sampling must not write into the model's logits"
    probs = torch.rand(32, 500, generator=torch.Generator().manual_seed(5))
    for seed in range(5):
        p = probs.masked_fill(probs < 0.5, 0.0)
        want = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)).view(-1)
        assert torch.equal(draw(p.clone(), torch.Generator().manual_seed(seed)), want)


COMPILER = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")  # torch.compile's CPU kernels


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.7)])
def test_fused_sampling_draws_the_same_distribution_and_repeats_for_a_seed(T, top_p, device, dtype):
    """The compiled step runs the same race in another rounding: its frequencies follow softmax(x / T) (or its
    nucleus), its log-probs are the full softmax's, a seed repeats its draws, and it draws the eager step's token in
    almost every row."""
    if device == "cpu" and COMPILER is None:
        pytest.skip("torch.compile needs a C++ compiler for CPU kernels")
    V, n = 400, 20000
    logits = (1.5 * torch.randn(V, generator=torch.Generator().manual_seed(3))).to(dtype).float()  # as the model gives
    rows = logits.expand(n, V).contiguous().to(device, dtype)
    params = SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1)
    draw_ = lambda fused: sample(rows, params, torch.Generator(device=device).manual_seed(0), fused=fused)  # noqa: E731
    (tok, lp, _), (again, _, _), (eager, _, _) = draw_(True), draw_(True), draw_(False)
    assert torch.equal(tok, again)
    assert (tok == eager).float().mean() > 0.99
    tok, lp = tok.cpu(), lp.cpu()
    assert torch.allclose(lp, torch.log_softmax(logits / T, -1)[tok], atol=1e-5)
    counts = np.bincount(tok.numpy(), minlength=V)
    assert _chi2_gof(counts, _nucleus(logits, T, top_p)) > 1e-3
    if T != 1.0:  # the test can fail: the same counts reject the distribution at T = 1
        assert _chi2_gof(counts, torch.softmax(logits.double(), -1).numpy()) < 1e-3


@pytest.mark.skipif(COMPILER is None, reason="torch.compile needs a C++ compiler for CPU kernels")
def test_an_engine_with_fused_sampling_draws_almost_the_recorded_samples(tok, monkeypatch):
    """The recorded workload's jobs through Engine(fused_sampling=True): the same race, so the same samples except
    where rounding flips a near-tie (and every later token of that sample)."""
    eager = [s[0] for name, tree in recorded_workload(tok).items() for s in _samples(tree)]
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "fused_sampling": True}))
    fused = [s[0] for name, tree in recorded_workload(tok).items() for s in _samples(tree)]
    assert len(eager) == len(fused) > 100
    assert sum(x == y for x, y in zip(eager, fused)) / len(eager) > 0.9


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sampling_from_logits_that_are_not_finite_stops_with_one_line(bad):
    logits = torch.randn(6, 40)
    logits[[1, 4], 3] = bad
    with pytest.raises(FloatingPointError, match=r"NaN or infinite in 2 of 6 rows"):
        sample(logits, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=1), torch.Generator())


def test_continuations_match_reencoded_prefix_greedy(model, tok):
    prompts = _prompts([6, 15, 9])
    resp = Engine(model, tok).generate(prompts, 1, SamplingParams(temperature=0, max_new_tokens=20))
    seqs = [p + r[0].token_ids for p, r in zip(prompts, resp)]
    bounds = [[len(p), len(p) + 4, len(p) + 11] for p in prompts]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    mc = Engine(model, tok).continuations(Request(seqs, bounds, 3, params))
    prefixes = [s[:b] for s, bs in zip(seqs, bounds) for b in bs]
    ref = _hf_greedy(model, prefixes, 10)
    flat = [x for row in mc for x in row]
    assert len(flat) == len(prefixes)
    for samples, r in zip(flat, ref):
        assert len(samples) == 3
        for s in samples:
            assert s.token_ids == r


def test_continuations_sampling_distribution(peaked, tok):
    """First tokens sampled from a sliced shared cache vs from the re-encoded prefix (two-sample test)."""
    prompts = _prompts([7, 14], seed=9)
    resp = Engine(peaked, tok).generate(prompts, 1, SamplingParams(temperature=0, max_new_tokens=12))
    seqs = [p + r[0].token_ids for p, r in zip(prompts, resp)]
    bounds = [[len(prompts[0]) + 5], [len(prompts[1]), len(prompts[1]) + 8]]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=2)
    g = torch.Generator().manual_seed(7)
    mc = Engine(peaked, tok).continuations(Request(seqs, bounds, 1500, params, generator=g))
    prefixes = [seqs[0][: bounds[0][0]], seqs[1][: bounds[1][0]], seqs[1][: bounds[1][1]]]
    g2 = torch.Generator().manual_seed(8)
    direct = Engine(peaked, tok).generate(prefixes, 1500, params, generator=g2)
    shared = [mc[0][0], mc[1][0], mc[1][1]]
    V = len(tok)
    for a, b, pre in zip(shared, direct, prefixes):
        ca = np.bincount([s.token_ids[0] for s in a], minlength=V)
        cb = np.bincount([s.token_ids[0] for s in b], minlength=V)
        keep = (ca + cb) > 0
        if keep.sum() > 1:
            assert stats.chi2_contingency(np.stack([ca[keep], cb[keep]])).pvalue > 1e-3
        with torch.no_grad():
            logits = peaked(torch.tensor([pre])).logits[0, -1]
        assert _chi2_gof(ca, _nucleus(logits, 1.0, 0.95)) > 1e-3
    # and the test can fail: first tokens of different prefixes are distinguishable
    c0 = np.bincount([s.token_ids[0] for s in shared[1]], minlength=V)
    c1 = np.bincount([s.token_ids[0] for s in shared[2]], minlength=V)
    keep = (c0 + c1) > 0
    assert stats.chi2_contingency(np.stack([c0[keep], c1[keep]])).pvalue < 1e-3


def test_small_token_budget_chunks_and_agrees(llama, tok):
    prompts = _prompts([5, 21, 3, 12, 8, 16])
    params = SamplingParams(temperature=0, max_new_tokens=15)
    big = Engine(llama, tok, token_budget=1 << 20)
    small = Engine(llama, tok, token_budget=80)
    a = big.generate(prompts, 3, params)
    seen, h = _record_batches(llama)
    try:
        b = small.generate(prompts, 3, params)
    finally:
        h.remove()
    assert [[s.token_ids for s in r] for r in a] == [[s.token_ids for s in r] for r in b]
    assert max(r * c for r, c in seen) <= 80
    assert len(seen) > 15 * 2  # several chunks
    seqs = [p + r[0].token_ids for p, r in zip(prompts, a)]
    bounds = [[len(p), len(p) + 6, len(p) + 10] for p in prompts]
    ca = big.continuations(Request(seqs, bounds, 2, params))
    seen, h = _record_batches(llama)
    try:
        cb = small.continuations(Request(seqs, bounds, 2, params))
    finally:
        h.remove()
    assert [[[s.token_ids for s in x] for x in r] for r in ca] == [[[s.token_ids for s in x] for x in r] for r in cb]
    assert max(r * c for r, c in seen) <= 80 + 40  # prefill of one long sequence may exceed a tiny budget alone
    decode = [(r, c) for r, c in seen if c > 0]
    assert decode


def test_finished_rows_leave_the_batch(llama, tok):
    prompts = _prompts([6, 6], seed=11)
    base = Engine(llama, tok).generate(prompts, 1, SamplingParams(temperature=0, max_new_tokens=20))
    # make the first prompt's 3rd token an EOS token (if it does not occur early in the other)
    t = base[0][0].token_ids[2]
    if t in base[1][0].token_ids[:10]:
        pytest.skip("token collision in random model")
    m2 = copy.deepcopy(llama)
    m2.generation_config.eos_token_id = t
    seen, h = _record_batches(m2)
    try:
        out = Engine(m2, tok).generate(prompts, 4, SamplingParams(temperature=0, max_new_tokens=20))
    finally:
        h.remove()
    assert all(len(s.token_ids) <= 3 and s.finish_reason == "stop" for s in out[0])
    rows = [r for r, _ in seen[1:]]  # decode steps
    assert rows[0] == 8 and rows[-1] == 4


def test_determinism_and_progress(llama, tok):
    prompts = _prompts([5, 9])
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10)
    calls = []
    a = Engine(llama, tok).generate(prompts, 4, params, generator=torch.Generator().manual_seed(1),
                                    progress=lambda done, tokens: calls.append((done, tokens)))
    b = Engine(llama, tok).generate(prompts, 4, params, generator=torch.Generator().manual_seed(1))
    c = Engine(llama, tok).generate(prompts, 4, params, generator=torch.Generator().manual_seed(2))
    ids = lambda o: [[s.token_ids for s in r] for r in o]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert calls and calls[-1] == (8, sum(len(s.token_ids) for r in a for s in r)) and calls == sorted(calls)


def test_decode_steps_of_sdpa_models_run_the_engines_attention(model, tok, monkeypatch):
    """Decode steps of every SDPA model (Llama and Qwen2 with grouped-query attention, 4 query heads on 2
    key/value heads; GPT-2 without) run engine.attention's decode attention, not transformers' SDPA function
    (which copies the KV cache per query head given a mask, and runs slower on the engine's non-contiguous
    cache view); the samples and log-probs are the same."""
    from transformers import AttentionInterface

    sdpa = AttentionInterface._global_mapping["sdpa"]
    calls = []

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    prompts, params = _prompts([5, 17, 2, 11]), SamplingParams(temperature=1.0, max_new_tokens=12)
    packed = Engine(model, tok).generate(prompts, 3, params, torch.Generator().manual_seed(0))
    assert 1 not in calls
    assert model.config._attn_implementation == "sdpa"  # restored after the job
    monkeypatch.setattr("vineppo.engine.runner.packed_decode", lambda model: contextlib.nullcontext())
    calls.clear()
    plain = Engine(model, tok).generate(prompts, 3, params, torch.Generator().manual_seed(0))
    assert 1 in calls
    assert [[s.token_ids for s in r] for r in packed] == [[s.token_ids for s in r] for r in plain]
    lp = [[x for r in out for s in r for x in s.logprobs] for out in (packed, plain)]
    assert np.allclose(lp[0], lp[1], atol=1e-5)


def test_training_mode_restored_and_bad_input(llama, tok):
    llama.train()
    try:
        Engine(llama, tok).generate(_prompts([4]), 1, SamplingParams(temperature=0, max_new_tokens=2))
        assert llama.training
    finally:
        llama.eval()
    with pytest.raises(ValueError):
        Engine(llama, tok).continuations(Request([[5, 6, 7]], [[2, 2]], 1, GREEDY))
    with pytest.raises(ValueError):
        Engine(llama, tok).continuations(Request([[5, 6, 7]], [[4]], 1, GREEDY))


def test_rows_finishing_at_admission_keep_their_identity(peaked, tok):
    """Small budget + frequent EOS: rows admitted into a running batch may finish on their first token."""
    prompts = _prompts([4, 25, 6, 30, 9, 12, 3, 20], seed=21)
    with torch.no_grad():
        firsts = [int(peaked(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    m2 = copy.deepcopy(peaked)
    m2.generation_config.eos_token_id = sorted(set(firsts[1::2]))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
    eng = Engine(m2, tok, token_budget=120)
    eos = set(eng.eos_token_ids)
    out = eng.generate(prompts, 3, params, generator=torch.Generator().manual_seed(0))
    n_first = 0
    for p, samples in zip(prompts, out):
        for s in samples:
            assert s is not None and 1 <= len(s.token_ids) <= 8
            ended = s.token_ids[-1] in eos
            assert s.finish_reason == ("stop" if ended else "length")
            assert not any(t in eos for t in s.token_ids[:-1])
            n_first += len(s.token_ids) == 1
            with torch.no_grad():
                lg = m2(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1].float()
            ref = torch.log_softmax(lg, -1).gather(1, torch.tensor(s.token_ids).view(-1, 1)).view(-1)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)
    assert n_first > 0


def _assert_fresh_logprobs(model, seqs, bounds, mc):
    """Every continuation's log-probs equal a fresh forward pass over its prefix and tokens."""
    for s, bs, per in zip(seqs, bounds, mc):
        for b, samples in zip(bs, per):
            for x in samples:
                with torch.no_grad():
                    lg = model(torch.tensor([s[:b] + x.token_ids])).logits[0, b - 1 : -1].float()
                ref = torch.log_softmax(lg, -1).gather(1, torch.tensor(x.token_ids).view(-1, 1)).view(-1)
                assert torch.allclose(torch.tensor(x.logprobs), ref, atol=1e-4)


def test_continuations_logprobs_under_a_small_budget(llama, tok):
    """Many prefixes of different lengths through a small budget: rows are refilled in place and rebuilt;
    every continuation's log-probs must still equal a fresh forward pass over prefix + continuation."""
    prompts = _prompts([3, 9, 17, 5, 12, 22, 7], seed=31)
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=9)
    eng = Engine(llama, tok, token_budget=200)
    resp = eng.generate(prompts, 1, params, generator=g)
    seqs = [p + r[0].token_ids for p, r in zip(prompts, resp)]
    bounds = [sorted({len(p), len(p) + 2, len(s) - 1} - {0}) for p, s in zip(prompts, seqs)]
    seen, h = _record_batches(llama)
    try:
        mc = eng.continuations(Request(seqs, bounds, 3, params, generator=g))
    finally:
        h.remove()
    assert max(r * c for r, c in seen[1:]) <= 200 + 9  # decode batches within the budget
    _assert_fresh_logprobs(llama, seqs, bounds, mc)


def test_continuations_honour_per_row_budgets(llama, tok):
    """Each boundary's continuations stop at its own budget: greedy, they are the unbounded ones cut there."""
    prompts = _prompts([5, 12, 8, 17], seed=41)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    resp = Engine(llama, tok).generate(prompts, 1, params)
    seqs = [p + r[0].token_ids for p, r in zip(prompts, resp)]
    bounds = [[len(p), len(p) + 3] for p in prompts]
    budgets = [[12, 9] if i % 2 else [2, 1] for i in range(len(prompts))]
    free = Engine(llama, tok).continuations(Request(seqs, bounds, 2, params))
    for token_budget in (1 << 20, 60):  # one batch; and rows refilled in place and rebuilt under a small budget
        cut = Engine(llama, tok, token_budget=token_budget).continuations(Request(seqs, bounds, 2, params, budgets=budgets))
        for f_row, c_row, b_row in zip(free, cut, budgets):
            for f_samples, c_samples, n in zip(f_row, c_row, b_row):
                for f, c in zip(f_samples, c_samples):
                    assert c.token_ids == f.token_ids[:n]
                    assert c.finish_reason == (f.finish_reason if len(f.token_ids) <= n else "length")
                    assert c.logprobs == pytest.approx(f.logprobs[:n], abs=1e-5)
    assert any(len(f.token_ids) > 2 for row in free[::2] for x in row for f in x)  # the budgets did cut something
    with pytest.raises(ValueError, match="budgets"):
        Engine(llama, tok).continuations(Request(seqs[:1], bounds[:1], 1, params, budgets=[[0, 5]]))
    with pytest.raises(ValueError, match="budgets"):
        Engine(llama, tok).continuations(Request(seqs[:1], bounds[:1], 1, params, budgets=[[13, 5]]))


# ------------------------------------------------------------------ recorded samples (the same seed, the same samples)

EXPECTED = Path(__file__).with_name("engine_expected.json")


def recorded_workload(tok, decode: str = "split") -> dict:
    """Samples of a fixed-seed workload that goes through every path of the engine: sampling by full softmax, by
    top-p through the top-k and through the full sort, greedy; stop strings; several EOS ids; per-row budgets;
    rows refilled in place and batches rebuilt under a small token budget. Recorded in engine_expected.json from
    the engine whose admission reads the batch's own rows (its longest running row and its finished places); a
    change that alters any sample fails the test."""
    flat = lambda out: [[s.token_ids, s.finish_reason, [round(x, 4) for x in s.logprobs]] for s in out]  # noqa: E731
    llama, peaked = _make("llama", len(tok)), _make("llama", len(tok), seed=1)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(8.0)
    peaked.generation_config.eos_token_id = [1, 40, 52]  # a few frequent tokens end rows early
    prompts = _prompts([5, 17, 2, 11, 9], seed=3)
    res = {}
    jobs = {"full": (llama, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)),
            "sort": (llama, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)),
            "topk": (peaked, SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)),
            "stop": (llama, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, stop=("e", "7x"))),
            "greedy": (peaked, SamplingParams(temperature=0, max_new_tokens=12))}
    for name, (m, params) in jobs.items():
        out = Engine(m, tok, token_budget=90, decode=decode).generate(prompts, 3, params,
                                                                      generator=torch.Generator().manual_seed(7))
        res[name] = [flat(r) for r in out]
    seqs = [p + s[0][0] for p, s in zip(prompts, res["sort"])]
    bounds = [sorted({len(p), len(p) + 3, len(q) - 1} & set(range(1, len(q) + 1))) for p, q in zip(prompts, seqs)]
    budgets = [[10, 4, 7][: len(b)] for b in bounds]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10, stop=("q",))
    for name, m, budget in (("mc", peaked, 1 << 20), ("mc_small", peaked, 60), ("mc_llama", llama, 70)):
        out = Engine(m, tok, token_budget=budget, decode=decode).continuations(Request(
            seqs, bounds, 3, params, budgets=budgets, generator=torch.Generator().manual_seed(11)))
        res[name] = [[flat(x) for x in r] for r in out]
    return res


@pytest.mark.parametrize("decode", ["split", "ring"])
def test_same_seed_same_samples_as_recorded(tok, decode):
    """Both KV layouts: the ring's steps (run eagerly here; CUDA graphs replay the same steps) admit, refill and drop
    rows as the split layout does, so they draw the recorded samples too (its sums go in another order)."""
    got = recorded_workload(tok, decode)
    want = json.loads(EXPECTED.read_text())
    assert got.keys() == want.keys()
    for name in want:
        a, b = _strip(got[name]), _strip(want[name])
        assert a == b, f"{name}: the samples differ from the recorded ones"
        assert np.allclose(_logprobs(got[name]), _logprobs(want[name]), atol=2e-4), name
    # the workload exercises what it claims: early stops by EOS and stop strings, length cuts, short budgets
    reasons = {r for name in want for s in _samples(want[name]) for r in [s[1]]}
    assert reasons == {"stop", "length"}
    assert any(len(s[0]) == 4 for s in _samples(want["mc_small"]))


def _samples(tree):
    """The [token_ids, finish_reason, logprobs] leaves of nested lists, in order."""
    return [tree] if len(tree) == 3 and isinstance(tree[1], str) else [s for t in tree for s in _samples(t)]


def _strip(tree):
    return [(s[0], s[1]) for s in _samples(tree)]


def _logprobs(tree):
    return [x for s in _samples(tree) for x in s[2]]


# ------------------------------------------------------------------ per-token entropies (SamplingParams.entropy)


def _tempered_entropies(model, prefix, tokens, T):
    """Per token of ``tokens`` after ``prefix``: the entropy of softmax(logits / T) (T = 0: of softmax(logits)),
    from one plain forward pass of ``model`` over prefix + tokens."""
    with torch.no_grad():
        lg = model(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1 : -1].double()
    x = lg / T if T > 0 else lg
    return -(x.softmax(-1) * x.log_softmax(-1)).nan_to_num().sum(-1)


@pytest.mark.parametrize("T,top_p", [(0, 1.0), (1.0, 1.0), (0.7, 1.0), (0.8, 0.9)])
def test_sampling_entropies_are_the_tempered_distributions_and_change_no_draw(T, top_p):
    """The sampling step's entropies are those of softmax(logits / T) before top-p (greedy: softmax(logits)); a
    token of logit -inf adds nothing; asking for them draws the same tokens and log-probs from the same seed (the
    fused step's too), and nothing is computed when they are not asked for."""
    logits = 3 * torch.randn(64, 500, generator=torch.Generator().manual_seed(4))
    logits[:, 7] = float("-inf")
    params = SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1)
    fused = [False] + ([True] if COMPILER is not None and T in (1.0, 0.8) else [])  # one compile per path
    for f in fused:
        off = sample(logits, params, torch.Generator().manual_seed(0), fused=f)
        on = sample(logits, dataclasses.replace(params, entropy=True), torch.Generator().manual_seed(0), fused=f)
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]) and off[2] is None
        x = logits.double() / T if T > 0 else logits.double()
        want = -(x.softmax(-1) * x.log_softmax(-1)).nan_to_num().sum(-1)
        assert on[2].dtype == torch.float32 and torch.allclose(on[2].double(), want, atol=1e-4)


@pytest.mark.parametrize("decode", ["split", "ring"])
def test_entropies_match_a_plain_forward_at_every_token(decode, tok):
    """Entropies of generate (first tokens from the prefill logits, then decode steps) and of continuations, with
    adaptive rounds, under a budget small enough that rows are refilled in place and the batch rebuilt: at every
    token, the entropy of softmax(logits / T) that one plain forward pass over prompt + response gives."""
    m = _make("llama", len(tok))
    prompts = _prompts([5, 17, 2, 11, 9], seed=6)
    for params in (SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, entropy=True),
                   SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, entropy=True),
                   SamplingParams(temperature=0, max_new_tokens=10, entropy=True)):
        engine = Engine(m, tok, token_budget=90, decode=decode)
        out = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(1))
        for p, samples in zip(prompts, out):
            for s in samples:
                assert len(s.entropies) == len(s.token_ids)
                want = _tempered_entropies(m, p, s.token_ids, params.temperature)
                assert torch.allclose(torch.tensor(s.entropies, dtype=torch.float64), want, atol=1e-4)
        seqs = [p + r[0].token_ids for p, r in zip(prompts, out)]
        bounds = [sorted({len(p), min(len(q), len(p) + 3)}) for p, q in zip(prompts, seqs)]
        more = lambda i, j, drawn: 2 if (i + j) % 2 == 0 and len(drawn) < 4 else 0  # noqa: E731
        mc = engine.continuations(Request(seqs, bounds, 2, params, generator=torch.Generator().manual_seed(2),
                                          more=more))
        assert any(len(x) == 4 for per in mc for x in per)  # the rounds ran
        for q, bs, per in zip(seqs, bounds, mc):
            for b, samples in zip(bs, per):
                for s in samples:
                    want = _tempered_entropies(m, q[:b], s.token_ids, params.temperature)
                    assert torch.allclose(torch.tensor(s.entropies, dtype=torch.float64), want, atol=1e-4)


@pytest.mark.parametrize("decode", ["split", "ring"])
def test_entropies_change_no_sample(decode, tok, monkeypatch):
    """The recorded workload with entropies asked for in every job draws the recorded samples, and the same tokens,
    log-probs and finish reasons, to the bit, as without them; without them, Sample.entropies stays None."""
    run = Engine._run

    def workload(entropy: bool) -> list[Sample]:
        got = []

        def job(self, req):
            out = run(self, dataclasses.replace(req, params=dataclasses.replace(req.params, entropy=entropy)))
            got.extend(s for per in out for samples in per for s in samples)
            return out

        monkeypatch.setattr(Engine, "_run", job)
        tree, want = recorded_workload(tok, decode), json.loads(EXPECTED.read_text())
        assert {k: _strip(v) for k, v in tree.items()} == {k: _strip(v) for k, v in want.items()}
        return got

    plain, asked = workload(False), workload(True)
    assert len(plain) == len(asked) > 100
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in asked] == \
           [(s.token_ids, s.logprobs, s.finish_reason) for s in plain]
    assert all(s.entropies is None for s in plain)
    assert all(len(s.entropies) == len(s.token_ids) for s in asked)


def test_vllm_refuses_entropies_in_one_line():
    """vLLM gives no entropies: asking for them is a ValueError that names the native engine, before any work."""
    from vineppo.engine.vllm_backend import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the check comes before anything the engine holds
    with pytest.raises(ValueError, match="native engine"):
        engine.generate([[5, 6, 7]], 2, SamplingParams(entropy=True))
    with pytest.raises(ValueError, match="native engine"):
        engine.continuations(Request([[5, 6, 7]], [[2]], 2, SamplingParams(entropy=True)))


# ------------------------------------------------------------------ the prefix store and the paths around it


@pytest.mark.parametrize("kind", ["eager", "side-by-side"])
def test_models_outside_the_split_attention(kind, tok, monkeypatch):
    """An eager-attention model (the cache hands each row its prefix and own keys side by side), and decode steps
    with an attention setting the split path does not implement (it puts them side by side for transformers'
    SDPA; forced here by counting `scaling` among those settings) sample what Hugging Face's generate does, and
    their log-probs equal a fresh forward's."""
    m = _make("llama", len(tok))
    if kind == "eager":
        m.config._attn_implementation = "eager"
    else:
        monkeypatch.setattr("vineppo.engine.attention._UNSUPPORTED", ("scaling",))
    prompts = _prompts([5, 17, 2, 11])
    ref = _hf_greedy(m, prompts, 12)
    out = Engine(m, tok).generate(prompts, 2, SamplingParams(temperature=0, max_new_tokens=12))
    assert [r[0].token_ids for r in out] == ref and [r[1].token_ids for r in out] == ref
    seqs = [p + r[0].token_ids for p, r in zip(prompts, out)]
    bounds = [sorted({len(p), min(len(s), len(p) + 4)}) for p, s in zip(prompts, seqs)]
    mc = Engine(m, tok, token_budget=150).continuations(Request(seqs, bounds, 3, SamplingParams(temperature=1.0, max_new_tokens=6),
                                                        generator=torch.Generator().manual_seed(0)))
    _assert_fresh_logprobs(m, seqs, bounds, mc)
    if kind == "eager":
        assert m.config._attn_implementation == "eager"


def test_prefix_store_slots():
    """A slot per unit, holding the prefix once; slots are reused lowest first once their rows finish; the step
    view maps every (slot, copy) to its batch row and back, and masks each slot past its prefix."""
    from vineppo.engine.prefixes import Prefixes

    kv = [(torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2),) * 2]  # one layer, 2 rows, 6 columns
    store = Prefixes(p_max=6)
    a = store.add(kv, row=0, pad=1, length=4, copies=2)
    b = store.add(kv, row=1, pad=0, length=6, copies=3)
    assert (a, b) == (1, 2)  # slot 0 is the empty prefix of finished rows
    assert torch.equal(store.k[0][a, :, :4], kv[0][0][0, :, 1:5]) and torch.equal(store.k[0][b], kv[0][0][1])
    slot = torch.tensor([b, a, 0, b, a, b])  # row 2 has finished
    copy = torch.tensor([0, 0, 0, 1, 1, 2])
    view = store.view(slot, copy)
    assert (view.slots, view.width, view.copies) == (3, 6, 3)
    rows = view.rows.view(3, 3).tolist()
    assert rows[a] == [1, 4, 0] and rows[b] == [0, 3, 5] and rows[0] == [0, 0, 0]  # row 0 where none: unread
    assert all(rows[s][c] == r for r, (s, c) in enumerate(zip(slot.tolist(), copy.tolist())) if s)
    assert torch.isinf(view.mask[a, 0, 0, 4:]).all() and (view.mask[a, 0, 0, :4] == 0).all()
    assert torch.isinf(view.mask[0]).all() and (view.mask[b] == 0).all()
    store.release([a, a])
    assert store.refs[a] == 0 and store.length[a] == 0
    assert store.add(kv, row=1, pad=0, length=2, copies=1) == a  # the freed slot comes back first


def test_an_attention_that_bypasses_the_engine_is_refused(llama, tok, monkeypatch):
    """If the model's decode steps never reach the engine's attention (a model that calls its own), they would
    attend to the rows' own tokens only: the engine stops with an error instead of sampling from that."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vineppo.engine import attention

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, sdpa_attention_forward)
    with pytest.raises(NotImplementedError, match="attention interface"):
        Engine(llama, tok).generate(_prompts([5, 9]), 2, SamplingParams(temperature=0, max_new_tokens=4))
    assert llama.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------ the ring layout and CUDA graphs


def test_ring_rows_and_graph_buckets():
    """A job's ring holds the most rows the scheduler can admit; graph buckets pad a batch by at most 1.5x."""
    from vineppo.engine.graphs import bucket
    from vineppo.engine.ring import planned_rows

    sizes = [bucket(n, 10**6) for n in range(1, 200)]
    assert sizes[:9] == [1, 2, 3, 4, 6, 6, 8, 8, 12] and all(n <= b <= max(2, 1.5 * n) for n, b in enumerate(sizes, 1))
    assert len(set(sizes)) == 16 and bucket(700, 600) == 600  # few graphs; never more rows than the ring holds
    assert planned_rows([10, 30], copies=500, budget=1000, max_new=40) == 20  # budget // (shortest + max_new)
    assert planned_rows([10, 30], copies=7, budget=1000, max_new=40) == 7 and planned_rows([900], 5, 100, 40) == 1


def test_ring_prefixes_wrap_around_the_buffer(llama, tok):
    """A ring narrower than a job's steps: the write column wraps many times, prefixes are written across the
    buffer's end, and every continuation's log-probs still equal a fresh forward's."""
    from vineppo.engine import ring

    prompts = _prompts([5, 17, 2, 11, 9, 23], seed=4)
    seqs = [p + list(range(3, 3 + 12)) for p in prompts]
    bounds = [[len(p), len(p) + 5, len(s) - 1] for p, s in zip(prompts, seqs)]
    engine = Engine(llama, tok, token_budget=200, decode="ring")
    params = SamplingParams(temperature=1.0, max_new_tokens=9)
    mc = engine.continuations(Request(seqs, bounds, 3, params, generator=torch.Generator().manual_seed(2)))
    assert engine.runner.pool.width == ring.ALIGN  # 35 + 9 columns, rounded up: far fewer than the job's steps
    _assert_fresh_logprobs(llama, seqs, bounds, mc)
    engine.sleep()
    assert engine.runner.pool.k == [] and engine.runner.pool.rows == 0  # freed before an update


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_ring_step_reads_no_tensor_values_on_the_host(kind, tok):
    """A CUDA graph cannot capture a step that reads a tensor's values on the host (.item(), a Python if on a
    tensor, nonzero): the ring's decode step runs on meta tensors, where any such read fails."""
    from vineppo.engine.attention import packed_decode
    from vineppo.engine.ring import RingKV, RingPool
    from vineppo.engine.runner import ModelRunner

    m = _make(kind, len(tok)).to("meta")
    pool = RingPool(torch.device("meta"), graphs=False)
    H, D = m.config.num_key_value_heads if kind == "qwen2" else 4, 16
    pool.ensure(12, 64, [(torch.empty(1, H, 3, D, device="meta"),) * 2] * 2, [])
    with torch.inference_mode(), packed_decode(m):
        logits = RingKV(pool, 12, 40)._decode(ModelRunner(m, tok).forward, 8)  # the model call the step makes
    assert logits.shape == (8, len(tok)) and logits.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_eager_ring_steps(tok):
    """On a GPU, the graphs replay exactly the ring's eager steps (the same kernels): the same samples and log-probs;
    against the split layout, the same samples up to near-ties."""
    m = _make("qwen2", len(tok)).cuda()
    prompts = _prompts([5, 17, 2, 11, 9, 23, 30, 4], seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40)
    out = {}
    for decode in ("graphs", "ring", "split"):
        engine = Engine(m, tok, token_budget=300, decode=decode)
        for _ in range(2):  # the second job replays the graphs the first captured
            out[decode] = engine.generate(prompts, 5, params, generator=torch.Generator("cuda").manual_seed(3))
        if decode == "graphs":
            graphs = engine.runner.pool.graphs
            assert graphs.captured >= 2 and len(graphs.graphs) == graphs.captured
    flat = {d: [(s.token_ids, s.logprobs) for r in o for s in r] for d, o in out.items()}
    assert flat["graphs"] == flat["ring"]
    same = sum(a[0] == b[0] for a, b in zip(flat["graphs"], flat["split"]))
    assert same >= 0.9 * len(flat["split"])



def test_token_budget_on_a_cpu_and_the_bytes_of_a_token(llama):
    """The default budget is fixed on a CPU; on a GPU it divides free memory by a token's keys/values in all layers
    (here 2 layers x keys and values x 2 heads x 16 dims x 4 bytes)."""
    from vineppo.engine.budget import CPU_BUDGET, auto_token_budget, kv_bytes_per_token, update_reserve

    assert auto_token_budget(llama)[0] == CPU_BUDGET == 65536
    assert kv_bytes_per_token(llama) == 2 * 2 * 2 * 16 * 4
    assert update_reserve(llama) == 12 * sum(p.numel() for p in llama.parameters())


# ------------------------------------------------------------------ planning and admission, on their own


def test_plan_groups_sequences_by_length_and_queues_units_shortest_first():
    """Prefill groups hold rows x longest <= budget, sequences sorted by their last boundary; a unit's copies are
    split so rows x (prefix + max_new) fit; the queue pops the shortest prefix of the first group first."""
    from vineppo.engine.plan import Unit, plan_job, prefill_groups, split

    bounds = [[30], [5, 9], [12], [], [20, 25]]
    assert prefill_groups(bounds, budget=60, vocab=10) == [[1, 2], [4, 0]]  # 3 x 25 > 60: a new group
    assert prefill_groups(bounds, budget=50, vocab=10) == [[1, 2], [4], [0]]  # 2 x 30 > 50
    assert prefill_groups(bounds, budget=60, vocab=20000) == [[1], [2], [4], [0]]  # boundary logits bounded too
    assert [u.copies for u in split(Unit(0, 0, 0, 0, 10, 0, 7), budget=60, max_new=10)] == [3, 3, 1]
    plan = plan_job(bounds, k=2, budget=60, max_new=10, vocab=10)
    order = [(u.seq, u.length, u.copies) for u in reversed(plan.queue)]
    assert order == [(1, 5, 2), (1, 9, 2), (2, 12, 2), (4, 20, 2), (4, 25, 1), (4, 25, 1), (0, 30, 1), (0, 30, 1)]
    assert plan.unadmitted == {0: 3, 1: 5} and not plan.can_free(0)


def test_rounds_queue_more_samples_of_a_settled_prefix_and_free_its_group_at_the_end():
    from vineppo.engine.plan import plan_job

    plan = plan_job([[4]], k=2, budget=100, max_new=5, vocab=10, more=lambda i, j, drawn: 3 if len(drawn) == 2 else 0)
    drawn = [None, None]
    plan.queue.pop()
    plan.unadmitted[0] -= 1
    assert plan.finished(0, 0, drawn) is None  # one of two still running
    assert plan.finished(0, 0, drawn) is None and len(drawn) == 5  # settled: 3 more queued on the same group
    assert [(u.first, u.copies) for u in plan.queue] == [(2, 3)] and plan.unadmitted[0] == 1
    plan.queue.pop()
    plan.unadmitted[0] -= 1
    assert [plan.finished(0, 0, drawn) for _ in range(3)] == [None, None, 0]  # the last: its group's cache can go


def test_admission_refills_in_place_grows_only_by_a_margin_and_sheds_finished_rows():
    from vineppo.engine import schedule
    from vineppo.engine.plan import Unit

    batch = SimpleNamespace(N=0, L=0, dead=[])
    queue = [Unit(0, 0, 0, 0, 10, 0, 2) for _ in range(5)]
    assert len(schedule.admit(queue, batch, budget=100, max_new=10)) == 2  # rows x (10 + 10) <= 100: 4 rows
    batch = SimpleNamespace(N=4, L=12, dead=[])
    assert schedule.admit(queue, batch, budget=100, max_new=10) == []  # full: nothing finished, no room to grow
    batch.dead = [1, 3]
    admitted = schedule.admit(queue, batch, budget=100, max_new=10)
    assert len(admitted) == 1 and schedule.fits_in_place(batch, admitted, 100, 10)  # two finished places refilled
    assert not schedule.fits_in_place(batch, admitted * 2, 100, 10)  # more rows than finished places
    assert not schedule.fits_in_place(SimpleNamespace(N=4, L=20, dead=[0, 1]), admitted, 100, 10)  # over the budget
    assert schedule.should_shed(SimpleNamespace(N=4, dead=[0])) and not schedule.should_shed(SimpleNamespace(N=8, dead=[0]))
