"""Hand-computed advantages for every estimator, and the PPO loss on a tiny batch."""

import math

import pytest
import torch

from vineppo.credit import CreditContext, Episode, gae, get_estimator, normalise, step_advantages
from vineppo.engine import Sample, SamplingParams
from vineppo.tasks import Example, get_task
from vineppo.training.forward import pack
from vineppo.training.ppo import Surrogate, policy_loss, value_loss


def _ep(reward, n_tokens=4, group=0, steps=None):
    return Episode(prompt_ids=[1, 2], response_ids=list(range(10, 10 + n_tokens)), text="", reward=reward,
                   group=group, example=Example("e", "", "", "7"), steps=steps or [(0, n_tokens)])


def test_step_advantages_three_steps():
    # V(s0)=0.5, V(s1)=0.25, V(s2)=1.0, reward 1: A = [0.25-0.5, 1.0-0.25, 1-1.0]
    assert step_advantages([0.5, 0.25, 1.0], 1.0) == pytest.approx([-0.25, 0.75, 0.0])
    assert step_advantages([0.5, 0.25, 1.0], 0.0) == pytest.approx([-0.25, 0.75, -1.0])


RIGHT, WRONG = 7, 3  # continuation tokens that decode to "#### 7" and "#### 3"; response tokens (10..) decode to ""
PARAMS = SamplingParams(max_new_tokens=64)


class FakeEngine:
    """Continuations whose outcome is set per (sequence, boundary): a fraction of correct texts.

    It checks boundaries and budgets as the real engine does (strictly increasing, inside the sequence).
    """

    def __init__(self, wins):
        self.wins = wins  # wins[i][j] = number of the k continuations that end with the right answer
        self.calls = []

    def continuations(self, req):
        sequences, boundaries, k = req.sequences, req.boundaries, req.k
        self.calls.append((sequences, boundaries, k, req.budgets))
        for seq, bs in zip(sequences, boundaries):
            if any(b <= a for a, b in zip([0] + bs, bs)) or bs[-1] > len(seq):
                raise ValueError(f"boundaries must be increasing, >= 1 and <= len(sequence): {bs}")
        return [[[_sample([RIGHT if m < self.wins[i][j] else WRONG]) for m in range(k)]
                 for j in range(len(b))] for i, b in enumerate(boundaries)]


def ends_with_answer(examples, texts, token_ids):
    """A scorer (Task.score): 1 for a completion that ends with its example's answer."""
    return [float(t.endswith(ex.answer)) for ex, t in zip(examples, texts)]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join({RIGHT: "#### 7", WRONG: "#### 3"}.get(i, "") for i in ids)


def _sample(ids, reason="stop"):
    return Sample(ids, FakeTokenizer().decode(ids), [0.0] * len(ids), reason)


def _vine_ctx(engine, **kw):
    return CreditContext(rollouts=engine, tokenizer=FakeTokenizer(), score=ends_with_answer,
                         params=PARAMS, **kw)


def test_vine_three_step_response():
    ep = _ep(1.0, n_tokens=6, steps=[(0, 2), (2, 5), (5, 6)])
    engine = FakeEngine([[2, 1, 4]])  # K=4: V = 0.5, 0.25, 1.0
    credit = get_estimator("vine")([ep], _vine_ctx(engine, mc_k=4))
    assert engine.calls[0][1] == [[2, 4, 7]]  # prompt length 2 + step starts 0, 2, 5
    assert credit.advantages[0].tolist() == pytest.approx([-0.25, -0.25, 0.75, 0.75, 0.75, 0.0])
    assert credit.stats["mc/states"] == 3 and credit.stats["mc/continuations"] == 12


def test_vine_estimates_a_state_shared_by_responses_once():
    # Two responses to one prompt share the prompt state and their first step (tokens 10, 11); the third
    # differs after the prompt. Distinct prefixes: prompt, [10, 11] (shared), [10, 11, 12, 13], [20, 21].
    a = _ep(1.0, n_tokens=6, steps=[(0, 2), (2, 4), (4, 6)])
    b = _ep(0.0, n_tokens=4, steps=[(0, 2), (2, 4)])
    c = Episode([1, 2], [20, 21, 22], "", 0.0, 0, Example("e", "", "", "7"), [(0, 2), (2, 3)])
    engine = FakeEngine([[2, 1, 4], [0]])  # per called sequence (a, c); K=4: V(prompt)=0.5, V([10,11])=0.25, V(a's 3rd)=1, V([20,21])=0
    credit = get_estimator("vine")([a, b, c], _vine_ctx(engine, mc_k=4))
    assert engine.calls[0][1] == [[2, 4, 6], [4]]  # b runs nothing; c only its own second state
    assert credit.advantages[1].tolist() == pytest.approx([-0.25, -0.25, -0.25, -0.25])  # 0.25-0.5, 0-0.25
    assert credit.advantages[2].tolist() == pytest.approx([-0.5, -0.5, 0.0])
    assert credit.stats["mc/states"] == 4 and credit.stats["mc/states_shared"] == 7


