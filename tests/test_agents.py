"""Multi-turn rollouts (vineppo.agents): tools and environments answer the policy's turns, their tokens are masked
out of the update, VinePPO's states sit at turn boundaries and its continuations replay the dialogue; every fault is
one line or a message back to the model, counted. A scripted engine writes the policy's turns."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vineppo import agents
from vineppo.agents import AgentEngine, for_task
from vineppo.core import config as configs
from vineppo.core.errors import RewardError, RolloutFault, UserError
from vineppo.credit import CreditContext, get_estimator
from vineppo.engine import Request, Sample, SamplingParams
from vineppo.tasks import Example
from vineppo.tasks.agent import AgentSpec, Markup, load_env, load_tools, tool_of
from vineppo.training.forward import pack, token_logprobs
from vineppo.training.ppo import Surrogate, micro_batches, policy_loss
from vineppo.training.trainer import _episode

EOS = 3


class CharTokenizer:
    """One token per character (id = code point + 10), EOS = 3."""

    eos_token_id, pad_token_id, all_special_ids = EOS, 0, [EOS]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) + 10 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 10) for i in ids if i != EOS and i >= 10)


TOK = CharTokenizer()


class MergingTokenizer(CharTokenizer):
    """CharTokenizer, but "><" is one token (id 5), as SmolLM2's tokenizer merges it."""

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text.startswith("><", i):
                ids, i = ids + [5], i + 2
            else:
                ids, i = ids + [ord(text[i]) + 10], i + 1
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("><" if i == 5 else chr(i - 10) for i in ids if i != EOS and (i >= 10 or i == 5))


class Script:
    """A rollout engine whose policy writes `turn(text so far)`, token by token, and stops after the token that
    completes a stop string, at its token budget, or at the text's end with EOS."""

    def __init__(self, turn, call_more=True, tokenizer=TOK):
        self.turn, self.call_more, self.tokenizer, self.model, self.calls = turn, call_more, tokenizer, None, 0
        self.logprobs_are_the_policys = False

    def continuations(self, req: Request):
        self.calls += 1
        tok, out = self.tokenizer, []
        for i, (seq, (b,)) in enumerate(zip(req.sequences, req.boundaries)):
            ids, ended = [], None
            for t in tok(self.turn(tok.decode(seq[:b])))["input_ids"]:
                if len(ids) == req.budgets[i][0]:
                    ended = "length"
                    break
                ids.append(t)
                if any(st in tok.decode(ids) for st in req.params.stop):
                    ended = "stop"  # as a real engine: the turn ends with the token that completes a stop string
                    break
            if ended is None:
                ids, ended = ids + [EOS], "stop"
            s = Sample(ids, tok.decode(ids), [-0.5] * len(ids), ended)
            if self.call_more and req.more is not None:
                req.more(i, 0, [s])
            out.append([[s]])
        return out

    def sleep(self):
        pass

    def push_weights(self, model):
        pass


class PlainPrompter:
    """The plain format's prompter: the prompt is the example's problem, an observation goes on its own line."""

    tool_format = "plain"

    def __init__(self, tokenizer=TOK):
        self.tokenizer = tokenizer

    def prompt(self, ex, extra="", join=None):
        return self.tokenizer(ex.problem + (("\n" if join is None else join) + extra if extra else ""))["input_ids"]

    def next_turn(self, messages, ended_with):
        return f"\n{messages[-1]['content']}\n"


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def boom(x: int) -> int:
    """Raises.

    Args:
        x: anything
    """
    raise ValueError("no luck")


def slow(x: int) -> int:
    """Sleeps past the limit.

    Args:
        x: anything
    """
    time.sleep(1.0)
    return x


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=80)
EX = Example("row-1", "Q:", "", "")


def _engine(turn, tools=(add,), env=None, max_turns=4, timeout=5.0, call_more=True, total=0, inserted=0,
            markup=Markup(), tokenizer=TOK):
    spec = AgentSpec(load_tools(list(tools)), env, max_turns, total, "plain", markup, inserted)
    return AgentEngine(Script(turn, call_more, tokenizer), spec, PlainPrompter(tokenizer), lambda ex: {"secret": 7},
                       timeout)


def _calculator(text: str) -> str:
    return CALL if "<tool_response>" not in text else "It is 5."


@pytest.mark.parametrize("call_more", [True, False])
def test_a_tool_call_is_answered_and_its_tokens_are_not_the_policys(call_more):
    engine = _engine(_calculator, call_more=call_more)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    inserted = "<tool_response>5</tool_response>\n"
    assert s.text == CALL + inserted + "It is 5." and s.finish_reason == "stop"
    assert s.dialogue.mask == [1] * len(CALL) + [0] * len(inserted) + [1] * (len("It is 5.") + 1)  # + EOS
    assert s.dialogue.starts == [0, len(CALL) + len(inserted)]
    assert [m["role"] for m in s.dialogue.messages] == ["assistant", "tool", "assistant"]
    assert s.dialogue.messages[1]["content"] == "5"
    assert agents.counts([s]) == {"agent/tool_calls": 1.0, "agent/turns": 2.0}  # counted on its own dialogue
    assert agents.counts([s, s], "mc/") == {"mc/agent/tool_calls": 2.0, "mc/agent/turns": 4.0}


