"""Hand-computed advantages for every estimator, and the PPO loss on a tiny batch."""

import math

import pytest
import torch

from vineppo.credit import CreditContext, Episode, gae, get_estimator, step_advantages
from vineppo.engine import Sample
from vineppo.ppo import pack, policy_loss, value_loss, whiten


def _ep(reward, n_tokens=4, group=0, steps=None):
    return Episode(prompt_ids=[1, 2], response_ids=list(range(10, 10 + n_tokens)), text="", reward=reward,
                   group=group, answer="7", steps=steps or [(0, n_tokens)])


def test_step_advantages_three_steps():
    # V(s0)=0.5, V(s1)=0.25, V(s2)=1.0, reward 1: A = [0.25-0.5, 1.0-0.25, 1-1.0]
    assert step_advantages([0.5, 0.25, 1.0], 1.0) == pytest.approx([-0.25, 0.75, 0.0])
    assert step_advantages([0.5, 0.25, 1.0], 0.0) == pytest.approx([-0.25, 0.75, -1.0])


class FakeEngine:
    """Continuations whose outcome is set per (sequence, boundary): a fraction of correct texts."""

    def __init__(self, wins):
        self.wins = wins  # wins[i][j] = number of the k continuations that end with the right answer
        self.calls = []

    def continuations(self, sequences, boundaries, k, params, generator=None, progress=None):
        self.calls.append((sequences, boundaries, k))
        return [[[Sample([0], "#### 7" if m < self.wins[i][j] else "#### 3", [0.0], "stop") for m in range(k)]
                 for j in range(len(b))] for i, b in enumerate(boundaries)]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_vine_three_step_response():
    ep = _ep(1.0, n_tokens=6, steps=[(0, 2), (2, 5), (5, 6)])
    engine = FakeEngine([[2, 1, 4]])  # K=4: V = 0.5, 0.25, 1.0
    ctx = CreditContext(engine=engine, tokenizer=FakeTokenizer(), grade=lambda t, a: float(t.endswith(a)), mc_k=4)
    credit = get_estimator("vine")([ep], ctx)
    assert engine.calls[0][1] == [[2, 4, 7]]  # prompt length 2 + step starts 0, 2, 5
    assert credit.advantages[0].tolist() == pytest.approx([-0.25, -0.25, 0.75, 0.75, 0.75, 0.0])
    assert credit.stats["mc/states"] == 3 and credit.stats["mc/continuations"] == 12


def test_vine_state_cap_uses_reward_and_truncated_continuations_score_zero():
    ep = _ep(1.0, n_tokens=3, steps=[(0, 1), (1, 2), (2, 3)])

    class Truncating(FakeEngine):
        def continuations(self, sequences, boundaries, k, params, generator=None, progress=None):
            out = super().continuations(sequences, boundaries, k, params)
            return [[[Sample(s.token_ids, s.text, s.logprobs, "length") for s in st] for st in seq] for seq in out]

    ctx = CreditContext(engine=Truncating([[2, 2]]), tokenizer=FakeTokenizer(),
                        grade=lambda t, a: float(t.endswith(a)), mc_k=2, mc_max_states=2)
    adv = get_estimator("vine")([ep], ctx).advantages[0]
    # V = [0 (truncated), 0 (truncated), 1.0 (past the cap: the reward)] -> A = [0, 1, 0]
    assert adv.tolist() == pytest.approx([0.0, 1.0, 0.0])


def test_grpo_and_rloo_on_a_known_group():
    eps = [_ep(r, group=0) for r in (1.0, 0.0, 0.0, 1.0)] + [_ep(r, group=1) for r in (1.0, 1.0)]
    g = get_estimator("grpo")(eps, CreditContext())
    std = torch.tensor([1.0, 0, 0, 1]).std().item()  # unbiased: 0.5774
    assert g.advantages[0][0].item() == pytest.approx(0.5 / std, rel=1e-4)
    assert g.advantages[1][0].item() == pytest.approx(-0.5 / std, rel=1e-4)
    assert g.advantages[4].tolist() == pytest.approx([0.0] * 4)  # all correct: nothing to learn
    r = get_estimator("rloo")(eps, CreditContext())
    assert r.advantages[0][0].item() == pytest.approx(1 - 1 / 3)
    assert r.advantages[1][0].item() == pytest.approx(0 - 2 / 3)
    assert r.advantages[5].tolist() == pytest.approx([0.0] * 4)