def test_vine_state_cap_uses_reward_and_truncated_continuations_score_zero():
    ep = _ep(1.0, n_tokens=3, steps=[(0, 1), (1, 2), (2, 3)])

    class Truncating(FakeEngine):
        def continuations(self, req):
            out = super().continuations(req)
            return [[[Sample(s.token_ids, s.text, s.logprobs, "length") for s in st] for st in seq] for seq in out]

    adv = get_estimator("vine")([ep], _vine_ctx(Truncating([[2, 2]]), mc_k=2, mc_max_states=2)).advantages[0]
    # V = [0 (truncated), 0 (truncated), 1.0 (past the cap: the reward)] -> A = [0, 1, 0]
    assert adv.tolist() == pytest.approx([0.0, 1.0, 0.0])


def test_empty_steps_do_not_crash_vine():
    # Steps 1 and 3 are empty (a token spans them): steps 1 and 2 start at the same token, a state estimated once;
    # step 3 starts at the response's end, the finished response, whose value is its reward.
    ep = _ep(1.0, n_tokens=5, steps=[(0, 2), (2, 2), (2, 5), (5, 5)])
    engine = FakeEngine([[2, 1]])  # K=4: V(offset 0) = 0.5, V(offset 2) = 0.25
    credit = get_estimator("vine")([ep], _vine_ctx(engine, mc_k=4))
    assert engine.calls[0][1] == [[2, 4]]  # one state per distinct position, none at the end
    # values per step [0.5, 0.25, 0.25, 1.0] -> A = [-0.25, 0, 0.75, 0]; they sum to r - V(s0) over the tokens' steps
    assert credit.advantages[0].tolist() == pytest.approx([-0.25, -0.25, 0.75, 0.75, 0.75])
    assert credit.stats["mc/states"] == 2 and credit.stats["mc/continuations"] == 8


class BudgetEngine:
    """Every continuation writes the right answer in 4 tokens; with a smaller budget it is cut off ("length")."""

    def __init__(self):
        self.budgets = None

    def continuations(self, req):
        k = req.k
        self.budgets = req.budgets or [[req.params.max_new_tokens] * len(b) for b in req.boundaries]
        answer = [0, 0, 0, RIGHT]
        return [[[_sample(answer[:n], "stop" if n >= 4 else "length") for _ in range(k)] for n in per]
                for per in self.budgets]


def test_mc_continuations_get_only_the_remaining_budget():
    # A 10-token response sampled with max_new_tokens = 12: from offset 9 a continuation has 3 tokens left, too
    # few for the 4-token right answer, so that state is worth 0 (a continuation with 12 fresh tokens would win).
    ep = _ep(1.0, n_tokens=10, steps=[(0, 4), (4, 9), (9, 10)])
    engine = BudgetEngine()
    ctx = CreditContext(rollouts=engine, tokenizer=FakeTokenizer(), score=ends_with_answer,
                        params=SamplingParams(max_new_tokens=12), mc_k=2)
    adv = get_estimator("vine")([ep], ctx).advantages[0]
    # V = [1, 1, 0]: A = [0, -1, 1]
    assert adv.tolist() == pytest.approx([0.0] * 4 + [-1.0] * 5 + [1.0])
    assert engine.budgets == [[12, 8, 3]]  # max_new_tokens less the response tokens before each state


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

    c = get_estimator("gae")([_ep(1.0, n_tokens=3)], CreditContext(critic=FakeCritic(), gae_lambda=1.0))
    assert c.advantages[0].tolist() == pytest.approx([0.9, 0.5, 0.1])
    assert c.returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_policy_loss_matches_hand_computation():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]])
    old = torch.tensor([[math.log(0.25), math.log(0.9)]])  # ratio 2.0 (clipped to 1.2) and 1.0
    ref = torch.tensor([[math.log(0.4), math.log(0.8)]])
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = policy_loss(logp, old, ref, adv, mask, Surrogate(clip=0.2, kl_coef=0.1))
    k3 = lambda r, p: r / p - math.log(r / p) - 1  # noqa: E731  exp(ref-logp) - (ref-logp) - 1
    want = -(1.2 * 1.0) + 0.1 * k3(0.4, 0.5) + -(1.0 * -2.0) + 0.1 * k3(0.8, 0.9)  # summed: the caller divides
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert stats["clipped"] == 1.0
    # Negative advantage with ratio below 1 - clip: the clipped term is the minimum.
    loss2, _ = policy_loss(torch.tensor([[math.log(0.1)]]), torch.tensor([[math.log(0.5)]]), torch.tensor([[0.0]]),
                           torch.tensor([[-1.0]]), torch.tensor([[1.0]]), Surrogate(clip=0.2))
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


