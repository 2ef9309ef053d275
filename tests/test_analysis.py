"""`vineppo analyze-values`: the MAE / ranking arithmetic by hand, the pipeline on a fake engine, one tiny smoke run."""

import json
import shutil

import pytest
import torch

from vineppo.analysis.values import (Study, adaptive_estimate, analyze, group_baselines, mae, mc_estimates,
                                     pairwise_ranking_accuracy)
from vineppo.core.errors import UserError
from vineppo.engine import Sample
from vineppo.tasks import Example, get_task

torch.set_num_threads(1)


def test_mae():
    assert mae([0.5, 1.0, 0.0], [0.25, 0.5, 0.0]) == pytest.approx(0.25)
    assert mae([], []) is None


def test_pairwise_ranking_ties():
    # true: a > b > c; pred gets (a, b) right, (a, c) right, (b, c) tied -> wrong
    assert pairwise_ranking_accuracy([0.9, 0.2, 0.2], [0.8, 0.5, 0.1]) == (2, 3, 0)
    # true tie between b and c: excluded, whatever is predicted
    assert pairwise_ranking_accuracy([0.9, 0.1, 0.5], [0.8, 0.5, 0.5]) == (2, 2, 1)
    # a constant prediction (GRPO, RLOO) is never right
    assert pairwise_ranking_accuracy([0.3] * 4, [0.1, 0.2, 0.3, 0.4]) == (0, 6, 0)
    # the wrong sign
    assert pairwise_ranking_accuracy([0.0, 1.0], [1.0, 0.0]) == (0, 1, 0)


def test_mc_estimates_use_disjoint_slices():
    rewards = [1.0] * 4 + [0.0] + [1.0, 1.0, 0.0] + [1.0] * 3 + [0.0] * 6
    e = mc_estimates(rewards, gt_k=4)
    assert e == pytest.approx({"true": 1.0, "vineppo_k1": 0.0, "vineppo_k3": 2 / 3, "vineppo_k9": 3 / 9})
    with pytest.raises(ValueError):
        mc_estimates([1.0] * 16, gt_k=4)


def test_group_baselines():
    b = group_baselines([1.0, 0.0, 0.0, 1.0], member=0)
    assert b["grpo"] == pytest.approx(0.5) and b["rloo"] == pytest.approx(1 / 3)
    assert group_baselines([1.0], 0)["rloo"] == 0.0


# ---------------------------------------------------------------------------------------- fake engine


class CharTokenizer:
    """One token per character (id = code point), EOS = 0: decoding any prefix is exact."""

    pad_token_id = eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def _sample(text, reason="stop"):
    return Sample([ord(c) for c in text] + ([0] if reason == "stop" else []), text, [0.0] * (len(text) + 1), reason)


class FakeEngine:
    """Responses: '#### 4' (right) for even m, '#### 5' (wrong) for odd m: every state is the prompt.

    Alternatives (k == 5): two-step texts starting with the line `j + 0 = j` for j = 0..3 and the one-step '#### 4' (terminal, reward 1).
    Value rollouts: continuation m is right iff m % d == 0, d = j + 1 after alternative j, else d = 4.
    """

    def __init__(self, alternatives=5):
        self.alternatives = alternatives
        self.calls = []
        self.budgets = []

    def generate(self, prompts, n, params, generator=None, progress=None, examples=None):
        return [[_sample("#### 4" if m % 2 == 0 else "#### 5") for m in range(n)] for _ in prompts]

    def continuations(self, req):
        sequences, boundaries, k, budgets, progress = req.sequences, req.boundaries, req.k, req.budgets, req.progress
        self.calls.append((len(sequences), [len(b) for b in boundaries], k))
        self.budgets.append(budgets)
        out = []
        for seq, (b,) in zip(sequences, boundaries):
            if k == self.alternatives:
                out.append([[_sample(f"{j} + 0 = {j}\n1 + 1 = 2\n#### 4") for j in range(4)] + [_sample("#### 4")]])
                continue
            text = "".join(chr(i) for i in seq[:b])
            d = int(text[-2]) + 1 if text.endswith("\n") and text[-2].isdigit() else 4
            out.append([[_sample("#### 4" if m % d == 0 else "#### 5") for m in range(k)]])
        if progress:
            progress(k * len(sequences), 0)
        return out


def _examples(n):
    return [Example(f"p{i}", f"What is {i}?", "#### 4", "4") for i in range(n)]


