"""Adaptive Monte Carlo (--mc-k-min, --mc-rule) and state selection (--mc-states): rules, rounds, segments."""

import gc
import weakref

import pytest
import torch
from test_credit import RIGHT, WRONG, FakeEngine, _sample, _vine_ctx
from test_engine import _make, char_tokenizer

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.credit import (Episode, get_estimator, next_round, segment_advantages, settled, state_offsets,
                            wilson_half_width)
from vineppo.engine import Engine, Request, SamplingParams
from vineppo.engine import job as job_module
from vineppo.tasks import Example

# ------------------------------------------------------------------------------------ the stopping rule


def test_wilson_half_width_by_hand():
    z = 1.96
    # p = 1 from 3 outcomes: z * sqrt(z^2 / 36) / (1 + z^2 / 3) = (z^2 / 6) / (1 + z^2 / 3)
    assert wilson_half_width(1.0, 3) == pytest.approx((z * z / 6) / (1 + z * z / 3))
    assert wilson_half_width(1.0, 3) == pytest.approx(0.28075, abs=1e-5)
    assert wilson_half_width(0.0, 9) == wilson_half_width(1.0, 9) < wilson_half_width(0.5, 9)


@pytest.mark.parametrize("wins, rule, expected", [
    ([1, 1, 1], "agree", 0),            # the first k_min agree: settled at 3
    ([0, 0, 0], "agree", 0),
    ([1, 0, 1], "agree", 6),            # they disagree: they never will agree again, so the rest of K at once
    ([1, 1], "agree", 1),               # short of k_min (not a round the estimator asks for): up to k_min
    ([1, 0, 1, 0, 1, 1, 1, 1, 1], "agree", 0),  # K reached
    ([1, 1, 1], "ci:0.2", 3),           # half-width 0.28 > 0.2: another round of k_min
    ([1] * 6, "ci:0.2", 0),             # half-width 0.195 <= 0.2
    ([1, 0] * 3, "ci:0.2", 3),          # 0.5 from 6 outcomes: wide
    ([1, 0] * 3 + [1, 1], "ci:0.2", 1), # the last round is cut to K
    ([1, 0] * 3 + [1, 1, 0], "ci:0.2", 0),
])
def test_next_round_on_fixed_outcome_sequences(wins, rule, expected):
    assert next_round([float(w) for w in wins], 9, 3, rule) == expected


def test_settled_needs_k_min_outcomes():
    assert not settled([1.0, 1.0], "agree", 3)
    assert settled([1.0, 1.0, 1.0], "agree", 3)
    assert not settled([1.0] * 5, "ci:0.2", 3) and settled([1.0] * 6, "ci:0.2", 3)


# ------------------------------------------------------------------------------------ the estimator's rounds


class RoundsEngine(FakeEngine):
    """FakeEngine with `more`: outcomes of (i, j) come from a fixed sequence, drawn round by round."""

    def __init__(self, outcomes):
        super().__init__(None)
        self.outcomes = outcomes  # outcomes[i][j]: the sequence of rewards its continuations will have

    def continuations(self, req):
        sequences, boundaries, k, budgets, more = req.sequences, req.boundaries, req.k, req.budgets, req.more
        self.calls.append((sequences, boundaries, k, budgets))
        draw = lambda i, j, n0, n: [_sample([RIGHT if w else WRONG]) for w in self.outcomes[i][j][n0:n0 + n]]
        out = [[draw(i, j, 0, k) for j in range(len(bs))] for i, bs in enumerate(boundaries)]
        while more is not None:
            asks = [(i, j, more(i, j, out[i][j])) for i, bs in enumerate(out) for j in range(len(bs))]
            asks = [a for a in asks if a[2] > 0]
            if not asks:
                break
            for i, j, m in asks:
                out[i][j] += draw(i, j, len(out[i][j]), m)
        return out


def _two_state_episode():
    return Episode(prompt_ids=[1, 2], response_ids=list(range(10, 16)), text="", reward=1.0, group=0, example=Example("e", "", "", "7"),
                   steps=[(0, 3), (3, 6)])


def test_settled_states_stop_and_uncertain_ones_get_the_rest_of_k():
    # state 0: the first 3 outcomes agree (wrong); state 3: they disagree, so it is sampled up to K = 9
    engine = RoundsEngine([[[0] * 9, [1, 0, 1, 1, 1, 0, 1, 1, 1]]])
    credit = get_estimator("vine")([_two_state_episode()], _vine_ctx(engine, mc_k=9, mc_k_min=3))
    assert engine.calls[0][2] == 3  # the first round is k_min per state
    assert credit.stats["mc/continuations"] == 3 + 9
    # V(s0) = 0 from 3 outcomes, V(s1) = 7/9 from 9: A = [7/9 - 0, 1 - 7/9] per segment of 3 tokens
    assert credit.advantages[0].tolist() == pytest.approx([7 / 9] * 3 + [2 / 9] * 3)


def test_fixed_k_when_k_min_is_zero_or_at_least_k():
    outcomes = [[[1, 0, 1, 1, 1, 0, 1, 1, 1]] * 2]
    for k_min in (0, 9, 12):
        engine = RoundsEngine(outcomes)
        credit = get_estimator("vine")([_two_state_episode()], _vine_ctx(engine, mc_k=9, mc_k_min=k_min))
        assert engine.calls[0][2] == 9 and credit.stats["mc/continuations"] == 18


