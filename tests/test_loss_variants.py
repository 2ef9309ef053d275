"""The baselines as the field runs them: --loss-agg, --scale-rewards, --clip-high, --mask-truncated,
--kl-estimator, no reference model at --kl-coef 0, and the grpo-trl / dr-grpo settings.

Every option is checked against a loss or advantages computed by hand on a few tokens, with values chosen so
that a loss missing one term, or with one weight wrong, fails."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.credit import REWARD_SCALES, CreditContext, Episode, get_estimator
from vineppo.tasks import Example
from vineppo.training import ppo
from vineppo.training.algorithms import needs_reference
from vineppo.training.ppo import Net, Schedule, chunks, drive
from vineppo.training.ppo import Learner, Rollouts, Surrogate, UpdateConfig, loss_weights, policy_loss, ppo_update
from vineppo.training.run import build_models
from vineppo.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")
L1, L2, L3 = math.log(0.5), math.log(0.25), math.log(0.8)


def _aggregated(loss_agg: str, token_losses: list[list[float]], max_new_tokens: int = 4,
                truncated: list[bool] | None = None) -> float:
    """The minibatch loss the update computes for per-token losses -advantage (ratio 1, no KL): policy_loss on the
    token weights of `loss_weights`, over the sum of the episode weights."""
    advantages = [torch.tensor([-x for x in row]) for row in token_losses]
    data = Rollouts([[1]] * len(token_losses), [[0] * len(r) for r in token_losses], advantages, 0,
                    truncated=truncated)
    weights, token_w = loss_weights(data, loss_agg, max_new_tokens, mask_truncated=truncated is not None)
    R = max(map(len, token_losses))
    w = torch.zeros(len(token_losses), R)
    adv = torch.zeros(len(token_losses), R)
    for i, row in enumerate(token_losses):
        w[i, : len(row)] = token_w[i]
        adv[i, : len(row)] = advantages[i]
    zeros = torch.zeros_like(w)
    summed, _ = policy_loss(zeros, zeros, None, adv, w, Surrogate())
    return summed.item() / max(sum(weights), 1.0)


# ------------------------------------------------------------------------------------ --loss-agg


LOSSES = [[1.0], [2.0, 4.0, 8.0]]  # two responses of 1 and 3 tokens, each token's loss distinct


@pytest.mark.parametrize("loss_agg,want", [
    ("token-mean", (1 + 2 + 4 + 8) / 4),  # DAPO: every token alike
    ("seq-mean-token-mean", (1 / 1 + (2 + 4 + 8) / 3) / 2),  # GRPO's original: each response's mean, averaged
    ("seq-mean-token-sum-norm", (1 / 4 + (2 + 4 + 8) / 4) / 2),  # Dr. GRPO: each response's sum / max_new_tokens 4
])
def test_each_loss_aggregation_by_hand(loss_agg, want):
    assert _aggregated(loss_agg, LOSSES) == pytest.approx(want, rel=1e-6)


def test_the_registries_are_the_configs_choices():
    assert tuple(ppo.LOSS_AGGS) == configs.LOSS_AGGS and tuple(ppo.KL_ESTIMATORS) == configs.KL_ESTIMATORS
    assert tuple(REWARD_SCALES) == configs.REWARD_SCALES


# ------------------------------------------------------------------------------------ --mask-truncated


@pytest.mark.parametrize("loss_agg,want", [
    ("token-mean", 1.0 / 1),  # the truncated response's 3 tokens leave numerator and denominator
    ("seq-mean-token-mean", 1.0 / 1),
    ("seq-mean-token-sum-norm", (1.0 / 4) / 1),
])
def test_mask_truncated_leaves_truncated_responses_out_of_the_loss(loss_agg, want):
    assert _aggregated(loss_agg, LOSSES, truncated=[False, True]) == pytest.approx(want, rel=1e-6)
    # off, a truncated response trains like any other
    assert _aggregated(loss_agg, LOSSES, truncated=None) == pytest.approx(_aggregated(loss_agg, LOSSES), rel=1e-6)


def test_a_minibatch_of_only_truncated_responses_gives_a_zero_loss_not_nan():
    assert _aggregated("token-mean", [[3.0, 1.0]], truncated=[True]) == 0.0


# ------------------------------------------------------------------------------------ --clip-high, --kl-estimator


def test_clip_high_widens_only_the_upper_clip():
    logp = torch.tensor([[math.log(0.75), math.log(0.1), math.log(0.55)]])
    old = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5)]])  # ratios 1.5, 0.2, 1.1
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.ones(1, 3)
    symmetric, s1 = policy_loss(logp, old, None, adv, mask, Surrogate(clip=0.2))
    higher, s2 = policy_loss(logp, old, None, adv, mask, Surrogate(clip=0.2, clip_high=0.28))
    # min(r A, clip(r) A): 1.5 -> 1.2 (symmetric) or 1.28 (clip-higher); 0.2 -> 0.8 either way; 1.1 is inside both
    assert symmetric.item() == pytest.approx(-(1.2 * 2.0 + 0.8 * -1.0 + 1.1 * 3.0), rel=1e-6)
    assert higher.item() == pytest.approx(-(1.28 * 2.0 + 0.8 * -1.0 + 1.1 * 3.0), rel=1e-6)
    assert (s1["clipped"], s1["clipped_high"]) == (2.0, 1.0)
    assert (s2["clipped"], s2["clipped_high"]) == (2.0, 1.0)  # 1.5 > 1.28 still counts as clipped


@pytest.mark.parametrize("estimator,kl", [
    ("k1", lambda p, r: math.log(p / r)),  # logp - ref
    ("k2", lambda p, r: 0.5 * math.log(p / r) ** 2),
    ("k3", lambda p, r: r / p - math.log(r / p) - 1),  # exp(ref - logp) - (ref - logp) - 1
])
def test_each_kl_estimator_by_hand(estimator, kl):
    p, r = (0.5, 0.2), (0.4, 0.6)  # policy and reference probabilities of two tokens (ratio 1: surrogate = A)
    logp, ref = torch.log(torch.tensor([p])), torch.log(torch.tensor([r]))
    adv = torch.tensor([[1.0, -3.0]])
    loss, stats = policy_loss(logp, logp.clone(), ref, adv, torch.ones(1, 2),
                              Surrogate(kl_coef=0.5, kl_estimator=estimator))
    want = -1.0 + 0.5 * kl(p[0], r[0]) + 3.0 + 0.5 * kl(p[1], r[1])
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert stats["kl"] == pytest.approx(kl(p[0], r[0]) + kl(p[1], r[1]), rel=1e-5)


def test_without_a_reference_the_loss_has_no_kl_term():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    loss, stats = policy_loss(logp, logp.clone(), None, torch.tensor([[1.0, -3.0]]), torch.ones(1, 2),
                              Surrogate(kl_coef=0.5))
    assert loss.item() == pytest.approx(2.0) and "kl" not in stats


# ------------------------------------------------------------------------------------ --scale-rewards


def _group_eps(rewards: list[list[float]]) -> list[Episode]:
    return [Episode([1], [5, 6], "", float(r), g, Example("e", "", "", "0"), [(0, 2)]) for g, rs in enumerate(rewards) for r in rs]


# Two groups: [1, 0, 0, 0] (mean 0.25, sample std 0.5) and [1, 1, 0, 0] (mean 0.5, std sqrt(1/3)); the batch of all
# eight: mean 0.375, sample std sqrt(1.875 / 7).
BATCH_STD = math.sqrt(1.875 / 7)


@pytest.mark.parametrize("scale,want", [
    ("group", [0.75 / 0.5, -0.25 / 0.5, 0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)]),
    ("batch", [0.75 / BATCH_STD, -0.25 / BATCH_STD, 0.5 / BATCH_STD, -0.5 / BATCH_STD]),
    ("none", [0.75, -0.25, 0.5, -0.5]),  # Dr. GRPO: the group-centred reward as it is
])
def test_each_reward_scale_by_hand(scale, want):
    credit = get_estimator("grpo")(_group_eps([[1, 0, 0, 0], [1, 1, 0, 0]]), CreditContext(scale_rewards=scale))
    got = [float(credit.advantages[i][0]) for i in (0, 1, 4, 6)]
    assert got == pytest.approx(want, rel=1e-5)
    assert all(a.tolist() == [a[0].item()] * 2 for a in credit.advantages)  # one advantage per response


# ------------------------------------------------------------------------------------ through the update


def _model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("loss_agg,mask,want", [
    ("token-mean", False, -(1 + 2 + 4 + 8 + 0.5 + 0.5) / 6),
    ("seq-mean-token-mean", False, -(1 + (2 + 4 + 8) / 3 + (0.5 + 0.5) / 2) / 3),
    ("seq-mean-token-sum-norm", False, -(1 / 5 + (2 + 4 + 8) / 5 + (0.5 + 0.5) / 5) / 3),
    ("token-mean", True, -(1 + 0.5 + 0.5) / 3),  # the second response was cut at the cap
    ("seq-mean-token-sum-norm", True, -(1 / 5 + 1 / 5) / 2),
])
def test_the_update_takes_the_aggregation_and_the_mask(loss_agg, mask, want):
    """One optimiser step on the whole batch at ratio 1 (the old log-probs are the policy's own) without a
    reference: the logged loss is minus the aggregated advantages, by hand."""
    advantages = [torch.tensor([1.0]), torch.tensor([2.0, 4.0, 8.0]), torch.tensor([0.5, 0.5])]
    data = Rollouts([[1, 2], [3], [4, 5]], [[6], [7, 8, 9], [10, 11]], advantages, 0, truncated=[False, True, False])
    cfg = UpdateConfig(epochs=1, minibatch=3, micro_batch=2, clip=0.2, kl_coef=0.0, temperature=1.0, grad_clip=1.0,
                       value_clip=0.2, loss_agg=loss_agg, max_new_tokens=5, mask_truncated=mask)
    policy = _model()
    stats = ppo_update(Learner(policy, None, torch.optim.SGD(policy.parameters(), lr=0.0)), data, cfg,
                       torch.Generator().manual_seed(0))
    assert stats["loss"] / stats["loss_weight"] == pytest.approx(want, rel=1e-5)
    assert "kl" not in stats and stats["clipped"] == 0


def test_the_critic_step_runs_alone_on_the_micro_batch_it_is_handed():
    """Each micro-batch is packed once and handed to both losses: the critic's steps are the same with the policy's
    loss beside them (which does not move the policy, at lr 0) as without it; neither reads the other's leftovers."""
    from transformers import LlamaConfig, LlamaModel

    from vineppo.training.forward import Critic
    from vineppo.training.ppo import Schedule, drive, micro_batches, ppo_losses

    def critic_after(alone: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        critic = Critic(LlamaModel(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2)), 8)
        torch.nn.init.normal_(critic.head.weight)
        policy = _model()
        data = Rollouts([[1, 2], [3], [4, 5]], [[6], [7, 8, 9], [10, 11]], [torch.ones(1), torch.ones(3), torch.ones(2)],
                        0, returns=[torch.ones(1), torch.zeros(3), torch.ones(2)],
                        old_values=[torch.zeros(1), torch.zeros(3), torch.zeros(2)])
        cfg = UpdateConfig(epochs=2, minibatch=2, micro_batch=1, clip=0.2, kl_coef=0.0, temperature=1.0,
                           grad_clip=1.0, value_clip=0.2)
        nets = Learner(policy, None, torch.optim.SGD(policy.parameters(), lr=0.0), critic,
                       torch.optim.SGD(critic.parameters(), lr=0.5))
        steps, prepare, _ = ppo_losses(nets, data, cfg)
        schedule = Schedule(epochs=2, minibatch=2, grad_clip=1.0, generator=torch.Generator().manual_seed(0),
                            split=lambda mb: micro_batches(mb, data.prompts, 1), prepare=prepare)
        drive(steps[1:] if alone else steps, schedule, [0, 1, 2], [1.0, 3.0, 2.0])
        return {k: v.clone() for k, v in critic.state_dict().items()}

    alone, beside = critic_after(alone=True), critic_after(alone=False)
    assert all(torch.equal(alone[k], beside[k]) for k in alone)
    assert not torch.equal(alone["head.bias"], torch.zeros(1))  # the critic did learn


def test_the_critic_keeps_its_token_mean_whatever_the_policys_aggregation():
    """The driver divides each net's loss by its own weights: per-response for the policy, tokens for the critic."""
    seen: dict[str, list[float]] = {"policy": [], "critic": []}
    model = torch.nn.Linear(1, 1)

    def loss(name):
        def fn(idx, denominator):
            seen[name].append(denominator)
            return model.weight.sum() * 0, {}
        return fn

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    schedule = Schedule(epochs=1, minibatch=3, grad_clip=1.0, generator=torch.Generator().manual_seed(0),
                        split=lambda mb: chunks(mb, 2))
    drive([Net(model, opt, loss("policy")), Net(model, opt, loss("critic"), [1.0, 3.0, 2.0])], schedule, [0, 1, 2],
          [1.0, 1.0, 1.0])
    assert seen["policy"] == [3.0, 3.0] and seen["critic"] == [6.0, 6.0]


# ------------------------------------------------------------------------------------ no reference at KL 0


@pytest.mark.parametrize("flags,built", [
    ({"algo": "vineppo"}, True),  # the presets' kl_coef 1e-4
    ({"algo": "grpo", "kl_coef": 0.0}, False),
    ({"algo": "grpo-trl"}, False),
    ({"algo": "dr-grpo"}, False),
    ({"algo": "restem", "kl_coef": 0.0}, True),  # RestEM restarts from the SFT weights
    ({"algo": "dpo-positive", "kl_coef": 0.0}, True),  # DPO+ scores against it and samples from it
])
def test_a_reference_model_is_built_only_when_the_run_uses_it(flags, built):
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {**flags, "model": "unused"})
    assert needs_reference(cfg) == built
    models = build_models(cfg, _model(), torch.device("cpu"))
    assert (models.reference is not None) == built


