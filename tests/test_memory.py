"""Memory knobs: the freed C heap handed back between iterations, the LM head on scored positions only, LoRA with
the reference as adapters-off, bf16 autocast and gradient checkpointing. FSDP2 and DDP are tested in
test_distributed.py."""

import ctypes
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from vineppo import cli
from vineppo.core import config as configs
from vineppo.models import parallel
from vineppo.models.prompts import saved_dtype, saved_format
from vineppo.training.forward import pack, token_logprobs
from vineppo.training.ppo import Learner, Rollouts, UpdateConfig, ppo_update
from vineppo.training.trainer import return_freed_memory, train

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(algo="grpo", prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=48, minibatch=8, micro_batch=4,
             eval_problems=0, save_every=1, tensorboard=False)
CFG = UpdateConfig(epochs=1, minibatch=4, micro_batch=2, clip=0.2, kl_coef=0.1, temperature=0.7, grad_clip=1.0,
                   value_clip=0.2)
PROMPTS, RESPONSES = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], [[11, 12], [13, 14, 15, 16, 17], [18]]


def _model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _cfg(model, out, **kw) -> configs.TrainConfig:
    return configs.resolve(configs.load_preset("arith-tiny"), {**SMALL, "model": str(model), "out": str(out), **kw})


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the LM head on scored positions only


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc: no malloc_trim to call")
def test_freed_heap_pages_go_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 3000  # 192 MiB in blocks under the mmap threshold: on the heap, as a CPU run's tensors
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:  # the last block pins the heap's top: glibc keeps the freed pages below it resident
        libc.free(b)
    before = _resident_bytes()
    assert return_freed_memory()
    assert before - _resident_bytes() > 100 * 2**20
    libc.free(blocks[-1])


def test_log_probs_are_those_of_each_sequence_alone_and_the_head_sees_only_response_positions():
    model, seen = _model(), []
    model.lm_head.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].shape[1]))
    b = pack(PROMPTS, RESPONSES, 0)
    logp, _ = token_logprobs(model, b, 0.7)
    assert seen == [max(map(len, RESPONSES))]  # not every position of prompt + response
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)] / 0.7
        want = F.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(logp[i, :len(r)], want, atol=1e-6)


# ------------------------------------------------------------------ shared prompts

GROUPED = [[1, 2, 3, 4, 5]] * 3 + [[6, 7]] * 2 + [[8, 9, 10]]  # 6 responses to 3 prompts
ANSWERS = [[11, 12], [13, 14, 15, 16, 17], [18], [19, 20, 21], [22], [23, 24]]


def _scored(model, share: bool) -> tuple:
    """Log-probs, entropies, gradients and embedded token count of one forward+backward over GROUPED/ANSWERS."""
    tokens = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: tokens.append(i[0].numel()))
    model.zero_grad()
    b = pack(GROUPED, ANSWERS, 0, share=share)
    logp, entropy = token_logprobs(model, b, 0.7)
    ((logp + 0.1 * entropy) * b.mask).sum().backward()
    hook.remove()
    return logp * b.mask, entropy * b.mask, {k: p.grad.clone() for k, p in model.named_parameters()}, sum(tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_shared_prompts_give_each_sequences_own_logprobs_and_gradients(arch):
    from vineppo.models.causal_lm import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, 50, 0, hidden=32, layers=2, heads=4, mlp=64)).train()
    lp, ent, grads, tokens = _scored(model, share=False)
    lp_s, ent_s, grads_s, tokens_s = _scored(model, share=True)
    assert torch.allclose(lp, lp_s, atol=1e-5) and torch.allclose(ent, ent_s, atol=1e-5)
    for k in grads:
        assert torch.allclose(grads[k], grads_s[k], atol=1e-5), k
    assert (tokens, tokens_s) == (6 * (5 + 5), 3 * 5 + 6 * 5)  # each prompt encoded once, not once per response


def test_prompts_are_not_shared_under_activation_checkpointing():
    from vineppo.training.forward import can_share

    model = _model()
    assert can_share(model)
    parallel.wrap(model, torch.device("cpu"), fsdp=False, checkpointing=True)  # it would drop the prompts' cache
    assert not can_share(model)


