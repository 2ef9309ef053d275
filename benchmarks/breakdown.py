"""Where the rollout engine's time goes on the Monte Carlo workload of `benchmarks/rollouts.py`: a profile table.

    python benchmarks/breakdown.py [--json] [--model DIR|FILE.gguf|HUB_ID] [--prompts 64] [--max-new-tokens N]
                                   [--threads N]

The workload is rollouts.py's (the same setup functions). Two engine runs on it:
1. timed phases, no profiler: the wall-clock of each call the decode loop makes, summed over the job:
   model forward (decode steps), prefill, sampling, cache copies (``Batch.rebuild``/``fill``/``retire``/``step``:
   rows copied into the KV buffer, masks, per-row state), stop checks (``Finisher.check``), and the rest of the
   job (scheduling, Python between the calls);
2. torch.profiler over the same job: every operator's own CPU time inside the model's decode steps, put in
   attention (scaled_dot_product_attention and what it calls), linear layers (projections, MLP, LM head),
   KV writes (the in-place appends of ``OwnLayer.update``) and other model ops (norms, RoPE, activations,
   embedding, masks); what is left of the decode steps' time is Python and dispatch inside the model.
The second run's split of the decode steps is applied to the first run's decode seconds (the profiler slows
Python down, so its own wall-clock is not used).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict

from common import NullTok, set_threads
from rollouts import K, model_setup, random_setup
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AttentionInterface

from vineppo.engine import Engine, Request, attention
from vineppo.engine.batch import Batch
from vineppo.engine.runner import ModelRunner
from vineppo.engine.split import OwnLayer
from vineppo.engine.stops import Finisher
from vineppo.models.causal_lm import seeded_generator

PHASES = {  # phase -> (owner, method name)
    "decode forward": (ModelRunner, "decode"),
    "prefill": (ModelRunner, "prefill"),
    "cache copies (rebuild, fill, retire, step)": [(Batch, "rebuild"), (Batch, "fill"), (Batch, "retire"),
                                                   (Batch, "step")],
    "stop checks": (Finisher, "check"),
}
OP_CLASSES = [  # (category, substrings of an operator's or one of its ancestors' names), first match wins
    ("attention", ("decode_attention", "scaled_dot_product", "flash_attention")),
    ("linear layers", ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")),
    ("KV writes", ("kv_write",)),
]


@contextlib.contextmanager
def timed(totals: dict[str, float], label_ops: bool = False):
    """Within the block, every method of PHASES (and the sampler) adds its own wall-clock to totals[phase]; with
    ``label_ops``, each call also runs under a profiler label of its phase's name."""
    saved, stack = [], []  # stack: seconds of the timed calls nested in each open one (Finisher.check retires rows)

    def wrap(owner, name, phase):
        fn = getattr(owner, name)

        def inner(*a, **kw):
            stack.append(0.0)
            t0 = time.perf_counter()
            with record_function(phase) if label_ops else contextlib.nullcontext():
                out = fn(*a, **kw)
            dt = time.perf_counter() - t0
            totals[phase] += dt - stack.pop()  # own time: a nested call counts in its own phase
            if stack:
                stack[-1] += dt
            return out

        saved.append((owner, name, fn))
        setattr(owner, name, inner)

    for phase, targets in PHASES.items():
        for owner, name in targets if isinstance(targets, list) else [targets]:
            wrap(owner, name, phase)
    wrap(ModelRunner, "sample", "sampling")
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextlib.contextmanager
def labelled_kv_writes():
    """The in-place cache appends of the decode steps run under a 'kv_write' profiler label, the engine's decode
    attention under 'decode_attention'."""
    update = OwnLayer.update

    def inner(self, *a, **kw):
        with record_function("kv_write"):
            return update(self, *a, **kw)

    OwnLayer.update = inner
    attend = AttentionInterface._global_mapping[attention.NAME]

    def labelled_attention(*a, **kw):  # the engine's decode attention is matmuls: label it to tell it from the MLP's
        with record_function("decode_attention"):
            return attend(*a, **kw)

    AttentionInterface.register(attention.NAME, labelled_attention)
    try:
        yield
    finally:
        OwnLayer.update = update
        AttentionInterface.register(attention.NAME, attend)


def run(model, tok, seqs, bounds, params, totals, label_ops=False) -> tuple[float, int]:
    """One engine job on the workload under the phase timers; (seconds, generated tokens)."""
    eng = Engine(model, tok or NullTok())
    g = seeded_generator(model, 0)
    with timed(totals, label_ops):
        t0 = time.perf_counter()
        out = eng.continuations(Request(seqs, bounds, K, params, generator=g))
        dt = time.perf_counter() - t0
    return dt, sum(len(s.token_ids) for r in out for x in r for s in x)


def op_split(prof) -> dict[str, float]:
    """Own CPU seconds of the operators inside the decode steps, per category of OP_CLASSES (else 'other model
    ops'), and the decode steps' total seconds under the profiler ('total')."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        chain, p = [], ev
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        if "decode forward" not in chain:
            continue
        if ev.name == "decode forward":
            out["total"] += ev.cpu_time_total / 1e6
            continue
        if not ev.name.startswith("aten::"):
            continue  # labels and module scopes: their own time is Python, counted as the rest
        cat = next((c for c, keys in OP_CLASSES if any(k in n for n in chain for k in keys)), "other model ops")
        out[cat] += ev.self_cpu_time_total / 1e6
    return dict(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", help="a model folder, .gguf file or hub id (default: tiny random Llama)")
    ap.add_argument("--prompts", type=int, default=64, help="responses in the workload")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    if args.model:
        model, tok, seqs, bounds, params, _ = model_setup(args.model, n_prompts=args.prompts,
                                                          max_new=args.max_new_tokens or 256)
    else:
        model, tok, seqs, bounds, params, _ = random_setup(n_prompts=args.prompts, max_new=args.max_new_tokens or 60)
    run(model, tok, seqs, bounds, params, defaultdict(float))  # warm-up
    phases: dict[str, float] = defaultdict(float)
    seconds, tokens = run(model, tok, seqs, bounds, params, phases)
    with labelled_kv_writes(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run(model, tok, seqs, bounds, params, defaultdict(float), label_ops=True)
    split = op_split(prof)
    decode = phases["decode forward"]
    ops = {c: decode * split.get(c, 0.0) / split["total"] for c, _ in OP_CLASSES + [("other model ops", ())]}
    ops["Python and dispatch in the model"] = decode - sum(ops.values())
    rows = {f"decode: {c}": s for c, s in ops.items()}
    rows.update({p: s for p, s in phases.items() if p != "decode forward"})
    rows["the rest (scheduling, Python between calls)"] = seconds - sum(phases.values())
    res = {"model": args.model or "random-llama-h256-l4", "threads": threads, "seconds": seconds, "tokens": tokens,
           "tokens_per_s": tokens / seconds, "seconds_by_part": rows,
           "share_by_part": {k: v / seconds for k, v in rows.items()}}
    if args.json:
        print(json.dumps(res))
        return
    print(f"model: {res['model']}  threads: {threads}  {tokens} tokens in {seconds:.2f} s "
          f"({tokens / seconds:.0f} tokens/s)")
    print("| part | seconds | share |\n|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} | {v / seconds:.0%} |")


if __name__ == "__main__":
    main()