# ------------------------------------------------------------------------------------ settings


def test_grpo_trl_and_dr_grpo_settings():
    trl = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "grpo-trl"})
    assert (trl.estimator, trl.loss_agg, trl.scale_rewards, trl.advantage_norm, trl.kl_coef, trl.clip,
            trl.clip_high, trl.mask_truncated) == ("grpo", "token-mean", "group", "none", 0.0, 0.2, None, False)
    dr = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "dr-grpo"})
    assert (dr.estimator, dr.loss_agg, dr.scale_rewards, dr.advantage_norm, dr.kl_coef) == (
        "grpo", "seq-mean-token-sum-norm", "none", "none", 0.0)
    # the budget stays the preset's: the same 16 x 8 samples, epochs, minibatch and learning rate as grpo
    grpo = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "grpo"})
    for c in (trl, dr):
        assert (c.prompts_per_iter, c.samples_per_prompt, c.epochs, c.minibatch, c.lr, c.temperature) == (
            grpo.prompts_per_iter, grpo.samples_per_prompt, grpo.epochs, grpo.minibatch, grpo.lr, grpo.temperature)


def test_the_new_settings_default_to_the_existing_update():
    cfg = configs.TrainConfig()
    assert (cfg.loss_agg, cfg.scale_rewards, cfg.clip_high, cfg.mask_truncated, cfg.kl_estimator) == (
        "token-mean", "group", None, False, "k3")


