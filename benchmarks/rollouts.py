"""Benchmark of the rollout engine on the Monte Carlo workload of one VinePPO iteration (small scale).

    python benchmarks/rollouts.py [--json] [--model DIR|FILE.gguf|HUB_ID] [--engine native|vllm]
                                  [--naive-fraction 0.2] [--threads N] [--repeats 3] [--prompts 64] [--max-new-tokens N]
    python benchmarks/rollouts.py --shape qwen2.5-0.5b --device cuda [--decode graphs|split] [--token-budget N]
                                  [--fused-sampling]

With ``--shape``: random weights of a named shape on ``--device``, the generate and Monte Carlo workloads of
``benchmarks/shapes.py`` (its docstring says what is measured); the rest of this docstring is the CPU benchmark.

Workload: 64 prompts (`--prompts`), one response each (T=0.6, top-p 0.9), every step boundary of every
response (the prompt end and the start of each later line), K=9 continuations each, same sampling settings.
With ``--model``, the prompts are the `arith` task's in the model's prompt format (vineppo.models.prompts: the
recorded one, else chat when the tokenizer has a chat template, else plain), and up to 256 new tokens.

Reports
- native: the engine's throughput (generated tokens/s) on the whole continuation workload (median of --repeats);
- vllm (with ``--engine vllm``): the vLLM backend on the same workload (the same responses, sampled by the native
  engine, the same boundaries and K), after the native runs; vLLM is built once, warmed up with one short
  request, and its prefix cache is emptied before every timed run, as the native engine starts every job from
  nothing; vllm_over_native = vllm / native;
- naive: Hugging Face ``model.generate(do_sample=True, num_return_sequences=K)`` over left-padded batches
  of prefixes, every prefix re-encoded (a fraction of the prefixes, for time; tokens up to EOS count);
- limit: bare batched decode steps of the same model at the engine's mean batch size, attending on average to
  the workload's mean useful context (mean prefix + half the mean continuation; no padding), in a loop
  ``model(input_ids=next_token, cache=cache)`` with no sampling and no masks, with the engine's in-place KV
  buffer (HF's plain DynamicCache, which concatenates every step, is reported too); best of 3 short runs,
  median over --repeats, each run right after an engine run;
- speedup = native / naive, fraction_of_limit = native / limit.

Without ``--model``: a randomly initialised Llama (hidden 256, 4 layers, vocabulary 64), random 60-100
token prompts, random 40-80 token "responses" with a boundary every ~12 tokens, continuations of 60 new
tokens (a random model never emits EOS, so every continuation runs to the length limit).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import random
import statistics
import sys
import tempfile
import time

import torch
from common import NullTok, set_threads
from transformers.cache_utils import DynamicLayer

from vineppo.core.config import ENGINES
from vineppo.engine import Engine, Request, SamplingParams, make_engine
from vineppo.models.causal_lm import seeded_generator

K = 9
N_PROMPTS = 64




def random_setup(seed=0, n_prompts=N_PROMPTS, max_new=60):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    V = 64
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=688, vocab_size=V, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                      max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    rng = random.Random(seed)
    seqs, bounds = [], []
    for _ in range(n_prompts):
        p = [rng.randrange(2, V) for _ in range(rng.randint(60, 100))]
        r = [rng.randrange(2, V) for _ in range(rng.randint(40, 80))]
        b = [len(p)] + [len(p) + t for t in range(12, len(r) - 4, 12)]
        seqs.append(p + r)
        bounds.append(b)
    return model, None, seqs, bounds, SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=max_new), 1


def _token_boundary(tokenizer, ids, char_offset):
    """Smallest m with len(decode(ids[:m])) >= char_offset."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= char_offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def model_setup(path, seed=0, n_prompts=N_PROMPTS, max_new=256):
    from vineppo.models.causal_lm import load_model
    from vineppo.models.prompts import Prompter
    from vineppo.tasks import get_task

    model, tok = load_model(path, device="cpu", verbose=False)
    task = get_task("arith")
    prompter = Prompter(task, tok, model=path)
    prompts = [prompter.prompt(e) for e in task.load("train", None, seed)[:n_prompts]]
    split = task.split_steps
    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=max_new, stop=tuple(task.stop))
    eng = Engine(model, tok)
    g = seeded_generator(model, seed)
    resp = eng.generate(prompts, 1, params, generator=g)
    seqs, bounds = [], []
    for p, r in zip(prompts, resp):
        s = r[0]
        steps = split(s.text) or [s.text]
        offs, acc = [], 0
        for st in steps[:-1]:
            acc += len(st)
            offs.append(acc)
        b = [len(p)]
        for o in offs:
            t = len(p) + _token_boundary(tok, s.token_ids, o)
            if b[-1] < t < len(p) + len(s.token_ids):
                b.append(t)
        seqs.append(p + s.token_ids)
        bounds.append(b)
    return model, tok, seqs, bounds, params, 0




