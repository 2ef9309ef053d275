"""vineppo.integrations.trl: VinePPO's and TEMPO's per-token advantages inside TRL's GRPOTrainer.

A script written like TRL's GRPO quick start trains 2 steps on a CPU, in one process and under torchrun with 2; a
planted advantage on one token moves only that token's gradient through TRL's loss; on the same samples and
continuations the advantages equal `vineppo train`'s own estimators' bit for bit; continuations are scored by the
run's reward functions (trainer_state included, cut-off ones too); the settings that need one advantage per response
are refused in one line. The model is the shipped 0.9M-parameter arith SFT model: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from trl import GRPOConfig

from vineppo.core.config import TrainConfig, resolve, section
from vineppo.core.grading import grade_gsm8k
from vineppo.core.steps import make_splitter
from vineppo.credit import Credit, CreditContext, get_estimator, normalise
from vineppo.engine import Sample, SamplingParams
from vineppo.engine.balanced import BalancedContinuations
from vineppo.integrations.trl import TempoTrainer, VinePPOConfig, VinePPOTrainer
from vineppo.tasks import Example, Task
from vineppo.training.trainer import graded_episodes

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "src" / "vineppo" / "assets" / "sft-arith")

QUICK_START = '''
"""TRL's GRPO quick start with VinePPOTrainer, on the shipped arith model (argv: model, output folder)."""
import json
import sys

from datasets import Dataset
from trl import GRPOConfig

from vineppo.core.grading import grade_gsm8k
from vineppo.integrations.trl import VinePPOConfig, VinePPOTrainer
from vineppo.tasks import get_task

model, out = sys.argv[1], sys.argv[2]
task = get_task("arith")
problems = task.load("train", None, 0)[:16]
dataset = Dataset.from_list([{"prompt": task.prompt(ex), "answer": ex.answer} for ex in problems])


def accuracy(completions, answer, **kwargs):
    return [grade_gsm8k(completion, a) for completion, a in zip(completions, answer)]


args = GRPOConfig(output_dir=out, per_device_train_batch_size=2, generation_batch_size=8, num_generations=8,
                  max_completion_length=48, temperature=0.7, max_steps=2, logging_steps=1, use_cpu=True,
                  report_to="none", save_strategy="no", seed=0)
trainer = VinePPOTrainer(model=model, reward_funcs=accuracy, args=args, train_dataset=dataset,
                         vine_config=VinePPOConfig(mc_k=2))
trainer.train()

rank = trainer.accelerator.process_index
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"world": trainer.accelerator.num_processes, "step": trainer.state.global_step,
               "logs": trainer.state.log_history}, f)

if len(sys.argv) > 3:  # then TEMPO, recording each process's episodes and raw advantages (a group spans processes)
    import pickle
    from vineppo.integrations.trl import TempoTrainer

    class Recorded(TempoTrainer):
        def credit(self, episodes, ctx):
            credit = super().credit(episodes, ctx)
            self.seen.append((episodes, credit.advantages))
            return credit

    trainer = Recorded(model=model, reward_funcs=accuracy, args=args, train_dataset=dataset)
    trainer.seen = []
    trainer.train()
    with open(f"{sys.argv[3]}/rank{rank}.pkl", "wb") as f:
        pickle.dump(trainer.seen, f)

