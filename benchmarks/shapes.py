"""Benchmarks on random weights of a named model shape, on any device (nothing is downloaded).

    python benchmarks/rollouts.py --device cuda --shape qwen2.5-0.5b [--decode graphs|split] [--fused-sampling] [--json]
    python benchmarks/update.py --device cuda --shape qwen2.5-0.5b [--json]

Rollouts (``rollout_report``): the two workloads of the native engine, at T = 1, top-p 1 (a random model never emits
EOS, so every sample runs to its cap):
- generate: 64 prompts of 128 random tokens x 8 samples, 256 new tokens (131,072 tokens);
- Monte Carlo: 32 sequences of 328 tokens, 8 boundaries each (128, 153, ..., 303), K = 9, 128 new tokens
  (294,912 tokens).
Tokens/s is generated tokens over the job's wall-clock (prefill included), median of --repeats after one warm-up
job (which captures the CUDA graphs it needs; their count and seconds are reported apart). ``gpu_busy`` is the
union of the GPU kernels' intervals over the wall-clock of one profiled job (``--profile-tokens`` new tokens;
0: none).

Update (``update_report``): one PPO update as ``vineppo train --dtype bfloat16`` runs it (float32 weights and
AdamW state, bf16 autocast, the frozen reference in bf16): 64 prompts of 128 tokens x 8 responses of 96-160
tokens, random advantages, 2 epochs of minibatch 64, old and reference log-probs recomputed. Model FLOPs
utilisation: 6 N per token of each epoch's forward and backward passes (the tokens the passes run: each
distinct prompt once per micro-batch, every response token, no padding) over the update's wall-clock, against
the device's bf16 matrix rate measured in the same run (an 8192^3 product) and the datasheet's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time

import torch
from common import NullTok
from transformers import Qwen2Config, Qwen2ForCausalLM

from vineppo.core import config as configs
from vineppo.engine import Engine, Request, SamplingParams
from vineppo.engine.budget import auto_token_budget, kv_bytes_per_token
from vineppo.models.causal_lm import pretrained, seeded_generator
from vineppo.training import ppo
from vineppo.training.run import build_models

SHAPES = {  # Qwen2 configurations, as their config.json files give them
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),  # CPU smoke runs
}
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense, SXM parts


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A Qwen2 model of ``shape`` with random weights (seed 0), built on ``device``, in eval mode."""
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval()


@dataclasses.dataclass
class Workload:
    name: str
    seqs: list[list[int]]
    bounds: list[list[int]]
    k: int
    max_new: int


def workloads(vocab: int, scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """The generate and Monte Carlo workloads (``scale`` < 1: fewer sequences and new tokens, for a smoke run)."""
    rng = random.Random(seed)
    n = lambda x: max(1, int(x * scale))  # noqa: E731
    tokens = lambda m: [rng.randrange(2, vocab) for _ in range(m)]  # noqa: E731
    prompts = [tokens(128) for _ in range(n(64))]
    seqs = [tokens(328) for _ in range(n(32))]
    return [Workload("generate", prompts, [[128] for _ in prompts], 8, n(256)),
            Workload("monte_carlo", seqs, [[128 + 25 * j for j in range(8)] for _ in seqs], 9, n(128))]


def run_job(engine: Engine, w: Workload, max_new: int | None = None) -> tuple[int, float]:
    """One engine job of ``w``: (generated tokens, seconds)."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new or w.max_new)
    g = seeded_generator(engine.model, 0)
    sync(engine.model)
    t0 = time.perf_counter()
    out = engine.continuations(Request(w.seqs, w.bounds, w.k, params, generator=g))
    sync(engine.model)
    return sum(len(s.token_ids) for r in out for x in r for s in x), time.perf_counter() - t0


def sync(model: torch.nn.Module) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def gpu_busy(fn) -> dict:
    """Run ``fn`` under the profiler: the union of its GPU kernels' intervals over its wall-clock, kernel count,
    and the top kernels' table."""
    from torch.profiler import ProfilerActivity, profile  # the profiler, only for this measurement

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of intervals, in microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    averages = prof.key_averages()
    if not spans:  # a profiler that lists no device events: the per-operator device times, summed
        busy = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in averages)
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=25)
    except (AttributeError, KeyError, ValueError):
        table = averages.table(sort_by="self_cuda_time_total", row_limit=25)
    return dict(busy_fraction=busy / 1e6 / wall, busy_s=busy / 1e6, wall_s=wall, kernels=len(spans), table=table)


def matmul_tflops(device: torch.device) -> float:
    """The device's bf16 matrix rate: an 8192^3 product, mean of 10 after 3 warm-ups, random data."""
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0) / 1e12


@dataclasses.dataclass
class RolloutBench:
    """What ``rollout_report`` measures (rollouts.py's flags with --shape)."""

    shape: str  # a key of SHAPES
    device: torch.device
    decode: str = "auto"  # the engine's decode path: auto | split | ring | graphs
    repeats: int = 3  # timed jobs per workload, after a warm-up job
    token_budget: int = 0  # the engine's budget (0: from free memory)
    profile_tokens: int = 64  # new tokens of the profiled job on CUDA (0: no profile)
    scale: float = 1.0  # workload size (< 1: a smoke run)
    fused_sampling: bool = False  # the engine's sampling step compiled (Engine(fused_sampling=True))