def test_tool_faults_go_back_to_the_model_and_are_counted():
    def turn(text):
        calls = text.count("<tool_response>")
        script = ['<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>', '<tool_call>not json</tool_call>',
                  '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                  '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>', "done"]
        return script[calls]

    engine = _engine(turn, tools=(boom, slow), max_turns=5, timeout=0.2, total=1000)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    results = [m["content"] for m in s.dialogue.messages if m["role"] == "tool"]
    assert results[0].startswith("error: ValueError: no luck")
    assert "not JSON" in results[1] and "no tool 'nope'" in results[2] and "past its 0.2 s limit" in results[3]
    assert s.finish_reason == "stop" and s.text.endswith("done")
    stats = agents.counts([s])
    assert (stats["agent/tool_errors"], stats["agent/bad_calls"], stats["agent/unknown_tools"],
            stats["agent/tool_timeouts"]) == (1.0, 1.0, 1.0, 1.0)


def test_max_turns_and_the_token_cap_cut_a_dialogue_off():
    engine = _engine(lambda text: CALL, max_turns=3)  # calls for ever
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert s.finish_reason == "length" and len(s.dialogue.starts) == 3 and agents.counts([s])["agent/cut_off"] == 1
    engine = _engine(lambda text: CALL, total=100)  # the policy's tokens: the tool's results are not counted
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert s.finish_reason == "length" and sum(s.dialogue.mask) == 100 < len(s.token_ids)
    engine = _engine(lambda text: CALL, total=1000, inserted=40)  # the inserted tokens' own cap
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert s.finish_reason == "length" and len(s.dialogue.mask) - sum(s.dialogue.mask) == 40


class Guess:
    """Higher or lower: the secret is the row's; the reward is the environment's."""

    deterministic = True
    made = 0

    def reset(self, row):
        Guess.made += 1
        self.secret, self.tries = row["secret"], 0
        return "Guess my number."

    def step(self, text):
        self.tries += 1
        guess = int(text.split()[-1].rstrip("."))
        if guess == self.secret:
            return "right", True, 1.0
        return ("higher" if guess < self.secret else "lower"), False


def _guesser(text: str) -> str:
    said = [line for line in text.split("\n") if line in ("higher", "lower")]
    return f"I guess {5 + 1 * said.count('higher') - 1 * said.count('lower')}."


def test_an_environment_answers_turns_and_gives_the_reward():
    engine = _engine(_guesser, tools=(), env=Guess)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert TOK.decode(s.dialogue.prompt_ids) == "Q:\nGuess my number."  # reset's first observation joins the prompt
    assert [m["content"] for m in s.dialogue.messages] == ["I guess 5.", "higher", "I guess 6.", "higher", "I guess 7."]
    assert s.dialogue.reward == 1.0 and s.finish_reason == "stop" and len(s.dialogue.starts) == 3


def test_an_environments_stop_strings_end_the_models_turn():
    class OneLine(Guess):
        stop = ("\n",)  # a move is one line: what the model writes after it is not its move

    engine = _engine(lambda text: _guesser(text) + "\nhigher\nI guess 9.", tools=(), env=OneLine)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert [m["content"] for m in s.dialogue.messages] == ["I guess 5.\n", "higher", "I guess 6.\n", "higher", "I guess 7.\n"]
    assert s.dialogue.reward == 1.0
    with pytest.raises(UserError, match="`stop` must be a tuple of non-empty strings"):
        load_env(type("Bare", (Guess,), {"stop": "\n"}))


def test_a_continuation_from_a_turn_replays_the_dialogue_and_calls_the_tools_again():
    calls = []

    def counted(a: int, b: int) -> int:
        """Adds, counted.

        Args:
            a: a number
            b: a number
        """
        calls.append((a, b))
        return a + b

    engine = _engine(lambda text: CALL.replace("add", "counted") if "<tool_response>" not in text else "It is 5.",
                     tools=(counted,))
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert len(calls) == 1
    prompt, boundary = s.dialogue.prompt_ids, len(s.dialogue.prompt_ids)  # the first turn's state: the prompt itself
    (cont,), = engine.continuations(Request([prompt + s.token_ids], [[boundary]], 2, PARAMS,
                                            records=[s.dialogue.record]))
    assert [c.token_ids for c in cont] == [s.token_ids] * 2 and len(calls) == 3  # the same dialogue, tools called again
    # from the second turn: the prefix holds the call and its result; the continuation writes the last turn alone
    (later,), = engine.continuations(Request([prompt + s.token_ids], [[boundary + s.dialogue.starts[1]]], 1, PARAMS,
                                             records=[s.dialogue.record]))
    assert later[0].text == "It is 5." and later[0].dialogue.messages == s.dialogue.messages and len(calls) == 3


def test_a_deterministic_environment_is_rebuilt_and_replayed_and_vine_values_turns():
    engine = _engine(_guesser, tools=(), env=Guess)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    made = Guess.made
    (cont,), = engine.continuations(Request([s.dialogue.prompt_ids + s.token_ids], [[len(s.dialogue.prompt_ids) + s.dialogue.starts[2]]], 1,
                                            PARAMS, records=[s.dialogue.record]))
    assert Guess.made == made + 1 and cont[0].dialogue.messages == s.dialogue.messages and cont[0].dialogue.reward == 1.0
    # VinePPO over turns: a state at every turn; the continuations from each win (the guesser is deterministic)
    ep = _episode(SimpleNamespace(step_turns=True, step_tokens=0), TOK, (0, EX, [], s), 1.0)
    assert ep.steps == [(0, s.dialogue.starts[1]), (s.dialogue.starts[1], s.dialogue.starts[2]), (s.dialogue.starts[2], len(s.token_ids))]
    ctx = CreditContext(rollouts=engine, tokenizer=TOK, score=lambda *a: pytest.fail("the environment rewards"),
                        params=PARAMS, mc_k=2)
    credit = get_estimator("vine")([ep], ctx)
    assert credit.advantages[0].tolist() == [0.0] * len(s.token_ids) and credit.stats["mc/states"] == 3


def test_an_environment_that_raises_stops_with_the_rows_id():
    class Broken(Guess):
        def step(self, text):
            raise KeyError("board")

    engine = _engine(_guesser, tools=(), env=Broken)
    with pytest.raises(RewardError, match="row-1: the environment's step raised KeyError"):
        engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])