# ------------------------------------------------------------------------------------ the native engine


@pytest.fixture(scope="module")
def engine():
    tok = char_tokenizer()
    return Engine(_make("llama", len(tok)), tok, token_budget=4096)


SEQS = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
BOUNDS = [[2, 5, 8], [3, 5]]
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)


def test_engine_more_that_never_asks_reproduces_the_fixed_job(engine):
    plain = engine.continuations(Request(SEQS, BOUNDS, 4, PARAMS, torch.Generator().manual_seed(3)))
    asked = []
    adaptive = engine.continuations(Request(SEQS, BOUNDS, 4, PARAMS, torch.Generator().manual_seed(3),
                                    more=lambda i, j, s: asked.append((i, j, len(s))) or 0))
    assert sorted(asked) == [(0, 0, 4), (0, 1, 4), (0, 2, 4), (1, 0, 4), (1, 1, 4)]  # once per prefix, all finished
    assert [[[s.token_ids for s in st] for st in seq] for seq in plain] == \
           [[[s.token_ids for s in st] for st in seq] for seq in adaptive]


def test_engine_rounds_go_only_to_the_prefixes_that_ask_and_reuse_the_prefill(engine, monkeypatch):
    prefills = []
    real = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a: prefills.append(a[0]) or real(*a))

    def more(i, j, samples):
        assert all(s is not None for s in samples)  # called only when every sample so far has finished
        return 2 if (i, j) == (0, 1) and len(samples) < 7 else 0  # rounds of 2 for one prefix, up to 7

    out = engine.continuations(Request(SEQS, BOUNDS, 3, PARAMS, torch.Generator().manual_seed(3), more=more))
    assert [[len(st) for st in seq] for seq in out] == [[3, 7, 3], [3, 3]]
    assert len(prefills) == 1  # one prefill group for both sequences, encoded once for all rounds
    for st in out[0][1]:
        assert 1 <= len(st.token_ids) <= PARAMS.max_new_tokens



def test_an_adaptive_job_is_freed_when_it_returns(engine, monkeypatch):
    jobs = []  # the job's caches (GBs in an evaluation of dialogues) must go with it, not wait for a full gc
    init = job_module.Job.__init__
    monkeypatch.setattr(job_module.Job, "__init__",
                        lambda self, *a, **k: jobs.append(weakref.ref(self)) or init(self, *a, **k))
    gc.disable()
    try:
        engine.continuations(Request(SEQS, BOUNDS, 2, PARAMS, torch.Generator().manual_seed(3), more=lambda *a: 0))
        assert len(jobs) == 1 and jobs[0]() is None
    finally:
        gc.enable()

# ------------------------------------------------------------------------------------ which states, segments

STEPS = [(0, 5), (5, 10), (10, 30), (30, 32)]


@pytest.mark.parametrize("mode, expected", [
    ("all", [0, 5, 10, 30]),
    ("every:2", [0, 10]),
    ("every:1", [0, 5, 10, 30]),
    ("tokens:8", [0, 10, 18, 30]),   # 10 is the first start >= 8 on; the 20-token step 10..30 gets a cut at 18
    ("tokens:40", [0]),
    ("budget:2", [0, 10]),           # the start nearest the midpoint 16
    ("budget:3", [0, 10, 30]),       # nearest 10.7, then the first start after 10 nearest 21.3
    ("budget:9", [0, 5, 10, 30]),    # fewer starts than the budget: all of them
])
def test_state_offsets(mode, expected):
    assert state_offsets(STEPS, 32, mode) == expected


def test_state_offsets_skip_empty_steps_and_the_end():
    assert state_offsets([(0, 4), (4, 4), (4, 9), (9, 9)], 9, "all") == [0, 4]


def test_segment_advantages_share_one_value_per_segment():
    adv = segment_advantages(32, [0, 10, 30], [0.5, 0.25, 1.0], reward=1.0)
    assert adv.tolist() == pytest.approx([-0.25] * 10 + [0.75] * 20 + [0.0] * 2)


@pytest.mark.parametrize("mode", ["all", "every:2", "tokens:8", "budget:2"])
def test_vine_estimates_only_the_chosen_states(mode):
    ep = Episode(prompt_ids=[1, 2], response_ids=list(range(10, 42)), text="", reward=1.0, group=0, example=Example("e", "", "", "7"),
                 steps=STEPS)
    cuts = state_offsets(STEPS, 32, mode)
    wins = [[j + 1 for j in range(len(cuts))]]  # state j: j + 1 of 9 right
    engine = FakeEngine(wins)
    credit = get_estimator("vine")([ep], _vine_ctx(engine, mc_k=9, mc_states=mode))
    assert engine.calls[0][1] == [[2 + c for c in cuts]]
    values = [(j + 1) / 9 for j in range(len(cuts))]
    assert torch.allclose(credit.advantages[0], segment_advantages(32, cuts, values, 1.0))


# ------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("flag, value", [("mc_k_min", -1), ("mc_rule", "ci:0"), ("mc_rule", "majority"),
                                         ("mc_states", "tokens:0"), ("mc_states", "some")])
def test_bad_adaptive_settings_are_one_line_errors(flag, value):
    with pytest.raises(UserError, match="--" + flag.replace("_", "-")):
        configs.validate({flag: value})