def rollout_report(b: RolloutBench) -> dict:
    """Tokens/s of the engine on both workloads, the budget it used, captures, and (CUDA) the GPU's busy share."""
    device = b.device
    model = random_model(b.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    budget, line = (b.token_budget, f"token budget {b.token_budget:,} (given)") if b.token_budget \
        else auto_token_budget(model)
    engine = Engine(model, NullTok(), token_budget=budget, decode=b.decode, fused_sampling=b.fused_sampling)
    res = dict(shape=b.shape, device=device_name(device), decode=engine.runner.decode_mode, token_budget=budget,
               budget_line=line, fused_sampling=b.fused_sampling, kv_bytes_per_token=kv_bytes_per_token(model),
               versions=versions())
    for w in workloads(model.config.vocab_size, b.scale):
        first = run_job(engine, w)  # warm-up: captures the graphs this workload needs
        runs = [run_job(engine, w) for _ in range(b.repeats)]
        speeds = [t / s for t, s in runs]
        row = dict(tokens=runs[0][0], tokens_per_s=statistics.median(speeds), runs_tokens_per_s=speeds,
                   warmup_tokens_per_s=first[0] / first[1])
        res[w.name] = row
        pool = engine.runner.pool
        if pool is not None and pool.graphs is not None:
            row.update(graphs=len(pool.graphs.graphs), graphs_captured=pool.graphs.captured,
                       capture_s=pool.graphs.capture_s)
        if device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if not b.profile_tokens:
                continue
            try:
                prof = gpu_busy(lambda: run_job(engine, w, b.profile_tokens))
            except Exception as e:  # the throughput above stands without the profile
                row["profile_error"] = repr(e)
                continue
            row.update(profile_new_tokens=b.profile_tokens, gpu_busy=prof["busy_fraction"], gpu_kernel_s=prof["busy_s"],
                       profiled_wall_s=prof["wall_s"], kernels=prof["kernels"], profile_table=prof["table"])
    return res


def update_report(shape: str, device: torch.device, repeats: int, micro_batch: int, micro_batch_tokens: int,
                  scale: float = 1.0) -> dict:
    """One PPO update's seconds and model FLOPs utilisation on the ``shape`` model (see the module docstring)."""
    cfg = dataclasses.replace(configs.TrainConfig(), dtype="bfloat16" if device.type == "cuda" else "float32",
                              micro_batch=micro_batch, micro_batch_tokens=micro_batch_tokens, lr=1e-6, epochs=2,
                              minibatch=64)
    models = build_models(cfg, random_model(shape, device, torch.float32), device)
    learner = ppo.Learner(models.policy, models.reference, models.trained.optimizer)
    rng = random.Random(0)
    V = models.trained.policy.config.vocab_size
    n = max(2, int(64 * scale))
    prompts = [[rng.randrange(2, V) for _ in range(128)] for _ in range(n) for _ in range(8)]
    prompts = [prompts[8 * (i // 8)] for i in range(len(prompts))]  # 8 responses per prompt
    responses = [[rng.randrange(2, V) for _ in range(rng.randint(96, 160))] for _ in prompts]
    g = torch.Generator().manual_seed(0)
    data = ppo.Rollouts(prompts, responses, [torch.randn(len(r), generator=g) for r in responses], pad_id=0)
    ucfg = configs.section(ppo.UpdateConfig, cfg)
    N = sum(p.numel() for p in models.trained.policy.parameters())
    with counting([models.trained.policy, models.reference]) as passed:  # the warm-up counts the tokens passes run
        ppo.ppo_update(learner, data, ucfg, torch.Generator().manual_seed(0))
    seconds = []
    for rep in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(models.trained.policy)
        t0 = time.perf_counter()
        ppo.ppo_update(learner, data, ucfg, torch.Generator().manual_seed(rep + 1))
        sync(models.trained.policy)
        seconds.append(time.perf_counter() - t0)
    s = statistics.median(seconds)
    flops = 6 * N * passed["trained"]
    all_flops = flops + 2 * N * passed["frozen"]  # and the gradient-free passes (old and reference log-probs)
    res = dict(shape=shape, device=device_name(device), parameters=N, episodes=len(prompts),
               episode_tokens=sum(len(p) + len(r) for p, r in zip(prompts, responses)), epochs=cfg.epochs,
               trained_pass_tokens=passed["trained"], frozen_pass_tokens=passed["frozen"], micro_batch=micro_batch,
               micro_batch_tokens=micro_batch_tokens, dtype=cfg.dtype, seconds=s, runs_s=seconds,
               train_tflops=flops / s / 1e12, all_passes_tflops=all_flops / s / 1e12, versions=versions(),
               chunked_logprobs=bool(getattr(pretrained(models.trained.policy), "_vineppo_plain_head", False)))
    if device.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        peak = matmul_tflops(device)
        sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in res["device"]), None)
        res.update(matmul_tflops=peak, train_mfu_of_matmul=res["train_tflops"] / peak,
                   train_mfu_of_datasheet=res["train_tflops"] / sheet if sheet else None)
    return res


@contextlib.contextmanager
def counting(models: list[torch.nn.Module]):
    """Within the block, count the tokens (padding left out) the models' decoders run, with gradients ('trained')
    and without ('frozen')."""
    seen = {"trained": 0, "frozen": 0}

    def hook(module, args, kwargs):
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        n = ids.numel() if mask is None else int(mask[:, -ids.shape[1]:].sum())
        seen["trained" if torch.is_grad_enabled() else "frozen"] += n

    hooks = [pretrained(m).get_decoder().register_forward_pre_hook(hook, with_kwargs=True) for m in models]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def versions() -> dict:
    import transformers  # only for its version string

    return dict(torch=torch.__version__, transformers=transformers.__version__,
                cuda=torch.version.cuda if torch.cuda.is_available() else None)