def test_vineppo_refuses_an_environment_it_cannot_rebuild_and_bad_tools_are_one_line():
    class Opaque:
        def reset(self, row):
            return ""

        def step(self, text):
            return "", True

    task = SimpleNamespace(agent=AgentSpec({}, Opaque), row=lambda ex: {})
    with pytest.raises(UserError, match="deterministic = True"):
        for_task(Script(_guesser), task, PlainPrompter(), 1.0, resume=True)
    assert isinstance(for_task(Script(_guesser), task, PlainPrompter(), 1.0, resume=False), AgentEngine)

    def bare(x):
        return x

    with pytest.raises(UserError, match="type hints and a docstring"):
        tool_of(bare, "--tools f.py:bare")
    with pytest.raises(UserError, match="an environment needs step"):
        load_env(type("NoStep", (), {"reset": lambda self, row: ""}))
    with pytest.raises(UserError, match="four non-empty parts"):
        Markup.parse("<a>|</a>")


def test_inserted_tokens_get_no_loss_and_no_kl():
    torch.manual_seed(0)
    prompts, responses = [[5, 6]], [[7, 8, 9, 10, 11]]
    masks = [[1, 1, 0, 0, 1]]  # tokens 2 and 3 a tool's
    b = pack(prompts, responses, 0, [torch.ones(5)], masks=masks)
    assert b.mask.tolist() == [[1, 1, 0, 0, 1]]
    logp = torch.randn(1, 5, requires_grad=True)

    def grad(adv, old, ref):
        logp.grad = None
        loss, _ = policy_loss(logp, old, ref, adv, b.mask, Surrogate(kl_coef=0.5))
        loss.backward()
        return logp.grad.clone()

    adv, old, ref = torch.ones(1, 5), logp.detach() - 0.1, logp.detach() + 0.2
    planted = [t.clone() for t in (adv, old, ref)]
    for t, v in zip(planted, (50.0, -9.0, 7.0)):  # anything on the inserted tokens
        t[0, 2:4] = v
    assert torch.equal(grad(adv, old, ref), grad(*planted))
    assert grad(adv, old, ref)[0, 2:4].tolist() == [0.0, 0.0]


def test_inserted_tokens_are_attended_to_when_the_update_shares_prompts():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    prompts, responses = [[5, 6, 7], [5, 6, 7]], [[8, 9, 10, 11, 12, 13], [8, 14, 15]]
    masks = [[1, 1, 0, 0, 1, 1], None]  # tokens 2 and 3 of the first response a tool's: out of the loss, in context
    with torch.no_grad():
        alone, _ = token_logprobs(model, pack(prompts, responses, 0, masks=masks), 1.0)
        shared, _ = token_logprobs(model, pack(prompts, responses, 0, share=True, masks=masks), 1.0)
    assert torch.allclose(shared[0], alone[0], atol=1e-5) and torch.allclose(shared[1, :3], alone[1, :3], atol=1e-5)


def test_tools_and_environments_are_settings_of_a_custom_task_of_the_ppo_family():
    with pytest.raises(UserError, match="setting of --task custom"):
        configs.resolve({}, {"tools": ["t.py:add"]})
    with pytest.raises(UserError, match="PPO-family"):
        configs.resolve({}, {"task": "custom", "model": "m", "algo": "restem", "env": "e.py:Guess"})
    cfg = configs.resolve({}, {"task": "custom", "model": "m", "env": "e.py:Guess"})  # the environment rewards
    assert cfg.max_turns == 4 and json.loads(json.dumps(cfg.tool_markup)).count("|") == 3


TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''

ENV_FILE = '''
class TwoTurns:
    """Answers the first turn with "go on", ends the dialogue after the second: reward 1 for an even length."""

    deterministic = True

    def reset(self, row):
        self.turns = 0
        return ""

    def step(self, text):
        self.turns += 1
        if self.turns < 2:
            return "go on", False
        return "", True, float(len(text) % 2 == 0)
'''

