"""The algorithm registry and the paper's two other baselines: RestEM and DPO+ (DPO-Positive)."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from vineppo.core import config as configs
from vineppo.core.errors import UserError
from vineppo.credit import Episode
from vineppo.models.causal_lm import load_model
from vineppo.tasks import TASKS, Example, get_task, register
from vineppo.training import algorithms
from vineppo.training.algorithms import Context, Models, dpo_positive_loss, keep_correct, preference_pairs
from vineppo.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny test model gets almost every arith problem wrong; this task grades arith responses by a coin the
# text flips (its length is even), so about half are "correct" and both algorithms have something to learn.
COIN = "arith-coin"
SMALL = dict(task=COIN, prompts_per_iter=4, samples_per_prompt=4, max_new_tokens=64, minibatch=8, micro_batch=8,
             eval_problems=4, eval_samples=2, eval_every=1, save_every=1, tensorboard=False, val_problems=4, dpo_pairs=2)


@pytest.fixture(scope="module", autouse=True)
def coin_task():
    register(dataclasses.replace(get_task("arith"), name=COIN, grade=lambda text, answer: float(len(text) % 2 == 0)))
    yield
    TASKS.pop(COIN)


def _cfg(model, out, **kw) -> configs.TrainConfig:
    return configs.resolve(configs.load_preset("arith-tiny"), {**SMALL, "model": str(model), "out": str(out), **kw})


def _ep(reward, group=0, prompt=(1, 2), response=(10, 11)):
    return Episode(prompt_ids=list(prompt), response_ids=list(response), text="", reward=reward, group=group,
                   example=Example("e", "", "", "7"), steps=[(0, len(response))])


# ------------------------------------------------------------------------------------ the registry


def test_every_algorithm_names_a_registered_update_and_has_its_settings():
    assert {spec.update for spec in configs.ALGOS.values()} == set(algorithms.UPDATES)
    for name, spec in configs.ALGOS.items():
        cfg = configs.resolve({}, {"algo": name})
        assert algorithms.get_algorithm(cfg) is algorithms.UPDATES[spec.update]
        assert all(getattr(cfg, k) == v for k, v in spec.settings.items()) and spec.about
    family = {algorithms.get_algorithm(configs.resolve({}, {"algo": a})) for a in ("vineppo", "ppo", "grpo", "rloo",
                                                                                   "grpo-trl", "dr-grpo")}
    assert family == {algorithms.ppo_family}  # one function: credit estimator, then the PPO update


def test_an_unknown_estimator_is_refused_before_anything_loads():
    with pytest.raises(UserError, match="unknown credit estimator 'nope'"):
        algorithms.get_algorithm(configs.resolve({}, {"algo": "ppo", "estimator": "nope"}))


@pytest.mark.parametrize("flags,message", [
    ({"algo": "ppo", "sample_from": "sft"}, "--sample-from: ppo learns on-policy"),
    ({"algo": "dpo-positive", "samples_per_prompt": 1}, "--samples-per-prompt: dpo-positive pairs responses"),
    ({"algo": "restem", "restem_keep": 0}, "--restem-keep: must be >= 1"),
    ({"algo": "dpo-positive", "dpo_beta": 0}, "--dpo-beta: must be > 0"),
    ({"algo": "dpo-positive", "sample_from": "reference"}, "--sample-from: must be policy or sft"),
])
def test_bad_settings_of_the_new_algorithms_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        configs.resolve(configs.load_preset("arith-tiny"), flags)


def test_presets_give_the_new_algorithms_the_same_sample_budget_on_arith():
    budgets = {a: c.prompts_per_iter * c.samples_per_prompt for a in configs.ALGOS
               for c in [configs.resolve(configs.load_preset("arith-tiny"), {"algo": a})]}
    assert set(budgets.values()) == {128}, budgets
    dpo = configs.resolve(configs.load_preset("gsm8k"), {"algo": "dpo-positive"})
    assert (dpo.sample_from, dpo.dpo_beta, dpo.dpo_lambda, dpo.samples_per_prompt) == ("sft", 0.1, 50.0, 64)
    restem = configs.resolve(configs.load_preset("gsm8k"), {"algo": "restem"})
    assert (restem.iterations, restem.samples_per_prompt, restem.restem_keep, restem.val_problems) == (10, 8, 10, 500)


# ------------------------------------------------------------------------------------ DPO+


def test_dpo_positive_loss_by_hand_on_two_pairs():
    chosen, rejected = torch.tensor([-10.0, -13.0]), torch.tensor([-12.0, -15.0])
    ref_chosen, ref_rejected = torch.tensor([-11.0, -12.0]), torch.tensor([-11.0, -12.0])
    loss = dpo_positive_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, lam=50.0)
    # pair 1: margin (-10+11) - (-12+11) = 2, the chosen response gained likelihood: penalty 0
    #         -log sigmoid(0.1 * 2) = log(1 + e^-0.2)
    # pair 2: margin (-13+12) - (-15+12) = 2, the chosen response lost 1 nat: penalty max(0, -12+13) = 1
    #         -log sigmoid(0.1 * (2 - 50 * 1)) = log(1 + e^4.8)
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-0.2)), math.log1p(math.exp(4.8))], rel=1e-6)


def _dpo(chosen, rejected, ref_chosen, ref_rejected, beta):
    """Plain DPO (Rafailov et al. 2023), written out separately."""
    return -torch.log(torch.sigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))))


def test_dpo_positive_is_dpo_without_the_penalty_or_when_the_chosen_ratio_is_positive():
    g = torch.Generator().manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (-20 * torch.rand(6, generator=g) for _ in range(4))
    plain = _dpo(chosen, rejected, ref_chosen, ref_rejected, 0.1)
    assert torch.allclose(dpo_positive_loss(chosen, rejected, ref_chosen, ref_rejected, 0.1, 0.0), plain)
    up = chosen - 0.5  # reference log-probs below the chosen ones: the chosen gained likelihood, no penalty
    assert torch.allclose(dpo_positive_loss(chosen, rejected, up, ref_rejected, 0.1, 50.0),
                          _dpo(chosen, rejected, up, ref_rejected, 0.1))
    down = chosen + 0.5  # the chosen responses lost likelihood: the penalty raises the loss
    assert (dpo_positive_loss(chosen, rejected, down, ref_rejected, 0.1, 50.0) >
            _dpo(chosen, rejected, down, ref_rejected, 0.1)).all()


def test_preference_pairs_are_correct_vs_incorrect_responses_to_one_prompt():
    rewards = [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    episodes = [_ep(r, group=g) for g, rs in enumerate(rewards) for r in rs]
    g = torch.Generator().manual_seed(0)
    pairs = preference_pairs(episodes, 3, g)
    assert all(episodes[c].reward == 1 and episodes[r].reward == 0 for c, r in pairs)
    assert all(episodes[c].group == episodes[r].group for c, r in pairs)
    by_group = [sum(episodes[c].group == k for c, _ in pairs) for k in range(4)]
    assert by_group == [3, 0, 0, 3]  # 4 possible pairs in group 0 and 3 in group 3; none when all agree
    assert len(set(pairs)) == len(pairs)
    assert preference_pairs(episodes, 10, g)[:4] == [(0, 1), (0, 3), (2, 1), (2, 3)]  # all of them when fewer


# ------------------------------------------------------------------------------------ RestEM


def test_restem_keeps_only_correct_samples_at_most_n_per_question():
    episodes = [_ep(1), _ep(0), _ep(1), _ep(1),  # question A: 3 correct of 4
                _ep(0, group=1, prompt=(3,)), _ep(1, group=1, prompt=(3,)),  # question B
                _ep(1, group=2), _ep(1, group=2)]  # question A drawn a second time
    assert keep_correct(episodes, 10) == [0, 2, 3, 5, 6, 7]
    assert keep_correct(episodes, 2) == [0, 2, 5]  # the cap counts per question, over both draws of A
    assert keep_correct([_ep(0), _ep(0.0, group=1)], 10) == []


def _arith_episodes(tokenizer, rewards: list[list[int]]) -> list[Episode]:
    """Real token ids: one arith-like prompt per group, a response per reward."""
    episodes = []
    for g, rs in enumerate(rewards):
        prompt = tokenizer(f"Problem:\nAva has {g + 2} coins. She gets 3 more. How many?\n\nSolution:")["input_ids"]
        for j, r in enumerate(rs):
            text = f" {g + 2} + 3 = {g + 5 + (1 - r) * (j + 1)}\n#### {g + 5}"
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            episodes.append(Episode(prompt, response, "", float(r), g, Example("e", "", "", str(g + 5)), [(0, len(response))]))
    return episodes


def test_restem_restarts_from_the_sft_weights_every_round(tiny_sft, monkeypatch):
    policy, tokenizer = load_model(tiny_sft, device="cpu", verbose=False)
    reference, _ = load_model(tiny_sft, device="cpu", verbose=False)
    sft = {k: v.clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for p in policy.parameters():  # as after an earlier round: other weights, and AdamW moments
        p.grad = torch.full_like(p, 0.1)
    optimizer.step()
    assert not all(torch.equal(policy.state_dict()[k], sft[k]) for k in sft)
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "restem", "samples_per_prompt": 4,
                                                             "restem_keep": 2, "epochs": 2, "minibatch": 2})
    ctx = Context(cfg=cfg, models=Models(policy, reference, optimizer), tokenizer=tokenizer,
                  order_generator=torch.Generator().manual_seed(0))
    seen = {}
    real = algorithms.minibatch_steps

    def spy(ctx, ids, weights, loss_fn):
        seen.update(weights_then=ctx.models.policy.state_dict(), moments=len(ctx.models.optimizer.state), ids=ids)
        seen["weights_then"] = {k: v.clone() for k, v in seen["weights_then"].items()}
        return real(ctx, ids, weights, loss_fn)

    monkeypatch.setattr(algorithms, "minibatch_steps", spy)
    stats = algorithms.restem(_arith_episodes(tokenizer, [[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]]), ctx)
    assert all(torch.equal(seen["weights_then"][k], sft[k]) for k in sft)  # exactly the SFT weights
    assert seen["moments"] == 0  # and a fresh optimiser
    assert seen["ids"] == [0, 2, 9]  # global ids of the kept samples: 2 of group 0 (capped), 1 of group 2
    assert stats["restem/kept"] == 3 and stats["restem/questions"] == 2
    assert math.isfinite(stats["loss"]) and stats["loss"] > 0
    assert not all(torch.equal(policy.state_dict()[k], sft[k]) for k in sft)  # then it fine-tuned


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def two_iterations(tiny_sft, tmp_path_factory):
    """A finished 2-iteration run of each new algorithm (the uninterrupted runs of the resume tests)."""
    root = tmp_path_factory.mktemp("algos")
    return {algo: (train(_cfg(tiny_sft, root / algo, algo=algo, iterations=2)), root / algo)[1]
            for algo in ("restem", "dpo-positive")}


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run):
    name = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / name / "model.safetensors")


def test_restem_two_rounds_end_to_end(two_iterations):
    run = two_iterations["restem"]
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert all("val/pass@1" in r and "test/pass@1" in r for r in rows)  # every round is evaluated (eval_every 1)
    assert rows[1]["episodes"] == 16 and "train/reward" in rows[1] and "kl" not in rows[1]
    assert sum(r["restem/kept"] for r in rows[1:]) > 0, "no correct sample: the test says nothing"
    assert all(math.isfinite(r["loss"]) for r in rows[1:])
    summary = json.loads((run / "summary.json").read_text())
    best = summary["best_val_iteration"]
    vals = [r["val/pass@1"] for r in rows]
    assert summary["best_val_pass@1"] == max(vals) and best == vals.index(max(vals))  # earliest of the best
    assert summary["test_at_best_val_pass@1"] == rows[best]["test/pass@1"]
    assert configs.load(run / "config.yaml").algo == "restem"


def test_dpo_positive_two_iterations_end_to_end(two_iterations):
    run = two_iterations["dpo-positive"]
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert sum(r["dpo/pairs"] for r in rows[1:]) > 0, "no pair: the test says nothing"
    first = next(r for r in rows[1:] if r["dpo/pairs"])
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert "best_val_iteration" in summary  # SMALL evaluates a validation split for every algorithm
    assert configs.load(run / "config.yaml").sample_from == "sft"


@pytest.mark.parametrize("algo", ["restem", "dpo-positive"])
def test_resume_gives_the_weights_of_the_uninterrupted_run(two_iterations, tiny_sft, tmp_path, algo):
    part = tmp_path / "part"
    train(_cfg(tiny_sft, part, algo=algo, iterations=1))
    train(dataclasses.replace(configs.load(part / "config.yaml"), iterations=2), resume=part)
    a, b = _weights(two_iterations[algo]), _weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["iteration"] for r in _rows(part)] == [0, 1, 2]
    full = json.loads((two_iterations[algo] / "summary.json").read_text())
    resumed = json.loads((part / "summary.json").read_text())
    timings = ("wall_clock_s", "setup_s", "start_eval_s", "train_s", "eval_s", "save_s")
    assert {k: v for k, v in resumed.items() if k not in timings} == {k: v for k, v in full.items() if k not in timings}


# ------------------------------------------------------------------------------------ with the memory settings

needs_peft = pytest.mark.skipif(not configs.peft_installed(), reason="LoRA needs peft: pip install '.[lora]' (CI does)")


@needs_peft
def test_restem_under_lora_restarts_from_fresh_adapters(tiny_sft):
    from vineppo.models import lora

    base, tokenizer = load_model(tiny_sft, device="cpu", verbose=False)
    policy, _ = load_model(tiny_sft, device="cpu", verbose=False)
    policy = lora.add_adapters(policy, 4, 8.0, "all-linear")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for p in optimizer.param_groups[0]["params"]:  # as after an earlier round: trained adapters, AdamW moments
        p.grad = torch.full_like(p, 0.1)
    optimizer.step()
    ids = torch.tensor([tokenizer("Problem:\n2 + 3\n\nSolution:")["input_ids"]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
        assert not torch.allclose(policy(input_ids=ids).logits, want, atol=1e-4)
        cfg = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "restem", "lora_r": 4})
        ctx = Context(cfg=cfg, models=Models(policy, lora.AdaptersOff(policy), optimizer), tokenizer=tokenizer)
        algorithms.restart_from_sft(ctx)
        assert torch.equal(policy(input_ids=ids).logits, want)  # fresh adapters (B = 0): the base model exactly
    assert len(optimizer.state) == 0
    a = {k: v for k, v in policy.named_parameters() if "lora_A" in k}
    assert a and all(v.abs().sum() > 0 for v in a.values())  # A drawn afresh, not zeroed: the adapters can learn


@needs_peft
@pytest.mark.parametrize("algo", ["restem", "dpo-positive"])
def test_lora_bf16_checkpointing_runs_of_restem_and_dpo_positive(tiny_sft, tmp_path, algo):
    run = tmp_path / algo
    train(_cfg(tiny_sft, run, algo=algo, iterations=1, lora_r=4, lora_alpha=8.0, dtype="bfloat16",
               gradient_checkpointing=True, sample_from="policy", eval_problems=0, val_problems=0))
    rows = _rows(run)
    assert math.isfinite(rows[-1]["loss"]) and rows[-1]["grad_norm"] > 0
    ckpt = run / "checkpoints" / "iter-000001"
    assert not (ckpt / "model.safetensors").exists()
    assert all("lora_" in k for k in load_file(ckpt / "adapter_model.safetensors"))  # only the adapters trained


def test_lora_with_samples_from_the_sft_model_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(configs, "peft_installed", lambda: True)
    with pytest.raises(UserError, match=r"lora.r.*sample_from sft \(dpo-positive's default\).*--sample-from policy"):
        configs.resolve(configs.load_preset("arith-tiny"), {"algo": "dpo-positive", "lora_r": 8})


# ------------------------------------------------------------------------------------ old log-probs from sampling


def _sampled_grpo_update(tiny_sft, use_sampler: bool):
    """A GRPO update on episodes the native engine sampled; returns its metrics, weights and policy forward count."""
    from vineppo.engine import Engine, SamplingParams
    from vineppo.models.causal_lm import seeded_generator

    policy, tok = load_model(tiny_sft, device="cpu", verbose=False)
    reference, _ = load_model(tiny_sft, device="cpu", verbose=False)
    reference.requires_grad_(False)
    cfg = configs.resolve(configs.load_preset("arith-tiny"), {"algo": "grpo", "samples_per_prompt": 4, "minibatch": 8,
                                                             "micro_batch": 4, "epochs": 2})
    engine = Engine(policy, tok)
    params = SamplingParams(cfg.temperature, cfg.top_p, 24, ())
    prompts = [tok(f"Problem:\nAva has {g + 2} coins. She gets 3 more. How many?\n\nSolution:")["input_ids"]
               for g in range(2)]
    outputs = engine.generate(prompts, 4, params, seeded_generator(policy, 0))
    episodes = [Episode(p, list(s.token_ids), s.text, float(j % 2), g, Example("e", "", "", "5"), [(0, len(s.token_ids))], False,
                        list(s.logprobs) if use_sampler else None)
                for g, (p, samples) in enumerate(zip(prompts, outputs)) for j, s in enumerate(samples)]
    calls = []
    policy.register_forward_hook(lambda *a: calls.append(1))
    # SGD, not AdamW: its steps are proportional to the gradients, so equal gradients give equal weights
    ctx = Context(cfg=cfg, models=Models(policy, reference, torch.optim.SGD(policy.parameters(), lr=0.1)),
                  tokenizer=tok, engine=engine, params=params, order_generator=torch.Generator().manual_seed(0))
    metrics = algorithms.ppo_family(episodes, ctx)
    return metrics, {k: v.clone() for k, v in policy.state_dict().items()}, len(calls)


def _sft_weights(path):
    return load_model(path, device="cpu", verbose=False)[0].state_dict()


def test_the_native_engines_sampling_logprobs_are_the_updates_old_logprobs(tiny_sft):
    with_sampler, weights, forwards = _sampled_grpo_update(tiny_sft, use_sampler=True)
    recomputed, weights_ref, forwards_ref = _sampled_grpo_update(tiny_sft, use_sampler=False)
    assert with_sampler["logprob_gap"] < 1e-4  # the engine's log-probs are the trainer's, to float rounding
    assert "logprob_gap" not in recomputed
    # no old-log-prob pass over the 2 micro-batches of 4 (each 2 model calls: prompts, then responses on them)
    assert forwards_ref - forwards == 2 * 2
    moved = max(float((weights[k] - w).abs().max()) for k, w in _sft_weights(tiny_sft).items())
    gap = max(float((weights[k] - weights_ref[k]).abs().max()) for k in weights)
    assert moved > 1e-3 and gap < 1e-3 * moved  # the update lands where the recomputed old log-probs take it