def test_an_update_with_shared_prompts_lands_where_the_plain_one_does(monkeypatch):
    from vineppo.training import ppo

    weights = []
    for share in (True, False):
        monkeypatch.setattr(ppo, "can_share", lambda model: share)
        policy, reference = _model(), _model().requires_grad_(False)
        advantages = [torch.linspace(-1, 1, len(r)) for r in ANSWERS]
        opt = torch.optim.SGD(policy.parameters(), lr=0.5)  # steps proportional to the gradients
        cfg = UpdateConfig(epochs=2, minibatch=4, micro_batch=2, clip=0.2, kl_coef=0.1, temperature=0.7,
                           grad_clip=1.0, value_clip=0.2)
        ppo_update(Learner(policy, reference, opt), Rollouts(GROUPED, ANSWERS, advantages, 0), cfg,
                   torch.Generator().manual_seed(0))
        weights.append(policy.state_dict())
    moved = max(float((weights[0][k] - w).abs().max()) for k, w in _model().state_dict().items())
    assert moved > 1e-3
    for k in weights[0]:
        assert torch.allclose(weights[0][k], weights[1][k], atol=1e-6), k


# ------------------------------------------------------------------ gradient checkpointing, bf16


def _grads(checkpointing: bool, dtype: str = "float32", calls: list | None = None) -> dict:
    model = _model()
    parallel.wrap(model, torch.device("cpu"), fsdp=False, checkpointing=checkpointing)
    model.model.layers[0].mlp.act_fn.register_forward_hook(lambda *_: calls.append(1) if calls is not None else None)
    model.train()
    b = pack(PROMPTS, RESPONSES, 0)
    with parallel.autocast(torch.device("cpu"), dtype):
        logp, _ = token_logprobs(model, b, 0.7)
    (logp * b.mask).sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients():
    once, twice = [], []
    plain, recomputed = _grads(False, calls=once), _grads(True, calls=twice)
    assert (len(once), len(twice)) == (1, 2)  # checkpointing did act: the layer ran again in the backward pass
    assert plain.keys() == recomputed.keys()
    for k in plain:
        assert torch.allclose(plain[k], recomputed[k], atol=1e-6), k


def test_bf16_autocast_keeps_float32_weights_and_gradients_close_to_float32():
    full, low = _grads(False), _grads(False, "bfloat16")
    for k in full:
        assert low[k].dtype == torch.float32  # master weights' gradients stay float32
        assert torch.allclose(full[k], low[k], atol=0.05 * full[k].abs().max().item() + 1e-4), k
    assert any(not torch.equal(full[k], low[k]) for k in full)  # the forward did run in bf16