REWARD_FILE = '''
def said_answer(completions, answer, **kwargs):
    return [float(a in m[-1]["content"]) for m, a in zip(completions, answer)]
'''


# Environments only: the tiny arith model answers a prompt that lists tools with digits to the token limit (the
# trainer refuses an iteration whose responses all hit it); tool calls are covered above with a scripted engine.
@pytest.mark.parametrize("algo,kind", [("vineppo", "env"), ("grpo", "env")])
def test_dialogues_train_end_to_end_from_the_command_line(tiny_sft, tmp_path, capsys, algo, kind):
    from vineppo import cli
    from vineppo.tasks import get_task

    torch.set_num_threads(1)
    task = get_task("arith")
    rows = [{"prompt": task.prompt(ex), "answer": ex.answer} for ex in task.load("train", "premature=0", 0)[:40]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    (tmp_path / "game.py").write_text(ENV_FILE)
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    agent = ["--env", f"{tmp_path / 'game.py'}:TwoTurns"] if kind == "env" else \
        ["--tools", f"{tmp_path / 'tools.py'}:add", "--reward", f"{tmp_path / 'rewards.py'}:said_answer"]
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--task", "custom", "--model", str(tiny_sft), "--data", str(tmp_path / "train.jsonl"),
                  "--eval-data", str(tmp_path / "train.jsonl"), "--algo", algo, "--iterations", "2", "--max-turns",
                  "2", "--prompts-per-iter", "4", "--samples-per-prompt", "4", "--max-new-tokens", "64", "--mc-k",
                  "2", "--eval-problems", "4", "--eval-samples", "2", "--out", str(tmp_path / "run"), "--json",
                  "--save-weights-only", "true", *agent])
    assert done.value.code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    it = rows[1]
    assert it["agent/turns"] >= 16 and it["train/trained_tokens"] <= it["train/response_tokens"] * 16
    if kind == "env":  # every dialogue has two turns; the second turn's observation is masked
        assert it["agent/turns"] == 32 and it["train/trained_tokens"] < it["train/response_tokens"] * 16
    if algo == "vineppo":  # a state at each turn start, continued for real
        assert it["mc/agent/turns"] > 0 and it["mc/states"] >= 16
    table = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all(isinstance(r["completion"], list) and r["completion"][0]["role"] == "assistant" for r in table)
    # --save-weights-only: the weights and tokenizer, no optimiser state; eval reads it, a resume refuses it
    ckpt = tmp_path / "run" / "checkpoints" / "iter-000002"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "optimizer.pt").exists()
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--resume", str(tmp_path / "run"), "--iterations", "3"])
    assert done.value.code == 2 and "holds the weights alone" in capsys.readouterr().err


def test_tools_load_from_a_file_by_name_and_a_list_setting_cut_at_commas_keeps_the_file(tmp_path):
    (tmp_path / "t.py").write_text(TOOLS_FILE + TOOLS_FILE.replace("def add", "def plus"))
    spec = f"{tmp_path / 't.py'}:add,plus"
    assert list(load_tools([spec])) == ["add", "plus"]
    assert list(load_tools(configs.resolve({}, {"task": "custom", "model": "m", "reward": ["r.py:f"],
                                                "tools": [spec]}).tools)) == ["add", "plus"]
    with pytest.raises(UserError, match="has no function 'minus'"):
        load_tools([f"{tmp_path / 't.py'}:minus"])


@pytest.mark.parametrize("source", ["examples/calculator/train.yaml", "examples/guess-number/train.yaml", "custom-cpu"])
def test_dialogue_settings_on_a_cpu_cut_the_updates_passes_by_tokens(source):
    """A dialogue is long (the prompt, three turns, tool results): 32 of them in one forward/backward pass took the
    calculator example's process to 18 GB and past 24 GB (killed) by its seventh update. These settings cut the
    update's passes at a token count, so a pass's memory has a bound whatever the dialogues' lengths."""
    root = Path(__file__).resolve().parents[1]
    cfg = (configs.load(root / source) if source.endswith(".yaml") else
           configs.resolve(configs.load_preset(source), {"model": "m", "reward": ["r.py:f"]}))
    assert 0 < cfg.micro_batch_tokens <= 4096
    longest = cfg.max_new_tokens * max(cfg.max_turns, 1) * 2  # the model's turns and as many inserted tokens
    prompts, responses = [[1] * 300] * 64, [[1] * (longest - i) for i in range(64)]
    passes = micro_batches(list(range(64)), prompts, cfg.micro_batch, responses, cfg.micro_batch_tokens)
    assert all(len(p) * (300 + max(len(responses[i]) for i in p)) <= cfg.micro_batch_tokens for p in passes)