def test_scale_keeps_a_zero_a_zero_where_whitening_shifts_it():
    # most tokens 0 by construction (steps whose value did not change), the rest negative: mean < 0
    planted = [torch.tensor([0.0, 0.0, 0.0, -0.5]), torch.tensor([0.0, 0.0]), torch.tensor([-1.0, 0.0, 0.25])]
    scaled = normalise(planted, "scale")
    assert all(((a == 0) == (b == 0)).all() for a, b in zip(planted, scaled))  # a zero stays zero
    assert all((torch.sign(a) == torch.sign(b)).all() for a, b in zip(planted, scaled))  # no sign flips
    nonzero = torch.cat(scaled)[torch.cat(planted) != 0]
    assert nonzero.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)  # the non-zero ones at unit spread
    whitened = normalise(planted, "whiten")
    assert (torch.cat(whitened)[torch.cat(planted) == 0] > 0).all()  # whitening moves every zero up
    assert normalise(planted, "none") is planted
    one = normalise([torch.tensor([0.0, 2.0, 2.0])], "scale")  # no spread among the non-zero: left as it is
    assert one[0].tolist() == [0.0, 2.0, 2.0]


def test_whiten():
    out = normalise([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], "whiten")
    flat = torch.cat(out)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)


def _sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer: words carry a leading "▁" that decode turns into a space, except at the start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "▁The", "▁answer", "▁is", "▁####", "▁1", "▁000"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")


class ReplayEngine:
    """Every continuation from a boundary is the rest of the sequence itself: each state's value is the response's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def continuations(self, req):
        sequences, boundaries, k = req.sequences, req.boundaries, req.k

        def rest(seq, b):
            return Sample(seq[b:], self.tokenizer.decode(seq[b:], skip_special_tokens=True), [0.0] * (len(seq) - b),
                          "stop")
        return [[[rest(seq, b)] * k for b in bs] for seq, bs in zip(sequences, boundaries)]


def test_step_join_with_sentencepiece_tokenizer():
    from vineppo.analysis.values import Node, rollout_rewards
    from vineppo.core.grading import grade_gsm8k

    tok = _sentencepiece_tokenizer()
    prompt = tok("The", add_special_tokens=False)["input_ids"]
    response = tok("answer is #### 1 000", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text = tok.decode(response, skip_special_tokens=True)
    assert text == "answer is #### 1 000" and tok.decode(response[4:], skip_special_tokens=True) == "000"
    reward = grade_gsm8k(text, "1000")  # "1 000" is no number the grader reads: 0
    # A step boundary between "▁1" and "▁000": decode(prefix) + continuation text would read "#### 1000" (right).
    ep = Episode(prompt, response, text, reward, 0, Example("e", "", "", "1000"), steps=[(0, 4), (4, 6)])
    ctx = CreditContext(rollouts=ReplayEngine(tok), tokenizer=tok, score=get_task("arith").score, params=PARAMS, mc_k=2)
    credit = get_estimator("vine")([ep], ctx)
    assert credit.advantages[0].tolist() == [0.0] * len(response)  # every state replays the response: V = its reward
    node = Node(prompt + response, len(prompt) + 4, len(prompt), Example("e", "", "", "1000"))
    assert rollout_rewards(ReplayEngine(tok), tok, get_task("arith").score, [node], 2, PARAMS, None)[0] == [[reward, reward]]


def _qwen(vocab=300):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=vocab))


@pytest.mark.parametrize("share", [False, True])
def test_log_probs_in_chunks_of_positions_equal_the_whole_forward(share, monkeypatch):
    """Past LOGITS_BYTES of logits, token_logprobs runs the head on chunks of positions, recomputed in the backward
    pass: the same log-probs, entropies and gradients as the model's own forward (float32 rounding)."""
    from vineppo.training import forward as ppo

    model = _qwen()
    batch = pack([[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11]], [[20, 21, 22, 23, 24], [30, 31], [40, 41, 42]], 0,
                 share=share)
    runs = []
    for limit in (1 << 40, 1000):  # one piece; then 18 chunks
        monkeypatch.setattr(ppo, "LOGITS_BYTES", limit)
        assert ppo._chunks(model, batch) == (1 if limit > 1000 else 18)
        logp, entropy = ppo.token_logprobs(model, batch, 0.7)
        (logp * batch.mask).sum().backward()
        runs.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    (a, ea, ga), (b, eb, gb) = runs
    m = batch.mask.bool()
    assert torch.allclose(a[m], b[m], atol=1e-5) and torch.allclose(ea[m], eb[m], atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(ga, gb))


