"""Credit over turns (`vineppo analyze-credit` on a task with tools or an environment): when a dialogue fails, which
of its turns does each estimator's advantage blame, and which does the truth blame?

The responses are dialogues and their steps are their turns (`--steps turns`). A dialogue *fails* when its reward
does not solve it (`task.solved`); one that failed in its first turn has no turns to tell apart and is counted, not
analysed. For up to `--responses` failed dialogues of two turns or more (`round_robin` over the problems, from
`--samples` dialogues to each of `--problems` problems at the training temperature), every method's per-token
advantages, un-whitened, as training computes them (`localisation.advantages`): VinePPO with K = 1, 3, 9 and adaptive
K (3 to 9, agree), GRPO, RLOO, TEMPO, PPO's critic with GAE (lambda 1, with `--critic`), and the **truth**: VinePPO
with `--gt-k` continuations from every turn start. A continuation resumes the dialogue at its turn, the environment
replayed or copied (vineppo.agents). Over turns, VinePPO's advantage of turn t is V(s_t+1) - V(s_t) (the last turn's:
r - V(s_T-1)): how much the game's value fell over the turn, its tool's or environment's answer included.

Per dialogue and method, on the policy's own tokens (a tool's or the environment's tokens are not trained):

- share[t]: the part of the dialogue's negative advantage mass (the sum over tokens of min(A, 0)) on turn t's tokens;
  none when no token is negative. GRPO's and RLOO's is each turn's share of the policy's tokens, by construction.
- distance: half the L1 distance between the method's shares and the truth's, 0 when it blames the turns in the
  truth's proportions, 1 when it blames only turns the truth does not; none when either has no negative mass.

Dialogues of different lengths are summarised apart (`T turns`): the mean ± standard error of each turn's share and
of the distance; the distance also over every analysed dialogue (`overall`). The truth is a Monte Carlo mean too:
with few continuations its shares carry noise of their own.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from vineppo.analysis.localisation import CreditStudy, advantages, mean_se, round_robin, sample_episodes
from vineppo.analysis.values import TEMPERATURE, TOP_P, Inputs
from vineppo.credit import CreditContext, Episode
from vineppo.engine import SamplingParams


def turn_shares(adv: torch.Tensor, turns: list[tuple[int, int]], mask: list[int]) -> list[float] | None:
    """Each turn's part of the negative advantage mass over the policy's tokens (mask 1); None when there is none."""
    negative = adv.clamp(max=0) * torch.tensor(mask, dtype=adv.dtype)
    total = float(negative.sum())
    if total >= 0:
        return None
    return [float(negative[s:e].sum()) / total + 0.0 for s, e in turns]  # + 0.0: a turn without any is 0.0, not -0.0


def distance(shares: list[float] | None, truth: list[float] | None) -> float | None:
    """Half the L1 distance between two share vectors (total variation); None when either is missing."""
    if shares is None or truth is None:
        return None
    return sum(abs(a - b) for a, b in zip(shares, truth)) / 2


def failed(episodes: list[Episode], task, per: int) -> list[int]:
    """Up to `per` failed dialogues (reward not solving them) of two turns or more, `round_robin` over the problems."""
    return [i for i in round_robin(episodes) if not task.solved(episodes[i].reward) and len(episodes[i].steps) > 1][:per]


def summarise(rows: list[dict], methods: list[str]) -> tuple[dict, dict]:
    """Per `turn t of T` and method the mean share; per `T turns` and method the mean distance to the truth."""
    shares, distances = {}, {}
    for n in sorted({r["turns"] for r in rows}):
        group = [r for r in rows if r["turns"] == n]
        distances[f"{n} turns"] = {m: mean_se([r[m]["distance"] for r in group]) for m in methods}
        for t in range(n):
            shares[f"turn {t + 1} of {n}"] = {m: {"share": mean_se([r[m]["share"][t] if r[m]["share"] else None
                                                                    for r in group])} for m in methods}
    return shares, distances


def analyze_turn_credit(got: Inputs, study: CreditStudy = CreditStudy(), progress=None) -> dict:
    """Sample dialogues of `got`'s engine (a dialogue engine), take the failed ones, score every method per turn
    against the truth (see the module doc); the result is JSON-ready."""
    task = got.task
    gen = torch.Generator(device=getattr(got.engine, "device", "cpu")).manual_seed(study.seed)
    t0 = time.perf_counter()
    episodes, _ = sample_episodes(got.engine, got.prompter, task, got.examples, study, gen)
    chosen = failed(episodes, task, study.responses)
    params = SamplingParams(TEMPERATURE, TOP_P, study.max_new_tokens, tuple(task.stop))
    ctx = CreditContext(rollouts=got.engine, tokenizer=got.prompter.tokenizer, score=task.score, params=params,
                        mc_max_states=25)
    t1 = time.perf_counter()
    # no failed dialogue: nothing to blame, and no continuation to draw
    adv = advantages(episodes, chosen, ctx, study.gt_k, study.seed, got.critic, progress) if chosen else {}
    t2 = time.perf_counter()
    rows = []
    for j, i in enumerate(chosen):
        ep = episodes[i]
        mask = ep.dialogue.mask
        row = {"episode": i, "problem": ep.example.id, "reward": ep.reward, "turns": len(ep.steps),
               "policy_tokens": [sum(mask[s:e]) for s, e in ep.steps], "messages": ep.dialogue.messages}
        truth = turn_shares(adv["truth"][j], ep.steps, mask)
        for name, per in adv.items():
            shares = turn_shares(per[j], ep.steps, mask)
            row[name] = {"share": shares, "distance": distance(shares, truth)}
        rows.append(row)
    methods = list(adv)
    shares, distances = summarise(rows, methods)
    return {"summary": shares, "distance": distances, "overall": {m: mean_se([r[m]["distance"] for r in rows])
                                                                   for m in methods},
            "methods": methods, "responses": len(episodes), "wrong": sum(not task.solved(ep.reward) for ep in episodes),
            "wrong_in_one_turn": sum(not task.solved(ep.reward) and len(ep.steps) == 1 for ep in episodes),
            "analysed": {label: sum(f"{r['turns']} turns" == label for r in rows) for label in distances},
            "settings": {**asdict(study), "temperature": TEMPERATURE, "top_p": TOP_P},
            "timing": {"sampling_s": t1 - t0, "advantages_s": t2 - t1}, "rows": rows}