def test_the_studys_memory_log_holds_only_named_runs_and_the_report_names_a_bad_line(tmp_path):
    """memory.sh samples each study run of a task by its run name; another `vineppo train` of the task (a probe)
    has none and is left out, and report.py --memory stops on a malformed line with the log's line number."""
    root = Path(__file__).resolve().parents[1]
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)", "vineppo", "train", "--config",
               "examples/calculator/", "--out"]
    procs = [subprocess.Popen(sleeper + [str(tmp_path / out)]) for out in ("probe", "agents/iterations-grpo-s0")]
    log = tmp_path / "rss.log"
    try:
        time.sleep(0.5)
        sampler = subprocess.Popen(["bash", str(root / "results/agents/memory.sh"), str(log), "calculator"])
        time.sleep(2)
        sampler.kill()
    finally:
        for p in procs:
            p.kill()
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["iterations-grpo-s0"] and lines[0].split()[1].isdigit()
    log.write_text(lines[0] + "\n 1234\n")
    done = subprocess.run([sys.executable, str(root / "results/agents/report.py"), "--runs", str(tmp_path),
                           "--out", str(tmp_path), "--memory", str(log)], capture_output=True, text=True)
    assert done.returncode != 0 and f"{log}:2: expected 'RUN KB'" in done.stderr


def test_the_memory_report_keeps_the_filed_runs_a_new_log_does_not_hold(tmp_path):
    """A study continued in a new scratch folder has a new memory.sh log: report.py --memory keeps the samples of
    the runs already in memory-<task>.json that the log lacks, and takes the log's for the runs it holds."""
    root = Path(__file__).resolve().parents[1]
    filed = {"runs": {"iterations-grpo-s0": {"peak_gb": 19.06, "samples_gb": [0.46, 19.06]},
                      "iterations-grpo-s1": {"peak_gb": 9.0, "samples_gb": [9.0]}}}
    (tmp_path / "memory-calculator.json").write_text(json.dumps(filed))
    log = tmp_path / "rss.log"
    log.write_text("iterations-grpo-s1 2000000\niterations-grpo-s2 3500000\niterations-grpo-s2 1000000\n")
    subprocess.run([sys.executable, str(root / "results/agents/report.py"), "--runs", str(tmp_path / "none"),
                    "--out", str(tmp_path), "--memory", str(log)], check=True, capture_output=True)
    runs = json.loads((tmp_path / "memory-calculator.json").read_text())["runs"]
    assert {k: (v["peak_gb"], v["samples_gb"]) for k, v in runs.items()} == {
        "iterations-grpo-s0": (19.06, [0.46, 19.06]), "iterations-grpo-s1": (2.0, [2.0]),
        "iterations-grpo-s2": (3.5, [3.5, 1.0])}


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_the_agent_studys_runner_refuses_a_budget_that_is_not_positive(tmp_path, budget):
    """run.py --budget-s 0 once fell back to GRPO's median seconds (``or``): a budget it was not given."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "results/agents/run.py"), "--scratch", str(tmp_path), "--dry",
                           "--budget-s", budget], capture_output=True, text=True)
    assert done.returncode == 2 and "--budget-s must be > 0" in done.stderr


# ------------------------------------------------------------------ the analyses on dialogues (vineppo.analysis)

WIN = (0.5, 0.5, 0.0)  # the chance that the scripted player's guess on turn 1, 2, 3 is the secret (7)
EXACT = (0.75, 0.5, 0.0)  # so the value at each turn start: V3 = 0, V2 = 1/2 + 1/2 V3, V1 = 1/2 + 1/2 V2


class AnalysisPrompter(PlainPrompter):
    tokenizer = TOK


def _gambler(win: tuple[float, ...], seed: int = 0):
    """A player that guesses 7 on turn t with chance win[t], else 1 (the turn: the answers it has read so far)."""
    import random

    rng = random.Random(seed)

    def turn(text: str) -> str:
        t = sum(line in ("higher", "lower") for line in text.split("\n"))
        return "I guess 7." if rng.random() < win[t] else "I guess 1."

    return turn


def _game_inputs(problems: int = 3, win: tuple[float, ...] = WIN):
    """The analyses' Inputs for the gambler's game: three turns, the environment's reward, no reward function."""
    from vineppo.analysis.values import Inputs

    engine = _engine(_gambler(win), tools=(), env=Guess, max_turns=3)
    task = SimpleNamespace(step_turns=True, step_tokens=0, stop=(), agent=engine.spec, solved=lambda r: r == 1.0,
                           score=lambda *a: pytest.fail("the environment rewards"))
    return Inputs(task, [Example(f"row-{i}", "Q:", "", "") for i in range(problems)], None, "script",
                  AnalysisPrompter(), engine)


def test_analyze_values_on_dialogues_resumes_each_state_at_its_turn():
    """States at turn starts, valued by continuations that resume there: the truth at each turn is the game's exact
    value there (turn 3's exactly 0, so every K is exact there while the group mean is not); a continuation resumed
    at another turn, or an environment not replayed, would give another value."""
    from vineppo.analysis.values import Study, analyze

    got = _game_inputs()
    res = analyze(got.engine, TOK, got.task, got.examples, Study(24, 400, 3, 3, 0, 80), prompter=got.prompter)
    turns = res["per_turn"]
    assert set(turns) == {"0", "1", "2"} and sum(t["states"] for t in turns.values()) == res["states"] == 24
    for t, exact in enumerate(EXACT):
        assert turns[str(t)]["true_mean"] == pytest.approx(exact, abs=0.06)
    assert turns["2"]["true_mean"] == 0.0
    assert [turns["2"]["mae"][m] for m in ("vineppo_k1", "vineppo_k3", "vineppo_k9")] == [0.0, 0.0, 0.0]
    assert turns["2"]["mae"]["grpo"] > 0.4 and res["mae"]["ppo_critic"] is None
    assert res["mae"]["vineppo_k9"] < res["mae"]["vineppo_k1"]
    # step ranking over next turns: each alternative a turn and the environment's answer, valued from there
    assert res["ranking"]["alternatives"] == 9 and res["ranking"]["pairs"] > 0