@pytest.mark.parametrize("flags,message", [
    ({"loss_agg": "seq-mean"}, "--loss-agg: must be one of token-mean, seq-mean-token-mean"),
    ({"kl_estimator": "k4"}, "--kl-estimator: must be one of k1, k2, k3"),
    ({"scale_rewards": "std"}, "--scale-rewards: must be one of group, batch, none"),
    ({"clip_high": -0.1}, "--clip-high: must be > 0"),
    ({"algo": "vineppo", "scale_rewards": "none"}, "--scale-rewards: divides GRPO's group-centred reward; vineppo"),
])
def test_bad_values_are_refused_naming_the_flag(flags, message):
    with pytest.raises(UserError, match=message):
        configs.resolve(configs.load_preset("arith-tiny"), flags)


@pytest.mark.parametrize("algo", ["grpo-trl", "dr-grpo"])
def test_two_iterations_without_a_reference(tiny_sft, tmp_path, algo):
    torch.set_num_threads(1)
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {
        "algo": algo, "model": str(tiny_sft), "out": str(tmp_path), "iterations": 2, "prompts_per_iter": 4,
        "samples_per_prompt": 4, "max_new_tokens": 64, "minibatch": 8, "micro_batch": 8, "eval_problems": 0,
        "save_every": 0, "tensorboard": False, "mask_truncated": True, "clip_high": 0.28})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        assert "kl" not in r and math.isfinite(r["loss"])  # no reference: no KL to log
        assert r["advantage/left_out"] == pytest.approx(r["train/truncated"])
        assert 0 <= r["clip_fraction/high"] <= r["clip_fraction"]
        assert math.isfinite(r["advantage/loss_mean"]) and r["advantage/loss_abs"] >= 0