def run_vllm(eng, seqs, bounds, params, seed=0):
    """The vLLM backend on the workload, from an empty prefix cache (the engine is built once, outside)."""
    eng.llm.reset_prefix_cache()
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    out = eng.continuations(Request(seqs, bounds, K, params, generator=g))
    dt = time.perf_counter() - t0
    n_tok = sum(len(s.token_ids) for r in out for x in r for s in x)
    max_num_seqs = eng.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs  # vLLM's cap on its decode batch
    return n_tok / dt, dict(seconds=dt, tokens=n_tok, max_num_seqs=max_num_seqs)


def start_vllm(model, tok, folder, seqs, params):
    """The vLLM backend on ``folder``, warmed up by one short request (outside the timing)."""
    eng = make_engine("vllm", model, tok, model_dir=folder)
    eng.generate([seqs[0][:8]], 1, dataclasses.replace(params, max_new_tokens=4))
    return eng


def run_native(model, tok, seqs, bounds, params, seed=0):
    eng = Engine(model, tok or NullTok())
    rows = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] == 1 else None,
        with_kwargs=True)
    try:
        g = seeded_generator(model, seed)
        t0 = time.perf_counter()
        out = eng.continuations(Request(seqs, bounds, K, params, generator=g))
        dt = time.perf_counter() - t0
    finally:
        hook.remove()
    n_tok = sum(len(s.token_ids) for r in out for x in r for s in x)
    n_cont = sum(len(x) for r in out for x in r)
    return n_tok / dt, dict(seconds=dt, tokens=n_tok, continuations=n_cont, decode_steps=len(rows),
                            mean_rows=sum(rows) / max(1, len(rows)), max_rows=max(rows, default=0))


def run_naive(model, tok, seqs, bounds, params, batch_prefixes, fraction, eos_ids, seed=0):
    prefixes = [s[:b] for s, bs in zip(seqs, bounds) for b in bs]
    rng = random.Random(seed)
    rng.shuffle(prefixes)
    prefixes = prefixes[: max(batch_prefixes, int(len(prefixes) * fraction))]
    pad = 0 if tok is None or tok.pad_token_id is None else tok.pad_token_id
    torch.manual_seed(seed)
    n_tok = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prefixes), batch_prefixes):
            batch = prefixes[i : i + batch_prefixes]
            P = max(map(len, batch))
            ids = torch.full((len(batch), P), pad, dtype=torch.long)
            am = torch.zeros_like(ids)
            for r, p in enumerate(batch):
                ids[r, P - len(p):] = torch.tensor(p)
                am[r, P - len(p):] = 1
            kw = dict(stop_strings=list(params.stop), tokenizer=tok) if (params.stop and tok is not None) else {}
            out = model.generate(ids, attention_mask=am, do_sample=True, temperature=params.temperature,
                                 top_p=params.top_p, top_k=0, num_return_sequences=K,
                                 max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                                 eos_token_id=eos_ids or None, **kw)[:, P:]
            for row in out.tolist():
                n_tok += next((t + 1 for t, x in enumerate(row) if x in eos_ids), len(row))
    dt = time.perf_counter() - t0
    return n_tok / dt, dict(seconds=dt, tokens=n_tok, prefixes=len(prefixes))


def run_limit(model, rows, ctx_len, steps=30, buffered=True, repeats=3):
    """Bare decode steps (best of ``repeats``); buffered=True uses the engine's in-place KV buffer, False HF's
    concatenating cache."""
    return max(_limit_once(model, rows, ctx_len, steps, buffered) for _ in range(repeats))


def _limit_once(model, rows, ctx_len, steps, buffered):
    from transformers import DynamicCache

    sig = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    V = model.get_output_embeddings().weight.shape[0]
    dev = next(model.parameters()).device
    warm = 3
    start = max(1, ctx_len - warm - steps // 2)  # the timed steps attend to ctx_len tokens on average
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.randint(2, V, (rows, start), device=dev), use_cache=True, **{sig: cache})
        if buffered:
            cache = _buffered(cache, steps + 8)
        nxt = torch.randint(2, V, (rows, 1), device=dev)
        for _ in range(warm):
            nxt = model(input_ids=nxt, use_cache=True, **{sig: cache}).logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = model(input_ids=nxt, use_cache=True, **{sig: cache}).logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
    return rows * steps / dt


