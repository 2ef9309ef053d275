"""Benchmark of dialogue rollouts: what rounds of turns and VinePPO's replays cost over single-turn sampling.

    python benchmarks/dialogue.py [--json] [--model DIR|FILE.gguf|pkg:NAME] [--prompts 8] [--samples 4]
                                  [--turns 3] [--max-new-tokens 32] [--mc-k 2] [--repeats 3] [--threads N]

Workload: `--prompts` arith problems in the model's prompt format (vineppo.models.prompts), `--samples` dialogues
each (T 0.6, top-p 0.9) with an environment that answers every turn with the same short observation ("Go on.",
a user turn of the chat template) and never ends a dialogue, so each runs `--turns` turns of at most
`--max-new-tokens` tokens (a turn ends at a line break, the environment's `stop`, or at its end-of-turn token; a
turn cut off at its limit ends its dialogue). It is run two ways, alternating, `--repeats` times after one
warm-up run of both (not recorded), and each reports the policy's generated tokens per second (median over the
repeats):

- dialogues: `AgentEngine.generate` (vineppo.agents): a round per turn, each round one engine job over the
  dialogues whose turn is due, the environment's answers inserted between rounds;
  single: the same model and engine sampling one turn per dialogue from its prompt, each row's budget the number
  of tokens the policy wrote in that dialogue (the same tokens, minus what an end-of-turn token cuts short);
- replays: `AgentEngine.continuations` from every turn start of the dialogues, `--mc-k` each (VinePPO's states
  over turns: each replays the dialogue up to the turn, environment included, then goes on round by round);
  single: the inner engine's continuations from the same token prefixes, each with the tokens the policy had
  left in its dialogue, in one job.

`ratio` is dialogue tokens/s over single tokens/s: the cost of rounds (a fresh job and prefill per turn) and of
replays, as a number. Without `--model`: the shipped arith SFT model (src/vineppo/assets/sft-arith).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import set_threads
from shapes import versions

from vineppo.agents import AgentEngine
from vineppo.engine import Engine, Request, SamplingParams
from vineppo.models.causal_lm import load_model, seeded_generator
from vineppo.models.prompts import Prompter
from vineppo.tasks import get_task
from vineppo.tasks.agent import AgentSpec, Markup

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = "src/vineppo/assets/sft-arith"  # from the repository root


class GoOn:
    """An environment that answers every turn with the same observation and never ends the dialogue."""

    deterministic = True
    stop = ("\n",)  # a turn is a line

    def reset(self, row):
        return ""

    def step(self, text):
        return "Go on.", False


@dataclasses.dataclass
class Setup:
    """The model's engines, the prompts and their examples, the sampling settings."""

    inner: Engine
    agent: AgentEngine
    prompts: list[list[int]]
    examples: list
    params: SamplingParams
    samples: int
    mc_k: int


def setup(args: argparse.Namespace) -> Setup:
    """The model, the arith prompts in its format, the native engine and the dialogue engine over it."""
    path = str(ROOT / args.model) if args.model == SHIPPED else args.model
    model, tok = load_model(path, device="cpu", verbose=False)
    task = get_task("arith")
    prompter = Prompter(task, tok, model=path)
    examples = task.load("train", None, 0)[: args.prompts]
    inner = Engine(model, tok)
    spec = AgentSpec({}, GoOn, args.turns, 0, "plain", Markup())
    agent = AgentEngine(inner, spec, prompter, lambda ex: {"id": ex.id})
    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=args.max_new_tokens)
    return Setup(inner, agent, [prompter.prompt(ex) for ex in examples], examples, params, args.samples, args.mc_k)


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def policy_tokens(samples) -> int:
    """The tokens the policy wrote in dialogues (their mask), or in single-turn samples (all of them)."""
    return sum(sum(s.dialogue.mask) if s.dialogue is not None else len(s.token_ids) for s in samples)