def test_turn_shares_count_the_policys_tokens_only():
    from vineppo.analysis.turn_credit import distance, turn_shares

    adv = torch.tensor([-1.0, -1.0, -9.0, 0.5, -2.0, 0.0])  # token 2 was inserted (mask 0): not the policy's
    assert turn_shares(adv, [(0, 3), (3, 6)], [1, 1, 0, 1, 1, 1]) == [0.5, 0.5]
    assert turn_shares(adv.abs(), [(0, 3), (3, 6)], [1] * 6) is None  # no negative mass
    assert distance([0.5, 0.5, 0.0], [0.0, 0.25, 0.75]) == pytest.approx(0.75) and distance(None, [1.0]) is None


def test_analyze_credit_on_dialogues_puts_the_truths_blame_on_the_turns_that_lost_value():
    """Every failed game guessed 1, 1, 1: the first guess lost 1/4 of the game's value, the second 1/2, the third
    nothing (V3 = 0 = the reward), so the truth puts 1/3 and 2/3 of the blame on turns 1 and 2 and none on turn 3;
    GRPO blames the three turns alike (their tokens are equal)."""
    from vineppo.analysis.localisation import CreditStudy
    from vineppo.analysis.turn_credit import analyze_turn_credit

    res = analyze_turn_credit(_game_inputs(), CreditStudy(3, 8, 6, 400, 0, 80))
    assert res["analysed"] == {"3 turns": 6} and res["wrong"] >= 6
    shares = [res["summary"][f"turn {t} of 3"] for t in (1, 2, 3)]
    assert [s["truth"]["share"]["mean"] for s in shares] == pytest.approx([1 / 3, 2 / 3, 0.0], abs=0.1)
    assert shares[2]["truth"]["share"]["mean"] == 0.0 and shares[2]["vineppo_k3"]["share"]["mean"] == 0.0
    assert [s["grpo"]["share"]["mean"] for s in shares] == pytest.approx([1 / 3] * 3)
    assert res["distance"]["3 turns"]["truth"]["mean"] == 0.0
    assert res["distance"]["3 turns"]["grpo"]["mean"] == pytest.approx(1 / 3, abs=0.1)
    assert res["overall"]["grpo"] == res["distance"]["3 turns"]["grpo"] and res["wrong_in_one_turn"] == 0
    assert all(row["messages"][-1] == {"role": "user", "content": "higher"} for row in res["rows"])
    # a player that always wins leaves nothing to blame: no rows, no continuations, no crash
    none = analyze_turn_credit(_game_inputs(win=(1.0, 1.0, 1.0)), CreditStudy(2, 4, 6, 8, 0, 80))
    assert none["wrong"] == 0 and none["rows"] == [] and none["analysed"] == {}


def _dialogue_task(tmp_path) -> list[str]:
    """A tiny dialogue task's flags: 8 arith prompts answered in two turns by TwoTurns, which gives the reward."""
    from vineppo.tasks import get_task

    task = get_task("arith")
    rows = [{"prompt": task.prompt(ex), "answer": ex.answer} for ex in task.load("test", "premature=0", 0)[:8]]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "game.py").write_text(ENV_FILE)
    return ["--task", "custom", "--data", str(tmp_path / "test.jsonl"), "--env", f"{tmp_path / 'game.py'}:TwoTurns",
            "--max-turns", "2", "--max-new-tokens", "24", "--device", "cpu"]


