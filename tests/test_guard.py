"""bf16 training on weights that came from a float16 checkpoint, and the numerics check before a run's first update."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.models import parallel
from vineppo.training import guard
from vineppo.training.ppo import Learner, Rollouts, UpdateConfig
from vineppo.training.run import build_models


def _model(seed=0, float16_origin=False):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    return model.half().float() if float16_origin else model  # a checkpoint released in float16, loaded in float32


def _cfg(**flags):
    return configs.resolve(configs.load_preset("arith-tiny"), {"algo": "vineppo", "model": "unused", **flags})


def _bf16_images(model):
    return [p.detach().to(torch.bfloat16) for p in model.parameters()]


def test_a_first_small_step_moves_no_bf16_weight_a_whole_spacing():
    """Float16 values are bf16 ties one time in eight: after a step of ~lr autocast rounded them a whole bf16
    spacing (~25x the step) the gradient's way. Rounded once at build time, a step of 1e-7 moves no bf16 image
    of a weight of ordinary size."""
    models = build_models(_cfg(dtype="bfloat16", lr=1e-7, weight_decay=0.0), _model(float16_origin=True),
                          torch.device("cpu"))
    policy, opt = models.trained.policy, models.trained.optimizer
    before = _bf16_images(policy)
    torch.manual_seed(1)
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    moved = total = 0
    for p, b in zip(policy.parameters(), before):
        big = p.detach().abs() > 1e-3  # below that a bf16 spacing is close to the step itself
        moved += int(((p.detach().to(torch.bfloat16) != b) & big).sum())
        total += int(big.sum())
    assert moved / total < 1e-3, f"{moved / total:.2%} of the weights' bf16 images moved a whole spacing"


def test_rounding_leaves_float32_runs_and_the_forward_alone():
    model = _model(float16_origin=True)
    want = [p.detach().clone() for p in model.parameters()]
    policy = build_models(_cfg(dtype="float32"), model, torch.device("cpu")).trained.policy
    assert all(torch.equal(p, w) for p, w in zip(policy.parameters(), want))
    rounded = build_models(_cfg(dtype="bfloat16"), _model(float16_origin=True), torch.device("cpu")).trained.policy
    assert all(torch.equal(p.to(torch.bfloat16), w.to(torch.bfloat16))  # what autocast computes with is the same
               for p, w in zip(rounded.parameters(), want))


def _rollouts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 50, (5,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 50, (4 + i % 3,), generator=g).tolist() for i in range(n)]
    return Rollouts(prompts=prompts, responses=responses, advantages=[torch.ones(len(r)) for r in responses], pad_id=0)


def _learner(cfg, planted=False):
    models = build_models(cfg, _model(), torch.device("cpu"))
    if planted:  # a reference that is not the policy's weights (a random model's outputs are near uniform: sharpen)
        with torch.no_grad():
            models.reference.lm_head.weight.mul_(50)
    return Learner(policy=models.policy, reference=models.reference, optimizer=models.trained.optimizer)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_passes_on_agreeing_paths_and_runs_once_per_run(dtype):
    cfg = _cfg(dtype=dtype)
    nets = _learner(cfg)
    gaps = guard.check(nets, _rollouts(), configs.section(UpdateConfig, cfg))
    assert set(gaps) == ({"reference", "float32"} if dtype == "bfloat16" else {"reference"})
    assert max(gaps.values()) < guard.BOUND
    assert guard.check(nets, _rollouts(), configs.section(UpdateConfig, cfg)) == {}  # checked already


def test_a_planted_mismatched_reference_stops_the_run_with_one_line():
    cfg = _cfg(dtype="float32")
    nets = _learner(cfg, planted=True)
    with pytest.raises(UserError) as err:
        guard.check(nets, _rollouts(), configs.section(UpdateConfig, cfg))
    line = str(err.value)
    assert "\n" not in line and "reference" in line and "--dtype float32" in line and "cpu" in line


def test_after_a_step_or_a_resume_the_reference_is_not_compared():
    cfg = _cfg(dtype="float32")
    nets = _learner(cfg, planted=True)
    for p in nets.policy.parameters():
        p.grad = torch.zeros_like(p)
    nets.optimizer.step()  # the optimiser has state: the policy has moved away from its reference by design
    assert guard.check(nets, _rollouts(), configs.section(UpdateConfig, cfg)) == {}


def test_sampler_log_probs_that_disagree_stop_the_run():
    cfg = _cfg(dtype="float32")
    data = _rollouts()
    data.old_logprobs = [torch.full((len(r),), -0.01) for r in data.responses]  # not what the policy gives
    with pytest.raises(UserError, match="the sampler's"):
        guard.check(_learner(cfg), data, configs.section(UpdateConfig, cfg))


class _Bf16Fault(torch.nn.Module):
    """A policy whose bf16 path is broken: under autocast its logits are shuffled."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        out = self.model(**kw)
        if torch.is_autocast_enabled("cpu"):
            out.logits = out.logits.roll(1, dims=-1)
        return out


def test_a_broken_bf16_path_is_caught_against_float32():
    cfg = _cfg(dtype="bfloat16", kl_coef=0.0)
    models = build_models(cfg, _model(), torch.device("cpu"))
    nets = Learner(policy=_Bf16Fault(models.policy), reference=None, optimizer=models.trained.optimizer)
    with pytest.raises(UserError, match="float32's .* --dtype bfloat16 on cpu|--dtype bfloat16 on cpu and the float32"):
        guard.check(nets, _rollouts(), configs.section(UpdateConfig, cfg))


def test_dtype_auto_is_float32_on_a_cpu_and_an_explicit_choice_stands():
    assert parallel.pick_dtype("auto", torch.device("cpu")) == "float32"
    assert parallel.pick_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert parallel.pick_dtype("float32", torch.device("cuda")) == "float32"