class _InPlace(DynamicLayer):
    """A cache layer whose new columns are written in place into a preallocated buffer (no per-step concatenation)."""

    def __init__(self, keys, values, extra):
        super().__init__()
        N, H, L, D = keys.shape
        self.kb, self.vb, self.n = keys.new_zeros(N, H, L + extra, D), values.new_zeros(N, H, L + extra, D), L
        self.kb[:, :, :L], self.vb[:, :, :L] = keys, values
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = self.kb[:, :, :L], self.vb[:, :, :L]

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        self.kb[:, :, self.n : self.n + m], self.vb[:, :, self.n : self.n + m] = key_states, value_states
        self.n += m
        self.keys, self.values = self.kb[:, :, : self.n], self.vb[:, :, : self.n]
        return self.keys, self.values


def _buffered(cache, extra):
    """``cache`` (a prefilled DynamicCache) as in-place layers with room for ``extra`` more columns."""
    cache.layers = [_InPlace(layer.keys, layer.values, extra) for layer in cache.layers]
    return cache


def _arguments(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", help="a model folder, .gguf file or hub id (default: tiny random Llama)")
    ap.add_argument("--prompts", type=int, default=N_PROMPTS, help="responses in the workload (fewer: a quicker run)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="response / continuation length cap (default: 256 with --model, 60 without)")
    ap.add_argument("--engine", choices=ENGINES, default="native",
                    help="vllm: also run the vLLM backend on the same workload (the vllm column; needs vLLM)")
    ap.add_argument("--naive-fraction", type=float, default=0.2, help="share of prefixes the naive baseline runs")
    ap.add_argument("--naive-batch", type=int, default=32, help="prefixes per naive generate() call (x K rows)")
    ap.add_argument("--repeats", type=int, default=3, help="engine and limit runs (alternating; medians reported)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: the machine's cores; use fewer when others share the machine)")
    ap.add_argument("--shape", help="random weights of a named shape: qwen2.5-0.5b, qwen2.5-1.5b, tiny (shapes.py)")
    ap.add_argument("--device", default="cpu", help="with --shape: cpu or cuda")
    ap.add_argument("--decode", default="auto", help="with --shape: the engine's decode path, auto|split|ring|graphs")
    ap.add_argument("--token-budget", type=int, default=0, help="with --shape: the engine's budget (0: auto)")
    ap.add_argument("--profile-tokens", type=int, default=64, help="with --shape on CUDA: new tokens of the profiled job")
    ap.add_argument("--scale", type=float, default=1.0, help="with --shape: workload size (< 1: a smoke run)")
    ap.add_argument("--fused-sampling", action="store_true", help="with --shape: the sampling step compiled (fused)")
    return ap.parse_args(argv)


def _vllm_column(args, model, tok, seqs, bounds, params) -> dict:
    """The vLLM backend's runs on the workload (--repeats of them, median reported)."""
    with tempfile.TemporaryDirectory() as scratch:  # vLLM loads a model from a folder: the random one goes here
        if not args.model:
            model.save_pretrained(scratch)
        eng = start_vllm(model, tok, args.model or scratch, seqs, params)
        runs = [run_vllm(eng, seqs, bounds, params) for _ in range(args.repeats)]
    speeds = [r[0] for r in runs]
    info = runs[-1][1]
    return {"vllm_tokens_per_s": statistics.median(speeds), "vllm_runs_tokens_per_s": speeds,
            "vllm_tokens": info["tokens"], "vllm_seconds": info["seconds"], "vllm_max_num_seqs": info["max_num_seqs"]}


def main(argv=None):
    args = _arguments(argv)
    threads = set_threads(args.threads)
    if args.shape:
        # imported here: engine_ab.py runs this file's workload against older revisions of the package, which lack
        # the engine modules shapes.py uses
        import shapes

        res = shapes.rollout_report(shapes.RolloutBench(args.shape, torch.device(args.device), args.decode, args.repeats,
                                                        args.token_budget, args.profile_tokens, args.scale,
                                                        args.fused_sampling))
        res["command"] = "python benchmarks/rollouts.py " + " ".join(sys.argv[1:] if argv is None else argv)
        if args.json:
            print(json.dumps(res))
            return
        print(res["budget_line"])
        for w in ("generate", "monte_carlo"):
            table = res[w].pop("profile_table", "")
            print(w, json.dumps(res[w]), table, sep="\n")
        return
    if args.model:
        model, tok, seqs, bounds, params, note = model_setup(args.model, n_prompts=args.prompts,
                                                             max_new=args.max_new_tokens or 256)
        eos_ids = Engine(model, tok).eos_token_ids  # every end-of-turn token, as the engine stops on
    else:
        model, tok, seqs, bounds, params, note = random_setup(n_prompts=args.prompts, max_new=args.max_new_tokens or 60)
        eos_ids = []
    n_bounds = sum(map(len, bounds))
    # engine and limit alternate, so both see the same (shared, noisy) machine; medians are reported
    natives, limits = [], []
    for rep in range(args.repeats):
        native, ninfo = run_native(model, tok, seqs, bounds, params)
        natives.append(native)
        if rep == 0:
            rows = int(round(ninfo["mean_rows"]))
            mean_prefix = sum(b for bs in bounds for b in bs) / n_bounds
            mean_cont = ninfo["tokens"] / max(1, ninfo["continuations"])
            ctx = int(mean_prefix + mean_cont / 2)
        limits.append(run_limit(model, rows, ctx))
    native, limit = statistics.median(natives), statistics.median(limits)
    naive, vinfo = run_naive(model, tok, seqs, bounds, params, args.naive_batch, args.naive_fraction, eos_ids)
    limit_hf = run_limit(model, rows, ctx, buffered=False)
    res = {
        "native_tokens_per_s": native,
        "naive_tokens_per_s": naive,
        "speedup": native / naive,
        "limit_tokens_per_s": limit,
        "fraction_of_limit": native / limit,
        "native_runs_tokens_per_s": natives,
        "limit_runs_tokens_per_s": limits,
        "limit_hf_dynamic_cache_tokens_per_s": limit_hf,
        "model": args.model or "random-llama-h256-l4",
        "threads": threads,
        "boundaries": n_bounds,
        "continuations": ninfo["continuations"],
        "native_tokens": ninfo["tokens"],
        "native_seconds": ninfo["seconds"],
        "mean_decode_rows": ninfo["mean_rows"],
        "naive_prefixes": vinfo["prefixes"],
        "naive_seconds": vinfo["seconds"],
        "limit_rows": rows,
        "limit_context": ctx,
        "random_model_never_emits_eos": bool(note),
    }
    if args.engine == "vllm":
        res.update(_vllm_column(args, model, tok, seqs, bounds, params))
        res["vllm_over_native"] = res["vllm_tokens_per_s"] / native
    if args.json:
        print(json.dumps(res))
        return
    _print(res, args, seqs, params, ninfo, vinfo, note)


def _print(res, args, seqs, params, ninfo, vinfo, note):
    print(f"model: {res['model']}  threads: {res['threads']}")
    if note:
        print("random model: it never emits EOS, so every continuation runs to max_new_tokens")
    print(f"workload: {len(seqs)} responses, {res['boundaries']} boundaries, K={K} -> {ninfo['continuations']} "
          f"continuations, {ninfo['tokens']} generated tokens (T={params.temperature}, top-p={params.top_p}, "
          f"max_new_tokens={params.max_new_tokens})")
    print(f"native engine : {res['native_tokens_per_s']:9.0f} tokens/s  (median of {args.repeats}; "
          f"{ninfo['seconds']:.1f} s, {ninfo['decode_steps']} decode steps, mean batch {ninfo['mean_rows']:.0f} rows)")
    if "vllm_tokens_per_s" in res:
        print(f"vLLM engine   : {res['vllm_tokens_per_s']:9.0f} tokens/s  (median of {args.repeats}; "
              f"{res['vllm_seconds']:.1f} s, {res['vllm_tokens']} tokens; {res['vllm_over_native']:.2f}x native)")
    print(f"naive HF      : {res['naive_tokens_per_s']:9.0f} tokens/s  ({vinfo['prefixes']} prefixes x {K}, "
          f"{vinfo['seconds']:.1f} s)")
    print(f"decode limit  : {res['limit_tokens_per_s']:9.0f} tokens/s  ({res['limit_rows']} rows, cache "
          f"~{res['limit_context']} tokens, in-place KV buffer; median of {args.repeats})")
    print(f"  (same loop with HF's concatenating DynamicCache: {res['limit_hf_dynamic_cache_tokens_per_s']:.0f} "
          f"tokens/s)")
    print(f"speedup {res['speedup']:.2f}x, fraction of limit {res['fraction_of_limit']:.2f}")


if __name__ == "__main__":
    main()