def test_a_model_whose_logits_are_not_its_head_of_the_last_state_is_not_chunked(monkeypatch):
    """Soft-capped or scaled logits (Gemma, Cohere, Granite) are not head(hidden): such a model keeps its own forward."""
    from vineppo.training import forward as ppo

    model = _qwen()
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: type(out := forward(*a, **k))(logits=out.logits * 0.5))
    monkeypatch.setattr(ppo, "LOGITS_BYTES", 1000)
    assert ppo._chunks(model, pack([[5, 6]], [[7, 8, 9]], 0)) == 1
    assert ppo._chunks(_qwen(), pack([[5, 6]], [[7, 8, 9]], 0)) > 1


def test_micro_batches_by_tokens_keep_a_prompts_responses_together_within_the_budget():
    """--micro-batch-tokens: micro-batches cut where rows x (longest prompt + longest response) would pass the
    budget, a prompt's responses side by side and by length; without it, fixed counts as before."""
    from vineppo.training.ppo import micro_batches

    prompts = [[1] * 4] * 3 + [[2] * 6] * 3
    responses = [[0] * n for n in (10, 2, 5, 3, 9, 4)]
    assert micro_batches(list(range(6)), prompts, 2) == [[0, 1], [2, 3], [4, 5]]
    batches = micro_batches(list(range(6)), prompts, 2, responses, tokens=30)
    assert batches == [[1, 2], [0], [3, 5], [4]]
    assert all(len(b) * (max(len(prompts[i]) for i in b) + max(len(responses[i]) for i in b)) <= 30 for b in batches)


# ------------------------------------------------------------------------------------ entropy states, signal


def test_entropy_states_are_the_first_and_the_least_sure_step_starts():
    from vineppo.credit import state_offsets

    steps = [(0, 3), (3, 6), (6, 9), (9, 12)]
    entropies = [0.1] * 12
    entropies[6], entropies[3], entropies[9] = 2.5, 0.7, 0.7  # a planted peak at the third step's first token
    assert state_offsets(steps, 12, "entropy:1", entropies) == [0, 6]  # the prompt's state is always one
    assert state_offsets(steps, 12, "entropy:2", entropies) == [0, 3, 6]  # a tie goes to the earlier start
    assert state_offsets(steps, 12, "entropy:9", entropies) == [0, 3, 6, 9]
    entropies[0] = 9.0  # the first start is there anyway, not chosen by its entropy
    assert state_offsets(steps, 12, "entropy:1", entropies) == [0, 6]
    with pytest.raises(ValueError, match="per-token entropies"):
        state_offsets(steps, 12, "entropy:1", None)


def test_vine_with_entropy_states_estimates_only_the_chosen_states():
    ep = _ep(1.0, n_tokens=7, steps=[(0, 2), (2, 5), (5, 7)])
    ep.entropies = [0.5, 0.5, 0.1, 0.1, 0.1, 3.0, 0.2]  # the step at offset 5 is the unsure one
    engine = FakeEngine([[9, 9]])
    ctx = CreditContext(rollouts=engine, tokenizer=FakeTokenizer(), score=ends_with_answer,
                        params=SamplingParams(max_new_tokens=50), mc_k=9, mc_states="entropy:1")
    credit = get_estimator("vine")([ep], ctx)
    assert engine.calls[0][1] == [[2, 7]]  # prompt length 2 + offsets 0 and 5: the offset-2 step is not a state
    assert credit.stats["mc/states"] == 2


def test_flat_groups_and_nonzero_tokens_count_the_missing_signal():
    from vineppo.credit import flat_groups, nonzero_tokens

    eps = [_ep(r, n_tokens=1, group=g) for g, r in ((0, 1.0), (0, 1.0), (1, 0.0), (1, 1.0), (2, 0.0), (2, 0.0))]
    assert flat_groups(eps) == (2, 3)  # a group of equal rewards, all right or all wrong, is zero-signal
    grpo = get_estimator("grpo")(eps, CreditContext())
    assert nonzero_tokens(grpo.advantages, eps)[::2] == (2, 6)  # only the mixed group's two responses move
    raw = [torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([0.0])]
    assert nonzero_tokens(raw, eps[:3], normalise(raw, "whiten")) == (1, 2, 3)  # whitening moves both zeros
    assert nonzero_tokens(raw, eps[:3], normalise(raw, "scale")) == (1, 0, 3)
