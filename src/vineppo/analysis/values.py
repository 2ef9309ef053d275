"""Value accuracy (`vineppo analyze-values`): how accurate is each method's value of an intermediate state?

The paper's two diagnostics (section 7), on states the policy itself visits:

1. Value error. States are prefixes of the policy's own responses (prompt + first t steps; 8 responses
   per problem, T = 0.6, top-p 0.9, one random state per response). Ground truth V(s) = mean reward of
   `--gt-k` (256) continuations. Each method's estimate is compared with it (mean absolute error):
   - VinePPO with K = 1, 3, 9: means over continuations disjoint from the ground-truth ones (one batched
     job draws gt_k + 13 continuations per state; the first gt_k are the truth, then 1, 3 and 9);
   - the PPO critic of a `vineppo train --algo ppo` run (`--critic RUN`): its output at the last token
     of the state, i.e. the value before the next token;
   - GRPO and RLOO, which in effect give every state of a response one baseline: the mean reward of the
     response's group (GRPO), or of the other responses in the group (RLOO).
2. Step ranking. At a state, `--alternatives` (5) next steps are sampled (a continuation cut after its
   first step, `task.split_steps`) and each one's ground-truth value comes from gt_k rollouts. For
   every pair of alternatives an estimator is right when the sign of its predicted difference equals the
   sign of the true difference; a predicted tie is wrong (so GRPO/RLOO, which predict one value for all
   alternatives, score 0). Pairs whose ground-truth values are exactly equal have no right answer and are
   excluded; their number is reported. An alternative that ends the response (EOS, or truncation) is a
   terminal state: every estimator that looks at the state (VinePPO, the critic) gets its reward, which is
   what PPO's advantage r + V(s') = r uses too.

As in training, a continuation from a state may add only the tokens its response had left
(`--max-new-tokens` less the state's response tokens; cut off: reward 0), and it is graded as the decode
of the whole token sequence (response prefix + continuation).

The ground truth is itself a Monte Carlo mean: with 256 rollouts its standard error is at most
0.5 / 16 = 0.031, so small MAEs (VinePPO K = 9) include that noise floor.

**Dialogues** (a custom task with tools or an environment, `--steps turns`): a response is a dialogue and its steps
are its turns, so a state is the dialogue at the start of one of its turns (t = 0: the prompt, with the
environment's first observation). Every continuation, for the truth and for each K, resumes the dialogue there
through the dialogue engine, as VinePPO's do (vineppo.agents: its tokens and messages, the environment replayed or
copied) and runs to the dialogue's end; each turn may write `--max-new-tokens`, as in training. GRPO, RLOO and
TEMPO are as above (TEMPO's shared prefixes are shared turns). A step-ranking alternative is a next turn: a
continuation cut at its second turn's start (the tool's or environment's answer to the first included), or a
terminal state when the dialogue ended in that turn. The MAE is also reported per turn (`per_turn`).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vineppo.core.distributed import pick_device
from vineppo.core.errors import UserError
from vineppo import agents
from vineppo.core.grading import Scorer, continuation_rewards
from vineppo.core.steps import step_token_ranges, token_char_offsets
from vineppo.credit import next_round
from vineppo.credit.tempo import implied_values
from vineppo.engine import Request, SamplingParams
from vineppo.engine.loading import LoadSpec, load
from vineppo.models.prompts import Prompter
from vineppo.tasks import Example, custom, get_task
from vineppo.training.forward import Critic
from vineppo.training.runs import output_folder
from vineppo.training.trainer import graded_episodes

METHODS = ("vineppo_k1", "vineppo_k3", "vineppo_k9", "ppo_critic", "grpo", "rloo", "tempo")
K_SLICES = (("vineppo_k1", 1), ("vineppo_k3", 3), ("vineppo_k9", 9))  # drawn after the ground truth, in order
EXTRA_K = sum(k for _, k in K_SLICES)  # 13 continuations per state beyond the ground truth
RESPONSES_PER_PROBLEM = 8  # as in training: a group for GRPO/RLOO
TEMPERATURE, TOP_P = 0.6, 0.9  # the training sampling settings


# ------------------------------------------------------------------------------------ pure arithmetic


def mae(pred: list[float], true: list[float]) -> float | None:
    """Mean absolute error; None when there is nothing to compare."""
    if len(pred) != len(true):
        raise ValueError("pred and true differ in length")
    return sum(abs(p - t) for p, t in zip(pred, true)) / len(true) if true else None


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def pairwise_ranking_accuracy(pred: list[float], true: list[float]) -> tuple[int, int, int]:
    """(right, counted, excluded) over all pairs: right when sign(pred diff) == sign(true diff) != 0; true ties excluded."""
    right = counted = excluded = 0
    for i in range(len(true)):
        for j in range(i + 1, len(true)):
            t = _sign(true[i] - true[j])
            if t == 0:  # no right answer: the pair says nothing about the estimator
                excluded += 1
                continue
            counted += 1
            right += _sign(pred[i] - pred[j]) == t  # a predicted tie (sign 0) is never right
    return right, counted, excluded


def mc_estimates(rewards: list[float], gt_k: int) -> dict[str, float]:
    """Ground truth ('true') and VinePPO K = 1, 3, 9 estimates from disjoint slices of one list of rewards."""
    if len(rewards) < gt_k + EXTRA_K:
        raise ValueError(f"need {gt_k + EXTRA_K} rewards, got {len(rewards)}")
    out = {"true": sum(rewards[:gt_k]) / gt_k}
    start = gt_k
    for name, k in K_SLICES:
        out[name] = sum(rewards[start:start + k]) / k
        start += k
    return out


# Adaptive K replayed on the K = 9 slice (so each setting is paired with fixed K = 9 on the same outcomes):
# (name, k_min, rule); K = 9 is the maximum for all.
ADAPTIVE = (("adaptive_agree2", 2, "agree"), ("adaptive_agree3", 3, "agree"), ("adaptive_ci0.25", 2, "ci:0.25"))
K_MAX = 9


def compute_costs(rewards: list[float], tokens: list[int], gt_k: int, est: dict) -> dict[str, tuple[int, int]]:
    """Continuations and tokens each K setting spends on one state; adds the adaptive estimates to `est`."""
    live = any(tokens)  # a terminal state (its reward known) costs no continuation in any setting
    spent, start = {}, gt_k
    for name, k in K_SLICES:
        spent[name] = (k * live, sum(tokens[start:start + k]))
        start += k
    nine = slice(start - K_MAX, start)  # the K = 9 slice
    for name, k_min, rule in ADAPTIVE:
        est[name], n, t = adaptive_estimate(rewards[nine], tokens[nine], K_MAX, k_min, rule)
        spent[name] = (n * live, t)
    return spent


def compute_axis(est: list[dict], spent: list[dict], alt_est: list[dict], alt_sizes: list[int]) -> list[dict]:
    """Per K setting (fixed 1, 3, 9 and adaptive): MAE, step-ranking accuracy and Monte Carlo cost on the states."""
    rows = []
    for name, k_min, rule in [(n, k, "fixed") for n, k in K_SLICES] + list(ADAPTIVE):
        right = counted = 0
        at = 0
        for size in alt_sizes:
            group = alt_est[at:at + size]
            at += size
            r, c, _ = pairwise_ranking_accuracy([e[name] for e in group], [e["true"] for e in group])
            right, counted = right + r, counted + c
        n_cont = sum(s[name][0] for s in spent)
        n_tok = sum(s[name][1] for s in spent)
        rows.append({"method": name, "k_min": k_min, "k_max": K_MAX if rule != "fixed" else k_min, "rule": rule,
                     "mae": mae([e[name] for e in est], [e["true"] for e in est]),
                     "ranking_accuracy": right / counted if counted else None,
                     "continuations_per_state": n_cont / max(len(est), 1), "mc_tokens": n_tok,
                     "tokens_per_state": n_tok / max(len(est), 1)})
    return rows


def group_baselines(group_rewards: list[float], member: int) -> dict[str, float]:
    """The value GRPO and RLOO implicitly give every state of response `member`: group mean, leave-one-out mean."""
    n, total = len(group_rewards), sum(group_rewards)
    rloo = (total - group_rewards[member]) / (n - 1) if n > 1 else 0.0
    return {"grpo": total / n, "rloo": rloo}


# ------------------------------------------------------------------------------------ sampling


@dataclass
class Node:
    """A state: the tokens seq[:boundary], where the prompt is seq[:prompt_len]; `terminal` holds its reward if it ends."""

    seq: list[int]
    boundary: int
    prompt_len: int
    example: Example  # the problem: continuations are scored against it (Task.score)
    terminal: float | None = None
    record: Any = None  # a dialogue's Turns.record: continuations resume the dialogue at this turn start

    def room(self, max_new_tokens: int) -> int:
        """New tokens a continuation may add: what the response it is a prefix of had left (as in training; a
        dialogue's turns each have max_new_tokens, its engine keeps the dialogue's total)."""
        return max_new_tokens if self.record is not None else max_new_tokens - (self.boundary - self.prompt_len)


def sample_states(engine, prompter: Prompter, task, examples: list, n_states: int, params: SamplingParams,
                  generator: torch.Generator, rng: random.Random) -> list[dict]:
    """Up to n_states states, one per sampled response (t uniform in 0..T-1; a dialogue's steps are its turns), with
    the response's group rewards."""
    n_problems = min(len(examples), math.ceil(n_states / RESPONSES_PER_PROBLEM))
    problems = rng.sample(examples, n_problems)
    prompts = [prompter.prompt(ex) for ex in problems]
    outputs = engine.generate(prompts, RESPONSES_PER_PROBLEM, params, generator, examples=problems)
    states = []
    for g, (ex, prompt, samples) in enumerate(zip(problems, prompts, outputs)):
        # as training's episodes: graded in one batch, cut into steps (a dialogue: its turns, its own prompt)
        group = graded_episodes(task, prompter.tokenizer, [(g, ex, prompt, s) for s in samples])
        rewards = [ep.reward for ep in group]
        chosen = [rng.randrange(len(ep.steps)) for ep in group]
        tempo = implied_values(group, [ep.steps[t][0] for ep, t in zip(group, chosen)])
        for m, (ep, t) in enumerate(zip(group, chosen)):
            start = ep.steps[t][0]
            # an empty last step starts at the response's end: the state is the finished response
            finished = rewards[m] if start == len(ep.response_ids) else None
            node = Node(ep.prompt_ids + ep.response_ids, len(ep.prompt_ids) + start, len(ep.prompt_ids), ex, finished,
                        ep.dialogue.record if ep.dialogue is not None else None)
            states.append({"node": node, "problem": ex.id, "t": t, "steps": len(ep.steps), "reward": rewards[m],
                           **group_baselines(rewards, m), "tempo": tempo[m][0], "tempo_shared": tempo[m][1]})
    return states[:n_states]


def sample_alternatives(engine, tokenizer, task, nodes: list[Node], n_alt: int, params: SamplingParams,
                        generator: torch.Generator) -> list[list[Node]]:
    """For each state, n_alt sampled next steps (continuations cut after their first step, a dialogue's after its
    first turn) as new states."""
    if not nodes:
        return []
    conts = engine.continuations(Request([n.seq for n in nodes], [[n.boundary] for n in nodes], n_alt, params,
                                         generator, budgets=[[n.room(params.max_new_tokens)] for n in nodes],
                                         records=records_of(nodes)))
    out = []
    for node, (samples,) in zip(nodes, conts):
        prefix = node.seq[node.prompt_len:node.boundary]
        alts = []
        for s in samples:
            end = first_step_end(task, tokenizer, s)
            state = node.seq[:node.boundary] + list(s.token_ids[:end])
            record = s.dialogue.record if s.dialogue is not None else None  # it resumes at its own turns
            if end == 0:  # a token spans the first step: no state after it to value
                continue
            if end >= len(s.token_ids):  # the first step is the whole continuation: the response ends there
                reward, = continuation_rewards(task.score, tokenizer, prefix, [s], node.example)
                alts.append(Node(state, len(state), node.prompt_len, node.example, reward, record))
            else:
                alts.append(Node(state, len(state), node.prompt_len, node.example, None, record))
        out.append(alts)
    return out


def first_step_end(task, tokenizer, sample) -> int:
    """The end of a continuation's first step in its tokens: a dialogue's second turn start (its first turn and the
    answer to it), else the end of the first of `task.response_steps`."""
    if sample.dialogue is not None:
        starts = sample.dialogue.starts
        return starts[1] if len(starts) > 1 else len(sample.token_ids)
    return step_token_ranges(task.response_steps(sample.text), token_char_offsets(tokenizer, sample.token_ids))[0][1]


def records_of(nodes: list[Node]) -> list | None:
    """The nodes' dialogue records for Request.records (a multi-turn engine resumes each from its own), or None."""
    return [n.record for n in nodes] if any(n.record is not None for n in nodes) else None


def rollout_rewards(engine, tokenizer, score: Scorer, nodes: list[Node], k: int,
                    params: SamplingParams, generator: torch.Generator,
                    progress: Callable[[int, int], None] | None = None) -> tuple[list[list[float]], list[list[int]]]:
    """k continuation rewards and token counts per state from ONE batched engine job; a terminal state gets its
    reward k times, at no token cost."""
    live = [i for i, n in enumerate(nodes) if n.terminal is None]
    conts = engine.continuations(Request([nodes[i].seq for i in live], [[nodes[i].boundary] for i in live], k, params,
                                         generator, progress, [[nodes[i].room(params.max_new_tokens)] for i in live],
                                         records=records_of([nodes[i] for i in live]))) if live else []
    out = [[n.terminal] * k if n.terminal is not None else None for n in nodes]
    tokens = [[0] * k for _ in nodes]
    for i, (samples,) in zip(live, conts):
        prefix = nodes[i].seq[nodes[i].prompt_len:nodes[i].boundary]
        out[i] = continuation_rewards(score, tokenizer, prefix, samples, nodes[i].example)
        tokens[i] = [len(s.token_ids) for s in samples]
    return out, tokens


def adaptive_estimate(rewards: list[float], tokens: list[int], k_max: int, k_min: int, rule: str) -> tuple[float, int, int]:
    """(estimate, continuations, tokens) of adaptive K replayed on a sequence of i.i.d. outcomes, round by round.

    Drawing the outcomes first and consuming them in order is distributed exactly as sampling round by round.
    """
    n = min(k_min, k_max)
    while (extra := next_round(rewards[:n], k_max, k_min, rule)) > 0:
        n += extra
    return sum(rewards[:n]) / n, n, sum(tokens[:n])


# ------------------------------------------------------------------------------------ the analysis


@dataclass
class Study:
    """The size of one value study (`vineppo analyze-values`)."""

    states: int = 64  # states sampled for the value MAE
    gt_k: int = 256  # Monte Carlo rollouts per state for the ground truth
    ranking_states: int = 16  # states whose next steps are ranked
    alternatives: int = 5  # alternative next steps per ranked state
    seed: int = 0  # states, alternatives and rollouts
    max_new_tokens: int = 1024  # response and rollout length cap


def analyze(engine, tokenizer, task, examples: list, study: Study = Study(),
            critic_values: Callable[[list[Node]], list[float]] | None = None,
            progress: Callable[[int, int], None] | None = None, prompter: Prompter | None = None) -> dict:
    """Value MAE and step-ranking accuracy of every method against Monte Carlo ground truth (see module doc)."""
    states, gt_k, ranking_states, alternatives = study.states, study.gt_k, study.ranking_states, study.alternatives
    seed, max_new_tokens = study.seed, study.max_new_tokens
    rng = random.Random(seed)
    gen = torch.Generator(device=getattr(engine, "device", "cpu")).manual_seed(seed)
    params = SamplingParams(TEMPERATURE, TOP_P, max_new_tokens, tuple(task.stop))
    t0 = time.perf_counter()
    picked = sample_states(engine, prompter or Prompter(task, tokenizer), task, examples, states, params, gen, rng)
    live = [i for i, s in enumerate(picked) if s["node"].terminal is None]  # a finished response has no next step
    ranked = sorted(rng.sample(live, min(ranking_states, len(live))))
    alts = sample_alternatives(engine, tokenizer, task, [picked[i]["node"] for i in ranked], alternatives, params, gen)

    # One Monte Carlo job for every state and every alternative: the engine batches and shares prefixes.
    nodes = [s["node"] for s in picked] + [a for group in alts for a in group]
    k = gt_k + EXTRA_K
    total = k * sum(n.terminal is None for n in nodes)
    t1 = time.perf_counter()
    rewards, tokens = rollout_rewards(engine, tokenizer, task.score, nodes, k, params, gen,
                                      (lambda done, tokens: progress(done, total)) if progress else None)
    t2 = time.perf_counter()
    est = [mc_estimates(r, gt_k) for r in rewards]
    spent = [compute_costs(r, t, gt_k, e) for r, t, e in zip(rewards, tokens, est)]  # adds adaptive estimates to e
    critic = critic_values(nodes) if critic_values else [None] * len(nodes)
    for i, n in enumerate(nodes):
        # A terminal state's value is its reward, for the critic as for PPO's advantage r + V(s') = r.
        est[i]["ppo_critic"] = n.terminal if n.terminal is not None else critic[i]

    rows = []
    for s, e in zip(picked, est):
        rows.append({"problem": s["problem"], "t": s["t"], "steps": s["steps"], "reward": s["reward"],
                     "true": e["true"], **{m: e[m] for m in METHODS if m.startswith("vineppo") or m == "ppo_critic"},
                     "grpo": s["grpo"], "rloo": s["rloo"], "tempo": s["tempo"], "tempo_shared": s["tempo_shared"]})
    ranking, counted, excluded = _ranking(picked, ranked, alts, est, with_critic=critic_values is not None)
    compute = compute_axis(est[:len(picked)], spent[:len(picked)], est[len(picked):], [len(g) for g in alts])
    dialogues = any(s["node"].record is not None for s in picked)
    return {"mae": method_maes(rows), "truth_se": truth_se(rows, gt_k),
            **({"per_turn": per_turn(rows, gt_k)} if dialogues else {}),
            "ranking_accuracy": ranking, "states": len(rows), "compute": compute,
            "tempo_shared_states": sum(r["tempo_shared"] for r in rows) / max(len(rows), 1),
            "ranking": {"states": len(ranked), "alternatives": sum(len(g) for g in alts),
                        "pairs": counted, "pairs_excluded_true_tie": excluded},
            "settings": {"gt_k": gt_k, "alternatives": alternatives, "seed": seed, "temperature": TEMPERATURE,
                         "top_p": TOP_P, "max_new_tokens": max_new_tokens,
                         "responses_per_problem": RESPONSES_PER_PROBLEM},
            "timing": {"sampling_s": t1 - t0, "monte_carlo_s": t2 - t1, "continuations": total,
                       "seconds_per_state": (t2 - t1) / max(total // k, 1)},
            "rows": rows}


def method_maes(rows: list[dict]) -> dict[str, float | None]:
    """Each method's MAE against the rows' truth; None for a method without an estimate (no --critic)."""
    truth = [r["true"] for r in rows]
    return {m: None if any(r[m] is None for r in rows) else mae([r[m] for r in rows], truth) for m in METHODS}


def truth_se(rows: list[dict], gt_k: int) -> float | None:
    """The mean standard error of the rows' truths (binomial, sqrt(v (1 - v) / gt_k)): the MAEs' noise floor."""
    return sum(math.sqrt(r["true"] * (1 - r["true"]) / gt_k) for r in rows) / len(rows) if rows else None


def per_turn(rows: list[dict], gt_k: int) -> dict[str, dict]:
    """Per turn index (t, 0 = the prompt), the states there, their mean true value, its noise and each method's MAE."""
    out = {}
    for t in sorted({r["t"] for r in rows}):
        at = [r for r in rows if r["t"] == t]
        out[str(t)] = {"states": len(at), "true_mean": sum(r["true"] for r in at) / len(at),
                       "truth_se": truth_se(at, gt_k), "mae": method_maes(at)}
    return out


# ------------------------------------------------------------------------------------ the critic


def _ranking(picked: list[dict], ranked: list[int], alts: list[list], est: list[dict],
             with_critic: bool) -> tuple[dict, int, int]:
    """Per method, the share of alternative pairs it orders as the truth does; the pairs counted and excluded."""
    right = dict.fromkeys(METHODS, 0)
    counted = excluded = 0
    offset = len(picked)  # the alternatives of state i are est[offset : offset + len(alts[i])]
    for i, group in zip(ranked, alts):
        e = est[offset:offset + len(group)]
        offset += len(group)
        true = [x["true"] for x in e]
        for m in METHODS:
            if m in ("grpo", "rloo", "tempo"):
                pred = [picked[i][m]] * len(group)  # one value for every next step: none of them is in the group
            elif m == "ppo_critic" and not with_critic:
                continue
            else:
                pred = [x[m] for x in e]
            r, c, x = pairwise_ranking_accuracy(pred, true)
            right[m] += r
            if m == "grpo":  # every method sees the same pairs; count them once
                counted, excluded = counted + c, excluded + x
    ranking = {m: (right[m] / counted if counted else None) if (m != "ppo_critic" or with_critic) else None
               for m in METHODS}
    return ranking, counted, excluded


def load_critic(run_dir: str, device: torch.device):
    """(critic, checkpoint folder) from a PPO run folder: RUN/checkpoints/<latest>/critic.pt on the policy's body."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        raise UserError(f"--critic {run_dir}: no checkpoints/latest (not a finished `vineppo train` run folder)")
    ckpt = pointer.parent / pointer.read_text().strip()
    if not (ckpt / "critic.pt").is_file():
        raise UserError(f"--critic {run_dir}: {ckpt} has no critic.pt (was it trained with --algo ppo?)")
    critic = Critic.from_pretrained(str(ckpt), device)
    critic.load_state_dict(torch.load(ckpt / "critic.pt", map_location=device)["critic"])
    return critic.eval(), ckpt


def critic_state_values(critic, pad_id: int) -> Callable[[list[Node]], list[float]]:
    """A function giving V(seq[:boundary]) per state: the critic's output at the state's last token."""

    def values(nodes: list[Node]) -> list[float]:
        # Critic.values returns the value before each response token; a one-token dummy "response" after the
        # state gives exactly the value before the next token (attention is causal, the dummy is never seen).
        out = critic.values([n.seq[:n.boundary] for n in nodes], [[pad_id]] * len(nodes), pad_id)
        return [float(v[0]) for v in out]

    return values


@dataclass
class Inputs:
    """What an analysis command works on: the task's examples, the critic (or None), the policy, its engine."""

    task: Any
    examples: list
    critic: Any
    model_dir: str
    prompter: Prompter
    engine: Any


def load_inputs(args: argparse.Namespace, out: Path, model_dir_of: Callable[[Path | None], str | None]) -> Inputs:
    """The data, the critic of --critic, and the policy named by model_dir_of(the critic's checkpoint), loaded
    inside `out`'s folder guard (removed again if any of them fails to load); for a task with tools or an
    environment, the engine runs dialogues and resumes them at their turns (vineppo.agents, as VinePPO's)."""
    with output_folder(out, f"--out {out}"):
        custom.check_reward(args)
        task = get_task(args.task, args)
        if task.agent is not None and not task.step_turns:
            raise UserError("--steps: the analyses value a dialogue at its turn starts, the only places a continuation "
                            "can resume it; leave --steps out (or --steps turns) with --tools or --env")
        examples = task.load(args.split, args.data, args.data_seed)
        if not examples:
            raise UserError(f"task {args.task!r} split {args.split!r}: the data set is empty")
        device = pick_device(args.device)
        critic, ckpt = load_critic(args.critic, device) if args.critic else (None, None)
        model_dir = model_dir_of(ckpt)
        if model_dir is None:
            raise UserError("--model is required (or --critic RUN_DIR, whose latest policy is then used)")
        got = load(LoadSpec(model_dir, task, args.prompt_format, args.data, args.data_seed, str(device),
                            engine=args.engine, token_budget=args.token_budget))
        timeout = args.reward_timeout_s if getattr(args, "reward_timeout_s", None) is not None else 60.0
        engine = agents.for_task(got.engine, task, got.prompter, timeout, resume=True)
    return Inputs(task, examples, critic, model_dir, got.prompter, engine)