def test_gae_lambda_one_and_zero():
    v = torch.tensor([0.2, 0.4, 0.7])
    rewards = torch.tensor([0.0, 0.0, 1.0])
    assert gae(v, rewards, 1.0, 1.0).tolist() == pytest.approx([0.8, 0.6, 0.3])  # R - V_t
    assert gae(v, rewards, 1.0, 0.0).tolist() == pytest.approx([0.2, 0.3, 0.3])  # one-step TD errors
    assert gae(v, rewards, 0.5, 0.5).tolist() == pytest.approx([0.0 + 0.5 * 0.4 - 0.2 + 0.25 * (0.35 - 0.4 + 0.25 * 0.3),
                                                              0.35 - 0.4 + 0.25 * 0.3, 0.3])


def test_gae_estimator_uses_critic_values():
    class FakeCritic:
        def values(self, prompts, responses):
            return [torch.tensor([0.1, 0.5, 0.9]) for _ in responses]

    c = get_estimator("gae")([_ep(1.0, n_tokens=3)], CreditContext(critic=FakeCritic(), lam=1.0))
    assert c.advantages[0].tolist() == pytest.approx([0.9, 0.5, 0.1])
    assert c.returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_policy_loss_matches_hand_computation():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]])
    old = torch.tensor([[math.log(0.25), math.log(0.9)]])  # ratio 2.0 (clipped to 1.2) and 1.0
    ref = torch.tensor([[math.log(0.4), math.log(0.8)]])
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = policy_loss(logp, old, ref, adv, mask, clip=0.2, kl_coef=0.1, n_tokens=2)
    k3 = lambda r, p: r / p - math.log(r / p) - 1  # noqa: E731  exp(ref-logp) - (ref-logp) - 1
    want = (-(1.2 * 1.0) + 0.1 * k3(0.4, 0.5) + -(1.0 * -2.0) + 0.1 * k3(0.8, 0.9)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert stats["clipped"] == 1.0
    # Negative advantage with ratio below 1 - clip: the clipped term is the minimum.
    loss2, _ = policy_loss(torch.tensor([[math.log(0.1)]]), torch.tensor([[math.log(0.5)]]), torch.tensor([[0.0]]),
                           torch.tensor([[-1.0]]), torch.tensor([[1.0]]), 0.2, 0.0, 1)
    assert loss2.item() == pytest.approx(0.8)


def test_value_loss_clips():
    v, old, ret = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]])
    # unclipped (1-2)^2 = 1; clipped V = 0.2 -> (0.2-2)^2 = 3.24; max -> 3.24 * 0.5
    assert value_loss(v, old, ret, torch.tensor([[1.0]]), 0.2, 1).item() == pytest.approx(1.62)


def test_pack_aligns_responses_and_their_advantages_at_one_column():
    b = pack([[1, 2, 3], [6]], [[4, 5], [7, 8, 9]], pad_id=0,
             advantages=[torch.tensor([0.5, -1.0]), torch.tensor([1.0, 2.0, 3.0])])
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 6, 7, 8, 9]]  # prompts left-, responses right-padded
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]  # counted from each row's first token
    assert b.mask.tolist() == [[1, 1, 0], [1, 1, 1]]  # one column per response token
    assert b.advantages.tolist() == [[0.5, -1.0, 0], [1.0, 2.0, 3.0]]
    assert b.scored().tolist() == [2, 3, 4]  # logits at positions 2..4 predict the response columns


def test_whiten():
    out = whiten([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    flat = torch.cat(out)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