def test_analyze_on_fake_engine_hand_computed():
    engine, seen = FakeEngine(), []

    def critic(nodes):
        seen.extend(nodes)
        return [0.5] * len(nodes)

    res = analyze(engine, CharTokenizer(), get_task("arith"), _examples(5), Study(16, 8, 2, 5, 0, 32),
                  critic_values=critic)
    assert res["states"] == 16
    # generate once; alternatives in one call (2 states x 5); ONE Monte Carlo call: 16 states + 2 x 4 live alternatives
    assert engine.calls == [(2, [1, 1], 5), (24, [1] * 24, 8 + 13)]
    # continuations get the room their response had left: 32 at a prompt, 22 after a 10-token first step
    assert engine.budgets == [[[32]] * 2, [[32]] * 16 + [[22]] * 8]
    # every state is the prompt, d = 4: truth 2/8; K1 uses m = 8 -> 1; K3 m = 9..11 -> 0; K9 m = 12..20 -> 3/9
    # GRPO: group mean 1/2; RLOO: 3/7 or 4/7, both |.| - 1/4 average to 1/4; the fake critic says 1/2.
    assert res["mae"] == pytest.approx({"vineppo_k1": 0.75, "vineppo_k3": 0.25, "vineppo_k9": 1 / 12,
                                        "ppo_critic": 0.25, "grpo": 0.25, "rloo": 0.25, "tempo": 0.25})
    # alternatives' truth [1, 4/8, 3/8, 2/8, 1 (terminal)]: pair (0, 4) tied -> excluded, 9 pairs per state.
    # K1 [1,1,0,1,1] 3/9; K3 [1,1/3,1/3,0,1] 8/9; K9 [1,5/9,3/9,3/9,1] 8/9; critic [.5,.5,.5,.5,1] 3/9
    assert res["ranking"]["pairs"] == 18 and res["ranking"]["pairs_excluded_true_tie"] == 2
    assert res["ranking_accuracy"] == pytest.approx({"vineppo_k1": 3 / 9, "vineppo_k3": 8 / 9, "vineppo_k9": 8 / 9,
                                                     "ppo_critic": 3 / 9, "grpo": 0.0, "rloo": 0.0, "tempo": 0.0})
    # the critic values states (prompt) and alternatives (prompt + one step), never a terminal one
    assert len(seen) == 16 + 10 and sum(n.terminal is not None for n in seen) == 2


def test_compute_axis_on_fake_engine_hand_computed():
    res = analyze(FakeEngine(), CharTokenizer(), get_task("arith"), _examples(5), Study(16, 8, 2, 5, 0, 32))
    axis = {r["method"]: r for r in res["compute"]}
    # every continuation is '#### 4' or '#### 5' plus EOS: 7 tokens
    assert [axis[m]["tokens_per_state"] for m in ("vineppo_k1", "vineppo_k3", "vineppo_k9")] == [7, 21, 63]
    assert axis["vineppo_k9"]["mae"] == pytest.approx(res["mae"]["vineppo_k9"])
    assert axis["vineppo_k3"]["ranking_accuracy"] == pytest.approx(res["ranking_accuracy"]["vineppo_k3"])
    # the K = 9 slice is 1,0,0,0,1,0,0,0,1 at every state: no adaptive rule settles early, so each equals K = 9
    for name in ("adaptive_agree2", "adaptive_agree3", "adaptive_ci0.25"):
        assert axis[name]["continuations_per_state"] == 9 and axis[name]["mae"] == pytest.approx(1 / 12)


def test_adaptive_estimate_replays_rounds():
    tokens = list(range(1, 10))
    assert adaptive_estimate([1.0, 1.0, 1.0, 0, 0, 0, 0, 0, 0], tokens, 9, 3, "agree") == (1.0, 3, 6)
    assert adaptive_estimate([1.0, 0.0, 1.0, 0, 0, 0, 0, 0, 0], tokens, 9, 3, "agree") == (2 / 9, 9, 45)
    assert adaptive_estimate([0.0] * 9, tokens, 9, 2, "ci:0.25") == (0.0, 4, 10)  # half-width at 4: 0.245


def test_analyze_without_critic_reports_none():
    res = analyze(FakeEngine(), CharTokenizer(), get_task("arith"), _examples(3), Study(5, 8, 1, 5, 1, 32))
    assert res["states"] == 5
    assert res["mae"]["ppo_critic"] is None and res["ranking_accuracy"]["ppo_critic"] is None
    assert res["mae"]["vineppo_k9"] == pytest.approx(1 / 12)


# ------------------------------------------------------------------------------------- tiny smoke run


def test_cli_smoke_on_tiny_model(tmp_path, capsys):
    from vineppo.cli import main
    from vineppo.models.causal_lm import build_tiny
    from vineppo.training.forward import Critic

    model_dir = build_tiny(get_task("arith"), tmp_path / "tiny", hidden=32, layers=1, heads=2, mlp=64)
    # a fake PPO run folder: checkpoints/latest -> iter-000001 with the policy and a critic.pt
    ckpt = tmp_path / "ppo" / "checkpoints" / "iter-000001"
    shutil.copytree(model_dir, ckpt)
    (ckpt.parent / "latest").write_text("iter-000001\n")
    critic = Critic.from_pretrained(str(ckpt), torch.device("cpu"))
    torch.save({"critic": critic.state_dict(), "optimizer": {}}, ckpt / "critic.pt")

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["analyze-values", "--model", str(model_dir), "--critic", str(tmp_path / "ppo"), "--states", "3",
              "--gt-k", "2", "--ranking-states", "1", "--alternatives", "2", "--max-new-tokens", "6",
              "--device", "cpu", "--out", str(out), "--json"])
    assert e.value.code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed) == {"mae", "ranking_accuracy", "states", "compute"} and printed["states"] == 3
    assert (out / "values_compute.png").stat().st_size > 0
    assert printed["mae"]["ppo_critic"] is not None
    assert (out / "values.png").stat().st_size > 0
    assert json.loads((out / "values.json").read_text())["settings"]["gt_k"] == 2


def test_bad_flags_raise_user_error(tmp_path):
    import argparse

    from vineppo.commands.analyze_values import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(UserError):
        run(p.parse_args(["--states", "0"]))
    with pytest.raises(UserError):
        run(p.parse_args(["--states", "4"]))  # neither --model nor --critic
    with pytest.raises(UserError):
        run(p.parse_args(["--model", "x", "--critic", str(tmp_path)]))  # not a run folder
