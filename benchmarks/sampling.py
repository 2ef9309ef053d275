"""Benchmark of the engine's sampling step against the same draw through ``torch.multinomial``.

    python benchmarks/sampling.py [--device cpu|cuda] [--rows 64,512] [--vocab 151936] [--repeats 9] [--json]

Workload: random logits [rows, vocab], 4 x N(0, 1) (at T = 0.6 the nucleus of top-p 0.9 holds about 8 tokens, at
most a few dozen, as a trained model's mostly does), in the model's dtype (bfloat16 on CUDA, float32 on CPU), at T =
1 and top-p 1 (the GPU benchmark's settings: the whole vocabulary drawn), at T = 0.6, top-p 1, and at the training
default T = 0.6, top-p 0.9 (the draw from a top-k window). ``reference`` is the engine's step as it was with
``torch.multinomial`` (a float32 copy, the division by T, logsumexp, the probabilities, then multinomial, which
checks the whole tensor before its draw; at top-p < 1, multinomial drawing from the window); ``engine`` is
``vineppo.engine.sampling.sample``; ``fused`` is that step compiled (``fused=True``: the same race, another
rounding). All draw from generators with the same seed; the benchmark checks the engine's draws the same tokens and
log-probs as the reference (``same_samples``) and reports the share of tokens the fused step draws alike
(``fused_same_token_share``) and its largest log-prob difference on those (``fused_logprob_max_error``). Seconds per
call: the median of --repeats calls of each, alternating, after a warm-up of each; ``exponential``: the draw's
random numbers alone (what the steps at top-p 1 must spend). ``passes``: the operators over [rows, vocab] each eager
step runs (from the profiler, a 64-row call), and its host synchronisations (``aten::item``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from common import set_threads
from shapes import device_name, versions

from vineppo.engine import sampling
from vineppo.engine.api import SamplingParams
from vineppo.engine.sampling import sample


def reference(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """The step through torch.multinomial: at top-p 1 the probabilities in full, then multinomial; at top-p < 1 the
    engine's step with multinomial drawing from its top-k window."""
    if params.top_p < 1.0:
        engine_draw = sampling.draw
        sampling.draw = lambda probs, g: torch.multinomial(probs, 1, generator=g).view(-1)
        try:
            return sample(logits, params, generator)
        finally:
            sampling.draw = engine_draw
    x = logits.float() / params.temperature
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    tok = torch.multinomial((x - lse).exp(), 1, generator=generator).view(-1)
    return tok, (x.gather(1, tok.view(-1, 1)) - lse).view(-1)


def fused(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """The engine's step compiled (``Engine(fused_sampling=True)``)."""
    return sample(logits, params, generator, fused=True)


def exponential(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """The draw's random numbers alone: one Exp(1) variate per entry of a float32 [rows, vocab] tensor."""
    return torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, logits, params, device, seed: int) -> tuple[float, tuple]:
    g = torch.Generator(device=device).manual_seed(seed)
    sync_device(device)
    t0 = time.perf_counter()
    out = fn(logits, params, g)
    sync_device(device)
    return time.perf_counter() - t0, out


SETTINGS = ((1.0, 1.0), (0.6, 1.0), (0.6, 0.9))  # (T, top-p): the whole vocabulary drawn, and the training default
KERNELS = {"aten::_to_copy", "aten::div", "aten::div_", "aten::amax", "aten::sub", "aten::exp", "aten::exp_",
           "aten::sum", "aten::aminmax", "aten::exponential_", "aten::argmax"}  # operators that pass over a tensor


def passes(fn, logits, params, device) -> dict:
    """The passes of one call over [rows, vocab] tensors (operators in KERNELS, nested ones included), and its
    host synchronisations."""
    from torch.profiler import profile  # the profiler, only for this count

    with profile(record_shapes=True) as prof:
        fn(logits, params, torch.Generator(device=device).manual_seed(0))
    big = list(logits.shape)
    ops = [e.name.removeprefix("aten::") for e in prof.events()
           if e.name in KERNELS and any(list(s) == big for s in e.input_shapes if s)]
    syncs = sum(e.name == "aten::item" for e in prof.events())
    return {"ops": ops, "count": len(ops), "host_syncs": syncs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default="64,512", help="comma-separated row counts")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    threads = set_threads(args.threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res = {"command": "python benchmarks/sampling.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": device_name(device), "threads": threads, "dtype": str(dtype).split(".")[1],
           "vocab": args.vocab, "repeats": args.repeats, "versions": versions(), "rows": {}}
    for T, top_p in SETTINGS:
        params = SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1)
        key = f"T{T}" + (f"_p{top_p}" if top_p < 1 else "")
        small = torch.randn(64, args.vocab, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        res[f"passes_{key}"] = {"reference": passes(reference, small, params, device),
                               "engine": passes(sample, small, params, device)}
        fused(small, params, torch.Generator(device=device))  # compiled outside the profile
        for n in map(int, args.rows.split(",")):
            logits = (4 * torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n))).to(device, dtype)
            same, agree, lp_err = True, [], 0.0
            secs = {"reference": [], "engine": [], "fused": [], "exponential": []}
            for rep in range(args.repeats + 1):
                (a_s, a), (b_s, b), (f_s, f), (c_s, _) = (timed(fn, logits, params, device, rep)
                                                          for fn in (reference, sample, fused, exponential))
                same &= torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                agree.append((f[0] == a[0]).float().mean().item())
                lp_err = max(lp_err, (f[1] - a[1])[f[0] == a[0]].abs().max().item())
                if rep:  # the first of each is a warm-up (the fused step's compiles there)
                    for k, v in zip(secs, (a_s, b_s, f_s, c_s)):
                        secs[k].append(v)
            med = {k: statistics.median(v) for k, v in secs.items()}
            res["rows"][f"{n}_{key}"] = {"rows": n, "temperature": T, "top_p": top_p, "same_samples": same, "seconds": med,
                                        "speedup": med["reference"] / med["engine"],
                                        "fused_speedup": med["reference"] / med["fused"],
                                        "fused_same_token_share": statistics.mean(agree),
                                        "fused_logprob_max_error": lp_err, "runs_s": secs}
            print(f"{n} rows, T {T}, top-p {top_p}: reference {med['reference'] * 1e3:.1f} ms, engine {med['engine'] * 1e3:.1f} ms "
                  f"({med['reference'] / med['engine']:.2f}x, same samples: {same}), fused {med['fused'] * 1e3:.1f} ms "
                  f"({med['reference'] / med['fused']:.2f}x, same tokens {statistics.mean(agree):.4f})", file=sys.stderr)
    print(json.dumps(res) if args.json else json.dumps({k: v for k, v in res.items() if k != "versions"}, indent=1))


if __name__ == "__main__":
    main()