def test_each_method_s_default_normalisation_is_the_regimes_study_s():
    # vineppo and grpo scale (whitening was not shown better); the PPO-family methods the study did not compare
    # keep the paper's whitening; dr-grpo and grpo-trl none
    base = configs.load_preset("arith-tiny")
    norms = {a: configs.resolve(base, {"algo": a}).advantage_norm for a in configs.ALGOS
             if configs.ALGOS[a].update == "ppo"}
    assert norms == {"vineppo": "scale", "grpo": "scale", "vineppo-tree": "whiten", "tempo": "whiten",
                     "ppo": "whiten", "rloo": "whiten", "dr-grpo": "none", "grpo-trl": "none"}
    assert configs.resolve(base, {"algo": "tempo", "advantage_norm": "scale"}).advantage_norm == "scale"  # a flag wins


def test_the_older_whiten_advantages_spelling_still_reads_at_every_level(tmp_path):
    base = configs.load_preset("arith-tiny")
    assert configs.resolve(base, {}).advantage_norm == "scale"
    assert configs.resolve(base, {"whiten_advantages": "true"}).advantage_norm == "whiten"
    assert configs.resolve(base, {"whiten_advantages": "false"}).advantage_norm == "none"
    # a flag of the older spelling overrides the algorithm's own setting, as --advantage-norm would
    assert configs.resolve(base, {"algo": "dr-grpo", "whiten_advantages": True}).advantage_norm == "whiten"
    assert configs.resolve({**base, "whiten_advantages": False}, {"advantage_norm": "scale"}).advantage_norm == "scale"
    old = tmp_path / "config.yaml"  # a run folder's config.yaml written before --advantage-norm existed
    old.write_text("algo: vineppo\nwhiten_advantages: false\n")
    assert configs.load(old).advantage_norm == "none"
    assert configs.validate(configs.TrainConfig(whiten_advantages=False)).advantage_norm == "none"
    with pytest.raises(UserError, match="--whiten-advantages says whiten but --advantage-norm says none"):
        configs.validate(configs.TrainConfig(whiten_advantages=True, advantage_norm="none"))
    with pytest.raises(UserError, match="--whiten-advantages says whiten but --advantage-norm says scale"):
        configs.resolve(base, {"whiten_advantages": True, "advantage_norm": "scale"})  # both given: neither wins
    with pytest.raises(UserError, match="--whiten-advantages says none but --advantage-norm says whiten"):
        configs.resolve(base, {"whiten_advantages": False, "advantage_norm": "whiten"})  # whiten is no longer unset
    with pytest.raises(UserError, match="--advantage-norm: must be one of whiten, scale, none"):
        configs.resolve(base, {"advantage_norm": "batch"})