def test_analyze_values_runs_on_a_dialogue_task_from_the_command_line(tiny_sft, tmp_path):
    flags = _dialogue_task(tmp_path)
    out = tmp_path / "values"
    done = subprocess.run([sys.executable, "-m", "vineppo", "analyze-values", "--model", str(tiny_sft), *flags,
                           "--states", "8", "--gt-k", "4", "--ranking-states", "1", "--alternatives", "2", "--out",
                           str(out), "--json"], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["states"] == 8 and set(printed["per_turn"]) <= {"0", "1"}
    assert sum(t["states"] for t in printed["per_turn"].values()) == 8
    assert printed["mae"]["vineppo_k3"] is not None and printed["mae"]["ppo_critic"] is None
    assert "MAE per turn" in done.stderr and (out / "values.png").stat().st_size > 0


def test_analyze_credit_runs_on_a_dialogue_task_and_refuses_steps_inside_turns(tiny_sft, tmp_path, capsys):
    from vineppo import cli

    flags = _dialogue_task(tmp_path)
    out = tmp_path / "credit"
    with pytest.raises(SystemExit) as done:
        cli.main(["analyze-credit", "--model", str(tiny_sft), *flags, "--problems", "4", "--samples", "4",
                  "--responses", "3", "--gt-k", "4", "--out", str(out), "--json"])
    assert done.value.code == 0, capsys.readouterr().err[-2000:]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((out / "credit.json").read_text())
    assert summary["responses"] == 16 and summary["wrong"] == saved["wrong"]
    assert sum(summary["analysed"].values()) == min(3, saved["wrong"] - saved["wrong_in_one_turn"])
    assert {"truth", "grpo", "vineppo_k3"} <= set(saved["methods"]) or not summary["analysed"]
    assert (out / "credit.md").read_text().startswith("| dialogues | method |")
    for command in ("analyze-values", "analyze-credit"):
        with pytest.raises(SystemExit) as done:
            cli.main([command, "--model", str(tiny_sft), *flags, "--steps", "lines", "--out", str(tmp_path / "x")])
        assert done.value.code != 0 and "value a dialogue at its turn starts" in capsys.readouterr().err


def test_vinepo_on_a_dialogue_task_refuses_steps_inside_a_turn():
    base = {"task": "custom", "model": "m", "data": "d.jsonl", "env": "game.py:Game"}
    with pytest.raises(UserError, match="--steps: VinePPO continues a dialogue only from the start of a turn"):
        configs.resolve({}, {**base, "algo": "vineppo", "steps": "lines"})
    assert configs.resolve({}, {**base, "algo": "vineppo", "steps": "turns"}).steps == "turns"
    assert configs.resolve({}, {**base, "algo": "grpo", "steps": "lines"}).steps == "lines"  # no continuations


# ------------------------------------------------------------------ the traps a new user met


STOCK = Markup("<stock>", "</stock>", "<result>", "</result>")


def lookup(item: str) -> int:
    """The units of an item in stock.

    Args:
        item: the item's name
    """
    return {"mugs": 4, "cups": 3}[item]


def _stock_turn(text: str) -> str:
    """Writes a call and the start of the result tag it saw in the demo (`</stock><result>`), then the sum."""
    asked = text.count("<result>")
    return ["<stock>mugs</stock><result>", "<stock>cups</stock><result>", "The sum is 7."][asked]


def test_a_call_whose_close_tag_ends_inside_a_merged_token_runs_the_tool():
    """A tokenizer that merges `><` ends the turn on the token `><` (text `</stock><`): the call is found up to its
    close and runs; the `<` stays the policy's. Before, a turn was a call only if its text ended with the close."""
    tok = MergingTokenizer()
    engine = _engine(_stock_turn, tools=(lookup,), markup=STOCK, tokenizer=tok)
    (s,), = engine.generate([tok("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    counts = agents.counts([s])
    assert counts["agent/tool_calls"] == 2 and "agent/bad_calls" not in counts and s.finish_reason == "stop"
    assert [m["content"] for m in s.dialogue.messages if m["role"] == "tool"] == ["4", "3"]
    assert s.dialogue.messages[0]["content"] == "<stock>mugs</stock><"  # the merged token, kept as the policy wrote it
    first = s.dialogue.starts[1]  # the first turn's tokens end with the merged one, the policy's
    assert s.token_ids[:first].count(5) == 1 and s.dialogue.mask[s.token_ids.index(5)] == 1
    assert engine._call_text("<stock>mugs</stock><", None) == "<stock>mugs</stock>"  # a replay runs that call again


def test_a_call_left_open_is_counted_and_the_model_is_told():
    def turn(text):
        return "<stock>mugs" if "<result>" not in text else "Sorry."

    engine = _engine(turn, tools=(lookup,), markup=STOCK)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, PARAMS, examples=[EX])
    assert agents.counts([s])["agent/bad_calls"] == 1 and "agent/tool_calls" not in agents.counts([s])
    told = [m["content"] for m in s.dialogue.messages if m["role"] == "tool"]
    assert len(told) == 1 and "not closed" in told[0] and "</stock>" in told[0]
    assert s.text.endswith("Sorry.") and len(s.dialogue.starts) == 2


class Chatty:
    """A two-turn environment whose observation is longer than the turns: it used to spend the default cap."""

    deterministic = True

    def reset(self, row):
        self.turns = 0
        return ""

    def step(self, text):
        self.turns += 1
        if self.turns == 2:
            return "", True, 1.0
        return "That is a fine first move; now tell me the second one, please.", False


def test_a_two_turn_environment_with_a_short_turn_limit_reaches_its_second_turn_under_the_default_cap():
    """--max-new-tokens 12 --max-turns 2: the default cap counts the policy's 24 tokens, not the environment's 63;
    the observation has its own cap, from the model's context."""
    engine = _engine(lambda text: "move.", tools=(), env=Chatty, max_turns=2)
    (s,), = engine.generate([TOK("Q:")["input_ids"]], 1, dataclasses.replace(PARAMS, max_new_tokens=12),
                            examples=[EX])
    assert len(s.dialogue.starts) == 2 and s.finish_reason == "stop" and s.dialogue.reward == 1.0
    assert "agent/cut_off" not in agents.counts([s])


def test_dialogues_mostly_cut_off_by_a_token_cap_say_so_once_with_the_flag(capsys):
    engine = _engine(lambda text: "x" * 30, tools=(), env=Chatty, max_turns=2)
    for _ in range(2):
        engine.generate([TOK("Q:")["input_ids"]] * 3, 1, dataclasses.replace(PARAMS, max_new_tokens=12),
                        examples=[EX] * 3)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "3 of 3 dialogues were cut off" in err and "--max-new-tokens" in err


def test_an_environment_that_raises_keeps_the_dialogues_finished_before_it():
    class Flaky(Guess):
        def step(self, text):
            if self.secret == 0 and self.tries:  # row-2's second move, in the round where row-1's games end
                raise KeyError("board")
            return super().step(text)

    engine = AgentEngine(Script(_guesser), AgentSpec({}, Flaky), PlainPrompter(),
                         lambda ex: {"secret": 0 if ex.id == "row-2" else 6}, 5.0)
    with pytest.raises(RolloutFault, match="row-2: the environment's step raised KeyError") as fault:
        engine.generate([TOK("Q:")["input_ids"]] * 2, 2, PARAMS, examples=[EX, Example("row-2", "Q:", "", "")])
    assert [len(per) for per in fault.value.finished] == [2, 0]  # row-1's games ended in that round
    assert all(s.dialogue.reward == 1.0 for s in fault.value.finished[0])


# ------------------------------------------------------------------ TRL's environment_factory classes


class IncrementEnv:
    """As TRL 1.16's docs write an environment for `environment_factory`: reset(**kwargs), tools as methods."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        return f" Reach {kwargs['target']}."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def reached_target(environments, target, **kwargs):
    """A reward function as TRL passes them the environments: 1 when the counter is at the row's target."""
    return [float(env.counter == t) for env, t in zip(environments, target)]


def _counter(text: str) -> str:
    said = text.count("<tool_response>")
    return ['<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>',
            '<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call>', "Done."][min(said, 2)]


def _trl_task(env, reward=None, **settings):
    from vineppo.tasks.custom import Settings, make_task

    rows = [{"prompt": "Count.", "target": 3}, {"prompt": "Count.", "target": 2}]
    objects = {"env": env, "data": rows} | ({"reward": [reward]} if reward else {})
    task = make_task(Settings(max_turns=4, **settings), objects)
    return task, task.load("test", "python:data")


def test_a_trl_environment_class_runs_unchanged():
    """Its public methods are the tools, called on each dialogue's own instance; reset(**row)'s text ends the prompt
    as it is; reward functions receive `environments`. Before: refused (no step, reset(row), `environments`)."""
    from vineppo.core.grading import outcome_rewards

    task, examples = _trl_task(IncrementEnv, reached_target)
    assert list(task.agent.tools) == ["increment"] and task.agent.tools["increment"].method
    engine = AgentEngine(Script(_counter), task.agent, PlainPrompter(), task.row, 5.0)
    samples = [per[0] for per in engine.generate([TOK("Count.")["input_ids"]] * 2, 1, PARAMS, examples=examples)]
    assert TOK.decode(samples[0].dialogue.prompt_ids) == "Count. Reach 3."  # TRL appends reset's text as it is
    assert [m["content"] for m in samples[0].dialogue.messages if m["role"] == "tool"] == ["2", "3"]
    assert samples[0].dialogue.env is not samples[1].dialogue.env and samples[0].dialogue.env.counter == 3
    assert outcome_rewards(task.score, examples, samples) == [1.0, 0.0]  # the second row's target was 2


def test_a_trl_environments_get_reward_is_a_reward_of_weight_one_and_vineppo_replays_its_calls():
    class Scored(IncrementEnv):
        deterministic = True  # VinePPO rebuilds it from its row and replays the calls of the earlier turns

        def get_reward(self) -> float:
            return float(self.counter)

    from vineppo.core.grading import outcome_rewards

    task, examples = _trl_task(Scored)
    assert [name for name, _ in task.data.functions()] == ["Scored"]
    engine = for_task(Script(_counter), task, PlainPrompter(), 5.0, resume=True)
    (s,), = engine.generate([TOK("Count.")["input_ids"]], 1, PARAMS, examples=examples[:1])
    assert outcome_rewards(task.score, examples[:1], [s]) == [3.0]
    prompt = s.dialogue.prompt_ids
    (cont,), = engine.continuations(Request([prompt + s.token_ids], [[len(prompt) + s.dialogue.starts[2]]], 1, PARAMS,
                                            records=[s.dialogue.record]))
    assert cont[0].dialogue.env.counter == 3 and cont[0].text == "Done."  # the two calls replayed, then the last turn
    with pytest.raises(UserError, match="has no get_reward"):
        _trl_task(IncrementEnv)  # no reward at all: one line before any model loads


def test_a_misspelled_environment_class_names_the_classes_the_file_defines(tmp_path):
    (tmp_path / "game.py").write_text("def helper():\n    pass\n\n\nclass Game:\n    deterministic = True\n\n"
                                      "    def reset(self, row):\n        return ''\n\n    def step(self, text):\n"
                                      "        return '', True\n")
    with pytest.raises(UserError, match=r"has no class 'Gmae' \(it defines Game\)"):
        load_env(f"{tmp_path / 'game.py'}:Gmae")