def test_bf16_run_with_gradient_checkpointing_completes_with_finite_losses(tiny_sft, tmp_path):
    train(_cfg(tiny_sft, tmp_path / "run", iterations=2, dtype="bfloat16", gradient_checkpointing=True,
               algo="ppo"))
    rows = _rows(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss", "kl", "grad_norm", "value_loss"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r[key])
    assert rows[-1]["kl"] > 0  # the policy moved away from its (bf16) reference
    # Its checkpoint evaluates in the dtype it trained in: a bf16-trained model's float32 weights are not the model
    # its forward passes saw (SmolLM2's GRPO run scored 0.38 in float32 against 0.53 in bf16, in-run 0.525).
    ckpt = tmp_path / "run" / "checkpoints" / "iter-000002"
    assert saved_dtype(ckpt) == "bfloat16"
    done = subprocess.run([sys.executable, "-m", "vineppo", "eval", "--model", str(ckpt), "--task", "arith",
                           "--limit", "2", "--samples", "1", "--out", str(tmp_path / "eval.jsonl"), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch.bfloat16" in done.stderr


# ------------------------------------------------------------------ LoRA

needs_peft = pytest.mark.skipif(not configs.peft_installed(), reason="LoRA needs peft: pip install '.[lora]' (CI does)")


def _lora(model, r=4):
    from vineppo.models import lora

    return lora.add_adapters(model, r, 8.0, "all-linear")


@needs_peft
def test_the_engine_passes_a_lora_model_the_cache_under_its_current_name():
    import warnings

    from vineppo.engine import Engine, SamplingParams

    class Digits:  # the engine only decodes
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    engine = Engine(_lora(_model()), Digits())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # `past_key_values` is deprecated for `cache` in transformers 5.2x
        out = engine.generate([[1, 2, 3]], 2, SamplingParams(0.7, 1.0, 4), torch.Generator().manual_seed(0))
    assert [len(s.token_ids) for s in out[0]] == [4, 4]


@needs_peft
def test_lora_reference_is_the_base_model_exactly_and_only_adapters_train():
    from vineppo.models import lora

    base, policy = _model(), _lora(_model())
    before = {k: v.clone() for k, v in policy.named_parameters()}
    g = torch.Generator().manual_seed(0)
    advantages = [torch.randn(len(r), generator=g) for r in RESPONSES]
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    ppo_update(Learner(policy, lora.AdaptersOff(policy), opt), Rollouts(PROMPTS, RESPONSES, advantages, 0), CFG,
               torch.Generator())
    changed = {k for k, v in policy.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)  # only adapter weights moved
    assert all(not p.requires_grad for k, p in policy.named_parameters() if "lora_" not in k)
    b = pack(PROMPTS, RESPONSES, 0)
    with torch.no_grad():
        ref, _ = token_logprobs(lora.AdaptersOff(policy), b, 0.7)
        want, _ = token_logprobs(base, b, 0.7)
        adapted, _ = token_logprobs(policy, b, 0.7)
    assert torch.equal(ref, want)  # the reference is the base model, bit for bit
    assert not torch.allclose(adapted * b.mask, want * b.mask)  # the policy is not


@needs_peft
def test_lora_resume_is_bit_identical_and_the_merged_export_equals_the_adapted_model(tiny_sft, tmp_path):
    from peft import PeftModel

    lora_flags = dict(lora_r=4, lora_alpha=8.0, lora_targets="q_proj,v_proj,down_proj", lr=1e-3)
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(tiny_sft, full, iterations=3, **lora_flags))
    train(_cfg(tiny_sft, part, iterations=2, **lora_flags))
    train(configs.load(part / "config.yaml", {"iterations": 3}), resume=part)
    ckpt = full / "checkpoints" / "iter-000003"
    assert not (ckpt / "model.safetensors").exists()  # the checkpoint holds the adapters, not the model
    a = load_file(ckpt / "adapter_model.safetensors")
    b = load_file(part / "checkpoints" / "iter-000003" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    start = load_file(tiny_sft / "model.safetensors")
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k)  # they were trained

    out = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "vineppo", "export", str(full), "--out", str(out), "--json"], check=True,
                   capture_output=True, timeout=300)
    merged = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no peft
    assert saved_format(out) == saved_format(ckpt) is not None  # the prompt format the run trained in travels too
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_sft), str(ckpt))
    ids = torch.tensor([[3, 17, 5, 9, 12, 40, 7]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    assert any(not torch.equal(v, start[k]) for k, v in merged.state_dict().items() if k in start)


def test_lora_without_peft_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    from vineppo import cli

    monkeypatch.setattr(configs, "peft_installed", lambda: False)
    with pytest.raises(SystemExit):
        cli.main(["train", "--lora-r", "8", "--model", "/no/such/model", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vineppo train: error: --lora-r: needs peft (pip install 'vineppo[lo")


@pytest.mark.parametrize("flag", [["--lora-r", "8"], ["--fsdp", "true"]])
def test_vllm_engine_with_lora_or_fsdp_is_a_one_line_error(capsys, tmp_path, flag):
    with pytest.raises(SystemExit):
        cli.main(["train", "--engine", "vllm", *flag, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert "--engine vllm with --lora-r or --fsdp is not supported" in err and "\n" not in err
