"""Per-step credit at GRPO's price: the continuations that train (tree rollouts) and values from shared prefixes
(TEMPO), hand-computed, and what they leave unchanged."""

import dataclasses

import pytest
import torch
from test_credit import PARAMS, RIGHT, WRONG, FakeEngine, FakeTokenizer, _ep, _sample, _vine_ctx, ends_with_answer

import vineppo.training.algorithms as algorithms
from vineppo.core import config as configs
from vineppo.credit import CreditContext, Episode, State, get_estimator, leave_one_out, needs, trained_continuations
from vineppo.tasks import Example

EX = Example("e", "", "", "7")


def _resp(tokens, reward, group=0, steps=None):
    """A response to prompt [1, 2] with the given token ids and step ranges."""
    return Episode([1, 2], list(tokens), "", reward, group, EX, steps or [(0, len(tokens))])


# ------------------------------------------------------------------------------------ tree rollouts


def test_the_leave_one_out_baseline_is_each_reward_minus_the_mean_of_its_siblings():
    rewards = [1.0, 0.0, 0.0, 1.0]
    assert [leave_one_out(rewards, i) for i in range(4)] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert leave_one_out([1.0, None, 0.0], 0) == pytest.approx(1.0)  # a sibling without a reward is no baseline
    assert leave_one_out([1.0, None, 0.0], 1) is None and leave_one_out([1.0], 0) is None
    assert sum(leave_one_out(rewards, i) for i in range(4)) == pytest.approx(0.0)  # 0/1 rewards: they cancel


def test_a_continuation_trains_only_when_chosen_with_its_prefix_as_prompt():
    ep = _resp([10, 11, 12], 1.0, steps=[(0, 1), (1, 3)])
    state = State(0, 1, [_sample([RIGHT]), _sample([WRONG]), _sample([RIGHT]), _sample([WRONG], "length")],
                  [1.0, 0.0, 1.0, 0.0])
    extra, adv = trained_continuations([ep], [state], 0.5)  # the first round(0.5 x 4) = 2 continuations
    assert [e.response_ids for e in extra] == [[RIGHT], [WRONG]]
    assert all(e.prompt_ids == [1, 2, 10] for e in extra)  # the state's prefix: prompt + the first step
    assert [a.item() for a in adv] == pytest.approx([1 - 1 / 3, 0 - 2 / 3])  # siblings: (0, 1, 0), (1, 1, 0)
    assert trained_continuations([ep], [state], 0.0) == ([], [])
    extra, _ = trained_continuations([ep], [state], 1.0)
    assert len(extra) == 4 and extra[3].truncated and not extra[0].truncated


def test_vine_with_a_train_fraction_keeps_the_responses_advantages_and_adds_the_continuations():
    ep = _ep(1.0, n_tokens=6, steps=[(0, 2), (2, 5), (5, 6)])
    plain = get_estimator("vine")([ep], _vine_ctx(FakeEngine([[2, 1, 4]]), mc_k=4))
    tree = get_estimator("vine")([ep], _vine_ctx(FakeEngine([[2, 1, 4]]), mc_k=4, mc_train_fraction=1.0))
    assert plain.extra == [] and len(tree.extra) == 12  # 3 states x K = 4
    assert torch.equal(tree.advantages[0], plain.advantages[0])
    # state 1 (V = 0.25): its right continuation gets 1 - 0/3, each wrong one 0 - 1/3
    first = [float(a[0]) for e, a in zip(tree.extra, tree.advantages[1:]) if e.prompt_ids == [1, 2, 10, 11]]
    assert first == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert tree.stats["mc/trained"] == 12 and "mc/trained" not in plain.stats


class SleepyEngine(FakeEngine):
    logprobs_are_the_policys = False

    def sleep(self):
        pass


class PadTokenizer(FakeTokenizer):
    pad_token_id = 0


def test_the_update_trains_the_chosen_continuations_beside_the_episodes(monkeypatch):
    seen = []
    totals = dict(loss=0.0, clipped=0.0, clipped_high=0.0, entropy=0.0, tokens=1.0, grad_norm=0.0, steps=1.0,
                  logprob_gap=0.0, loss_weight=1.0)
    monkeypatch.setattr(algorithms, "ppo_update", lambda nets, data, cfg, gen: seen.append(data) or dict(totals))
    monkeypatch.setattr(algorithms.guard, "check", lambda nets, data, cfg: {})
    episodes = [_ep(1.0, n_tokens=4, steps=[(0, 2), (2, 4)]), _ep(0.0, n_tokens=4, group=1, steps=[(0, 4)])]

    def run(fraction: float) -> dict:
        cfg = configs.resolve({}, dict(algo="vineppo", mc_k=4, mc_train_fraction=fraction, kl_coef=0.0,
                                       samples_per_prompt=1))
        ctx = algorithms.Context(cfg=cfg, models=algorithms.Models(torch.nn.Linear(1, 1), None, None),
                                 tokenizer=PadTokenizer(), engine=SleepyEngine([[2, 3]]), params=PARAMS,
                                 score=ends_with_answer, generator=torch.Generator())
        return algorithms.ppo_family(list(episodes), ctx)

    assert run(0.0)["train/trained_episodes"] == 2 and len(seen[-1].responses) == 2
    # 2 distinct states (the prompt, shared by both; prompt + [10, 11]), 2 of their 4 continuations each
    assert run(0.5)["train/trained_episodes"] == 2 + 2 * 2
    data = seen[-1]
    assert data.prompts[2:] == [[1, 2], [1, 2], [1, 2, 10, 11], [1, 2, 10, 11]]
    assert data.responses[2:] == [[RIGHT], [RIGHT], [RIGHT], [RIGHT]]  # the first two of each state
    assert sorted(data.ids) == list(range(len(data.ids)))  # every trained item has its own minibatch id