trainer.accelerator.end_training()  # the process group closed before exit: left open, gloo can abort at exit
'''


def _run(cmd: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _logged(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_the_quick_start_trains_two_steps_on_a_cpu(tmp_path):
    (tmp_path / "quick_start.py").write_text(QUICK_START)
    _run([sys.executable, "quick_start.py", MODEL, str(tmp_path)], tmp_path)
    got = _logged(tmp_path)
    assert got["world"] == 1 and got["step"] == 2
    steps = [log for log in got["logs"] if "loss" in log]  # one generation batch of 8 feeds both steps
    assert len(steps) == 2 and steps[0]["mc/continuations"] > 0 and steps[0]["mc/states"] > 0
    assert {"mc/tokens", "mc/truncated", "time/mc_s", "advantage/nonzero"} <= set(steps[0])


def test_the_quick_start_under_two_processes_and_tempo_across_them(tmp_path):
    """torchrun with 2 processes (accelerate's multi-CPU launch needs mpirun): VinePPO trains 2 steps; then TEMPO,
    whose 8-response groups sit 4 and 4 on the two processes, gives each process its share of the advantages that
    `tempo` gives the whole batch."""
    (tmp_path / "quick_start.py").write_text(QUICK_START)
    (tmp_path / "tempo").mkdir()
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "quick_start.py",
          MODEL, str(tmp_path), str(tmp_path / "tempo")], tmp_path)
    for rank in (0, 1):
        assert _logged(tmp_path, rank)["world"] == 2 and _logged(tmp_path, rank)["step"] == 2
    steps = [log for log in _logged(tmp_path)["logs"] if "loss" in log]
    assert len(steps) == 2 and steps[0]["mc/continuations"] > 0
    seen = [pickle.loads((tmp_path / "tempo" / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) >= 1
    for (eps0, adv0), (eps1, adv1) in zip(*seen):
        assert {ep.group for ep in eps0} == {ep.group for ep in eps1}  # one group, split over the processes
        whole = get_estimator("tempo")(eps0 + eps1, CreditContext())
        assert all(torch.equal(a, b) for a, b in zip(whole.advantages, adv0 + adv1))


# ------------------------------------------------------------------------------------ in one process, samples fed

PROBLEMS = [("Ava has 5 apples. She gets 3 more. The number is multiplied by 2. How many?", "16"),
            ("Ben has 9 coins. He gives away 2 coins. How many?", "7")]
RESPONSES = [[" 5 + 3 = 8\n8 * 2 = 16\n#### 16", " 5 + 3 = 8\n8 * 2 = 15\n#### 15", " 5 + 3 = 9\n9 * 2 = 18\n#### 18",
              " 5 + 3 = 8\n#### 8"],
             [" 9 - 2 = 7\n#### 7", " 9 - 2 = 6\n#### 6", " 9 - 2 = 7\n#### 7", " 9 - 3 = 6\n#### 6"]]
ENDINGS = ["\n#### 16", " = 16\n#### 16", "\n#### 7", " + 1 = 3\n#### 3", "\n7\n#### 7"]


class Fed:
    """The run's generation replaced by fixed samples: the first call gets RESPONSES, every later one, per prefix
    and draw, one of ENDINGS (a pure function of the prefix and how many it had before), ending in EOS. Every
    continuation drawn is recorded by prefix, for the native estimator to be fed the same ones."""

    def __init__(self, tok, long: int = 0):
        self.tok, self.calls, self.drawn, self.long = tok, 0, {}, long

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.calls += 1
        if self.calls == 1:
            return [self.ids(r) for group in RESPONSES for r in group], None
        out = []
        for p in prompt_ids:
            key = tuple(p)
            got = self.drawn.setdefault(key, [])
            ending = self.ids(ENDINGS[(sum(key) + len(got)) % len(ENDINGS)])
            if self.long and len(got) == 0:  # the first draw of each prefix runs on without EOS
                ending = [ending[0]] * self.long
            got.append(ending)
            out.append(ending)
        return out, None


def accuracy(completions, answer, **kwargs):
    return [grade_gsm8k(c, a) for c, a in zip(completions, answer)]


def _rows() -> list[dict]:
    return [{"prompt": f"Problem:\n{q}\n\nSolution:", "answer": a} for q, a in PROBLEMS for _ in range(4)]


def _trainer(tmp_path, cls=VinePPOTrainer, reward_funcs=accuracy, vine=None, **settings):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=64, use_cpu=True, report_to="none", save_strategy="no", seed=0,
                      **settings)
    trainer = cls(model=MODEL, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(_rows()),
                  vine_config=vine or VinePPOConfig(mc_k=3))
    trainer.model.train()
    return trainer


def _fed_batch(trainer, long: int = 0) -> tuple[dict, Fed]:
    fed = Fed(trainer._tokenizer, long)
    trainer._generate_single_turn = fed
    return trainer._generate_and_score_completions(_rows()), fed


class Replay:
    """A native engine that hands out the continuations a Fed recorded, k per prefix, in the order they were drawn."""

    logprobs_are_the_policys = False

    def __init__(self, fed: Fed):
        self.fed, self.at = fed, {}

    def continuations(self, req):
        out = []
        for seq, bs in zip(req.sequences, req.boundaries):
            per = []
            for b in bs:
                key = tuple(seq[:b])
                start = self.at.get(key, 0)
                self.at[key] = start + req.k
                per.append([Sample(ids, self.fed.tok.decode(ids, skip_special_tokens=True), [0.0] * len(ids), "stop")
                            for ids in self.fed.drawn[key][start:start + req.k]])
            out.append(per)
        return out


def _native(trainer, fed: Fed, out: dict, algo: str) -> list[torch.Tensor]:
    """What `vineppo train --algo ALGO --steps lines` assigns to the same responses, continuations fed in: its
    episodes (training.trainer.graded_episodes), the credit and normalisation of the PPO family's update."""
    task = Task("fed", load=None, grade=grade_gsm8k, split_steps=make_splitter("lines"), stop=())
    tok = trainer._tokenizer
    drawn = []
    for g, ((q, a), group) in enumerate(zip(PROBLEMS, RESPONSES)):
        for i, _ in enumerate(group):
            row = g * 4 + i
            ids = out["completion_ids"][row][out["completion_mask"][row].bool()].tolist()
            prompt = out["prompt_ids"][row][out["prompt_mask"][row].bool()].tolist()
            drawn.append((g, Example(f"p{g}", q, "", a), prompt, Sample(ids, tok.decode(ids, skip_special_tokens=True),
                                                                        [0.0] * len(ids), "stop")))
    episodes = graded_episodes(task, tok, drawn)
    norm = resolve({}, {"algo": algo}).advantage_norm  # as `vineppo train --algo ALGO` normalises
    cfg = TrainConfig(algo=algo, mc_k=3, max_new_tokens=64, steps="lines", advantage_norm=norm)
    estimator = {"vineppo": "vine", "tempo": "tempo"}[algo]
    ctx = section(CreditContext, cfg, rollouts=BalancedContinuations(Replay(fed)), tokenizer=tok, score=task.score,
                  critic=None, params=SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens))
    return normalise(get_estimator(estimator)(episodes, ctx).advantages, cfg.advantage_norm)


def _rows_of(out: dict) -> list[torch.Tensor]:
    return [a[m.bool()].cpu() for a, m in zip(out["advantages"], out["completion_mask"])]


def test_vineppo_trainer_advantages_equal_vineppo_train_s_on_the_same_samples(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.advantage_norm == resolve({}, {"algo": "vineppo"}).advantage_norm == "scale"  # the same default
    out, fed = _fed_batch(trainer)
    assert out["advantages"].shape == out["completion_ids"].shape
    mine, native = _rows_of(out), _native(trainer, fed, out, "vineppo")
    assert len({float(x) for a in native for x in a}) > 4  # per-step credit, not one value per response
    assert all(torch.equal(a, b) for a, b in zip(mine, native))
    assert (out["advantages"] * (1 - out["completion_mask"])).abs().sum() == 0  # padding: 0
    logged = trainer._metrics["train"]
    assert logged["mc/continuations"][-1] == 3 * logged["mc/states"][-1] == 3 * len(fed.drawn)


def test_tempo_trainer_advantages_equal_tempo_s_on_the_same_samples(tmp_path):
    trainer = _trainer(tmp_path, cls=TempoTrainer)
    assert trainer.advantage_norm == resolve({}, {"algo": "tempo"}).advantage_norm == "whiten"  # tempo's own default
    out, fed = _fed_batch(trainer)
    assert fed.calls == 1  # no continuations
    mine, native = _rows_of(out), _native(trainer, fed, out, "tempo")
    assert all(torch.equal(a, b) for a, b in zip(mine, native))
    assert any(len(set(a.tolist())) > 1 for a in mine)  # a shared first line: per-step credit
    assert 0 < trainer._metrics["train"]["tempo/shared"][-1] < 1


def test_continuations_are_scored_by_the_run_s_reward_functions(tmp_path):
    """Every reward function sees the continuations (prefix + continuation as one completion, the row's columns,
    trainer_state), one that reads trainer_state included; a continuation cut off at its room is scored too."""
    calls = []

    def late(completions, answer, trainer_state, completion_ids, **kwargs):
        calls.append((list(completions), trainer_state, list(answer), [list(c) for c in completion_ids]))
        return [1.0 if trainer_state.global_step >= 3 else None for _ in completions]

    trainer = _trainer(tmp_path, reward_funcs=[accuracy, late], reward_weights=[1.0, 0.5])
    trainer.state.global_step = 3
    _, fed = _fed_batch(trainer, long=70)
    assert len(calls) >= 2 and all(state is trainer.state for _, state, _, _ in calls)
    continued = [ids for *_, ids_list in calls[1:] for ids in ids_list]  # response prefix + continuation
    drawn = [e for got in fed.drawn.values() for e in got]
    assert len(continued) == 3 * len(fed.drawn) == len(drawn)
    assert all(any(ids[-len(e):] == e for e in drawn) or len(ids) == 64 for ids in continued)
    cut = [ids for ids in continued if ids[-1] != trainer._tokenizer.eos_token_id]
    assert cut and all(len(ids) == 64 for ids in cut)  # cut at max_completion_length, and scored
    assert trainer._metrics["train"]["mc/truncated"][-1] == len(fed.drawn)
    # a continuation's reward is TRL's weighted sum of both functions, and every value at least late's 0.5
    group = Example("group-0", "", "", "")
    assert trainer.scorer.score([group, group], [" 8 * 2 = 16\n#### 16", " 2\n#### 2"], [[1], [2]]) == [1.5, 0.5]
    assert trainer._metrics["train"]["value/mean"][-1] >= 0.5
    trainer.state.global_step = 0  # late gives None now: the values come from accuracy alone
    calls.clear()
    _fed_batch(trainer)
    assert trainer._metrics["train"]["value/mean"][-1] < 0.5 and calls


def _planted(episodes, ctx):
    adv = [torch.zeros(len(ep.response_ids)) for ep in episodes]
    adv[0][2] = 1.0
    return Credit(adv)


def _logprob_grad(trainer, out: dict) -> torch.Tensor:
    """The gradient of TRL's loss with respect to each completion token's log-probability."""
    original, held = trainer._get_per_token_logps_and_entropies, {}

    def spy(*args, **kwargs):
        logps, entropies, aux = original(*args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
            held["logps"] = logps
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = spy
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, out).backward()
    return held["logps"].grad * out["completion_mask"]


def test_a_planted_advantage_on_one_token_moves_only_that_token_s_gradient(tmp_path):
    trainer = _trainer(tmp_path, vine=VinePPOConfig(mc_k=1, advantage_norm="none"), loss_type="grpo")
    trainer.estimator = _planted
    out, _ = _fed_batch(trainer)
    grad = _logprob_grad(trainer, out)
    moved = (grad != 0).nonzero().tolist()
    assert moved == [[0, 2]]
    # the reason importance_sampling_level="sequence" is refused: one ratio of all tokens spreads it over the response
    trainer.importance_sampling_level = "sequence"
    grad = _logprob_grad(trainer, out)
    assert (grad[0] != 0).sum() == out["completion_mask"][0].sum() > 1


def tool(x: int) -> int:
    """A tool.

    Args:
        x: a number
    """
    return x


class Env:
    def reset(self, **kwargs):
        return None


@pytest.mark.parametrize("settings, vine, named", [
    ({"args": {"importance_sampling_level": "sequence"}}, None, "importance_sampling_level='sequence'"),
    ({"args": {"loss_type": "vespo"}}, None, "loss_type='vespo'"),
    ({"args": {"multi_objective_aggregation": "normalize_then_sum"}}, None, "multi_objective_aggregation"),
    ({"args": {"scale_rewards": "batch"}}, None, "scale_rewards='batch'"),
    ({"tools": [tool]}, None, "tools"),
    ({"environment_factory": Env}, None, "environment_factory"),
    ({"rollout_func": lambda prompts, trainer: {}}, None, "rollout_func"),
    ({"reward_funcs": [accuracy, torch.nn.Linear(1, 1)]}, None, "reward_funcs[1]"),
    ({"reward_funcs": "some/reward-model"}, None, "reward_funcs[0]"),
    ({}, {"steps": "turns"}, "VinePPOConfig.steps"),
    ({}, {"steps": "words"}, "VinePPOConfig.steps"),
    ({}, {"mc_states": "half"}, "VinePPOConfig.mc_states"),
    ({}, {"mc_k": 0}, "VinePPOConfig.mc_k"),
    ({}, {"advantage_norm": "center"}, "VinePPOConfig.advantage_norm"),
    ({}, {"mc_rule": "ci:2"}, "VinePPOConfig.mc_rule"),
])
@pytest.mark.parametrize("cls", [VinePPOTrainer, TempoTrainer])
def test_a_setting_that_needs_one_advantage_per_response_is_refused_in_one_line(tmp_path, settings, vine, named, cls):
    given = {"model": MODEL, "reward_funcs": accuracy, "train_dataset": Dataset.from_list(_rows()), **settings}
    given["args"] = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=4,
                               per_device_train_batch_size=4, **settings.get("args", {}))
    with pytest.raises(ValueError) as refused:
        cls(**given, vine_config=VinePPOConfig(**(vine or {})) if vine is not None else None)
    message = str(refused.value)
    assert "\n" not in message and named in message


class Generation:
    """What TRLRollouts reads of a GRPOTrainer: its generation call (recorded), limits, tokenizer and vLLM mode."""

    def __init__(self, tok, vllm_mode: str | None):
        self._tokenizer, self.eos_token_ids, self.calls = tok, [tok.eos_token_id], []
        self.use_vllm, self.vllm_mode, self.vllm_tensor_parallel_size = vllm_mode is not None, vllm_mode, 1
        self.generation_config = type("Config", (), {"max_new_tokens": 64})()
        self.generation_kwargs = {"max_new_tokens": 64}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
        self.calls.append((len(prompt_ids), num_generations, self.generation_config.max_new_tokens,
                           self.generation_kwargs["max_new_tokens"]))
        return [[7] * 6 for _ in prompt_ids], None


@pytest.mark.parametrize("mode", [None, "server"])
def test_continuations_make_the_same_generation_calls_on_every_process(monkeypatch, mode):
    """Another process with 8 rows to draw (K = 2, room 10) and this one with none, then with its own: one call each
    time (a dummy where it has nothing), as many prompts as the other process under a vLLM server, the limit the
    longest room of all, each sample cut to its own room and reported scored."""
    from transformers import AutoTokenizer

    from vineppo.integrations import trl as integration

    other = (8, 2, 10)
    monkeypatch.setattr(integration.dist, "all_gather_objects", lambda mine: [mine, other])
    trainer = Generation(AutoTokenizer.from_pretrained(MODEL), mode)
    rollouts = integration.TRLRollouts(trainer)
    assert rollouts.draw([]) == []
    assert trainer.calls == [(8 if mode else 1, 2, 10, 10)]
    drawn = rollouts.draw([([5, 6], 2, 3), ([5, 6, 7], 2, 8)])
    assert trainer.calls[-1] == (8 if mode else 4, 2, 10, 10)
    assert [[len(s.token_ids) for s in per] for per in drawn] == [[3, 3], [6, 6]]
    assert all(s.finish_reason == "stop" for per in drawn for s in per) and rollouts.truncated == 4
    assert trainer.generation_config.max_new_tokens == trainer.generation_kwargs["max_new_tokens"] == 64
    other = (0, 1, 1)
    assert rollouts.draw([]) is None and len(trainer.calls) == 2  # no process has anything: no call