def dialogues_once(st: Setup, seed: int) -> tuple[dict, dict, list]:
    """One run of the dialogue workload and of its single-turn twin: their tokens and seconds, and the dialogues."""
    g = seeded_generator(st.inner.model, seed)
    secs, out = timed(lambda: st.agent.generate(st.prompts, st.samples, st.params, generator=g, examples=st.examples))
    flat = [s for per in out for s in per]
    rows = [p for p in st.prompts for _ in range(st.samples)]
    budgets = [[max(1, sum(s.dialogue.mask))] for s in flat]
    req = Request(rows, [[len(p)] for p in rows], 1, dataclasses.replace(st.params, max_new_tokens=max(
        b[0] for b in budgets)), seeded_generator(st.inner.model, seed), budgets=budgets)
    single_s, single = timed(lambda: st.inner.continuations(req))
    return ({"seconds": secs, "tokens": policy_tokens(flat), "inserted_tokens": sum(
                len(s.dialogue.mask) - sum(s.dialogue.mask) for s in flat),
             "turns": sum(len(s.dialogue.starts) for s in flat), "dialogues": len(flat)},
            {"seconds": single_s, "tokens": policy_tokens(x for r in single for c in r for x in c)}, flat)


def replays_once(st: Setup, dialogues: list, seed: int) -> tuple[dict, dict]:
    """VinePPO's continuations from every turn start of `dialogues`, by the dialogue engine and by single turns."""
    seqs = [s.dialogue.prompt_ids + s.token_ids for s in dialogues]
    bounds = [[len(s.dialogue.prompt_ids) + t for t in s.dialogue.starts] for s in dialogues]
    req = Request(seqs, bounds, st.mc_k, st.params, seeded_generator(st.inner.model, seed),
                  records=[s.dialogue.record for s in dialogues])
    secs, out = timed(lambda: st.agent.continuations(req))
    cap = st.params.max_new_tokens * st.agent.spec.max_turns  # the policy's tokens a dialogue may write
    budgets = [[max(1, cap - sum(s.dialogue.mask[:t])) for t in s.dialogue.starts] for s in dialogues]
    single_req = Request(seqs, bounds, st.mc_k, dataclasses.replace(st.params, max_new_tokens=cap),
                         seeded_generator(st.inner.model, seed), budgets=budgets)
    single_s, single = timed(lambda: st.inner.continuations(single_req))
    return ({"seconds": secs, "tokens": policy_tokens(x for r in out for c in r for x in c),
             "continuations": sum(len(c) for r in out for c in r)},
            {"seconds": single_s, "tokens": policy_tokens(x for r in single for c in r for x in c)})


def summary(runs: list[tuple[dict, dict]]) -> dict:
    """Median tokens/s of each side over the repeats, their ratio, and every run."""
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    agent, single = statistics.median(rate(a) for a, _ in runs), statistics.median(rate(s) for _, s in runs)
    return {"dialogue_tokens_per_s": agent, "single_tokens_per_s": single, "ratio": agent / single,
            "ratios": [rate(a) / rate(s) for a, s in runs], "runs": [{"dialogue": a, "single": s} for a, s in runs]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SHIPPED, help="a model folder, .gguf file or pkg:NAME (default: the shipped "
                                                     "arith SFT model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="dialogues per prompt")
    ap.add_argument("--turns", type=int, default=3, help="turns per dialogue")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens of one turn")
    ap.add_argument("--mc-k", type=int, default=2, help="continuations from each turn start")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    torch.manual_seed(0)
    st = setup(args)
    rounds, replays = [], []
    for rep in range(args.repeats + 1):  # the first is a warm-up, not recorded
        agent, single, flat = dialogues_once(st, rep)
        replay = replays_once(st, flat, rep)
        if rep:
            rounds.append((agent, single))
            replays.append(replay)
        rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
        print(f"{'repeat ' + str(rep) if rep else 'warm-up'}: dialogues {rate(agent):.1f} tok/s, single "
              f"{rate(single):.1f}; replays {rate(replay[0]):.1f}, single {rate(replay[1]):.1f}", file=sys.stderr)
    res = {"command": "python benchmarks/dialogue.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": args.model, "threads": threads, "prompts": args.prompts, "samples": args.samples,
           "turns": args.turns, "max_new_tokens": args.max_new_tokens, "mc_k": args.mc_k, "repeats": args.repeats,
           "versions": versions(), "dialogues": summary(rounds), "replays": summary(replays)}
    print(json.dumps(res) if args.json else json.dumps({k: v for k, v in res.items() if k != "versions"}, indent=1))


if __name__ == "__main__":
    main()