# ------------------------------------------------------------------------------------ shared prefixes (TEMPO)


def test_a_planted_shared_prefix_gets_the_mean_reward_of_the_responses_through_it():
    # Three responses to one prompt; a and b share their first step [10, 11]; c goes its own way.
    a = _resp([10, 11, 12, 13], 1.0, steps=[(0, 2), (2, 4)])
    b = _resp([10, 11, 14, 15], 0.0, steps=[(0, 2), (2, 4)])
    c = _resp([20, 21, 22], 0.0, steps=[(0, 1), (1, 3)])
    credit = get_estimator("tempo")([a, b, c], CreditContext())
    root, shared = 1 / 3, 0.5  # V(prompt) = mean of all three; V(prompt + [10, 11]) = mean of a and b
    assert credit.advantages[0].tolist() == pytest.approx([shared - root] * 2 + [1 - shared] * 2)
    assert credit.advantages[1].tolist() == pytest.approx([shared - root] * 2 + [0 - shared] * 2)
    assert credit.advantages[2].tolist() == pytest.approx([0 - root] * 3)  # nothing shared past the prompt
    assert credit.stats["tempo/shared"] == pytest.approx(5 / 6)  # of the 6 states only c's second is not shared


def test_tempo_without_anything_shared_is_dr_grpo_and_needs_no_rollouts():
    eps = [_resp([10 + i], float(i % 2), steps=[(0, 1)]) for i in range(4)]
    credit = get_estimator("tempo")(eps, CreditContext())
    assert [float(a[0]) for a in credit.advantages] == pytest.approx([-0.5, 0.5, -0.5, 0.5])
    assert needs("tempo") == needs("grpo") and not needs("tempo").rollouts
    lonely = get_estimator("tempo")([_resp([10], 1.0)], CreditContext())  # a group of one: no value, no signal
    assert lonely.advantages[0].tolist() == [0.0]


def test_equal_prompts_in_two_groups_share_their_prefixes_and_other_prompts_do_not():
    a, b = _resp([10, 11], 1.0, group=0), _resp([10, 11], 0.0, group=1)  # the same prompt drawn twice
    c = dataclasses.replace(_resp([10, 11], 1.0, group=2), prompt_ids=[3, 4])
    credit = get_estimator("tempo")([a, b, c], CreditContext())
    assert credit.advantages[0].tolist() == pytest.approx([0.5, 0.5]) and credit.advantages[2].tolist() == [0, 0]
    # the same prompt text for another example (an environment's hidden secret, say) is another state
    d = dataclasses.replace(_resp([10, 11], 0.0, group=1), example=Example("other", "", "", "7"))
    credit = get_estimator("tempo")([a, d], CreditContext())
    assert credit.advantages[0].tolist() == [0, 0] and credit.advantages[1].tolist() == [0, 0]


# ------------------------------------------------------------------------------------ nothing else changes


def test_the_new_algorithms_resolve_and_the_old_ones_keep_their_settings():
    tree, tempo = configs.resolve({}, {"algo": "vineppo-tree"}), configs.resolve({}, {"algo": "tempo"})
    assert (tree.estimator, tree.mc_train_fraction, tempo.estimator) == ("vine", 1.0, "tempo")
    for algo in ("vineppo", "ppo", "grpo", "rloo", "dr-grpo", "grpo-trl"):
        assert configs.resolve({}, {"algo": algo}).mc_train_fraction == 0.0
    with pytest.raises(Exception, match="mc-train-fraction"):
        configs.resolve({}, {"algo": "grpo", "mc_train_fraction": 0.5})
    with pytest.raises(Exception, match="mc-k >= 2"):
        configs.resolve({}, {"algo": "vineppo-tree", "mc_k": 1})


def test_tempo_implies_the_deepest_shared_value_at_a_state_it_does_not_share():
    from vineppo.credit.tempo import implied_values

    a = _resp([10, 11, 12, 13], 1.0, steps=[(0, 2), (2, 4)])
    b = _resp([10, 11, 14, 15], 0.0, steps=[(0, 2), (2, 4)])
    c = _resp([20, 21, 22], 0.0, steps=[(0, 1), (1, 3)])
    got = implied_values([a, b, c], [2, 0, 1])
    assert got == [(pytest.approx(0.5), True), (pytest.approx(1 / 3), True), (pytest.approx(1 / 3), False)]
