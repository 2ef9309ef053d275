"""Credit localisation (`vineppo analyze-credit`): when a response is wrong because of one line, whose advantages point at it?

Group baselines (GRPO, RLOO) give every token of a response one advantage, so a wrong response's right lines
are pushed down with its wrong one; VinePPO values every step from continuations, so its advantage should
fall on the step that went wrong. This measures that on a fixed set of responses sampled from one model (its
`--samples` per problem at the training temperature, T 0.6, top-p 0.9), using the estimators training uses.

Each wrong `arith` response is read against its problem's chain (`arith.first_wrong_line`): the first line
that departs from a right solution is the *bad line*. Its label is `behaviour` when that line is an
unreliable behaviour's (a premature `####` answer, or a line that skips an operation) and `slip` when a
careful line's operation is right and its result is not; other first errors are counted, not analysed.
For up to `--responses` responses per label, every method's per-token advantages, un-whitened:
VinePPO (`vine`) with K = 1, 3, 9 and adaptive K (3 to 9, agree), GRPO, RLOO, PPO's critic with GAE
(lambda 1, a `vineppo train --algo ppo` run's critic, with `--critic`), and the truth: `vine` with `--gt-k`
continuations per state. Per response and method:

- share: the part of the response's negative advantage mass (the sum over tokens of min(A, 0)) that lies
  on the bad line's tokens; none when no token is negative. For GRPO and RLOO it is the line's share of the
  response's tokens, by construction.
- before: the mean, over the right lines before the bad one, of the line's mean token advantage (0 is right:
  those lines did nothing wrong); none when the bad line is the first.

A line's tokens are those whose first character lies in it (from its first character to the next non-blank
line; tokens after the text, EOS, belong to the last line). The paper's step splitter joins the `####` line
to the last step, so a premature answer shares its step, and VinePPO's advantage, with the line before it:
VinePPO's share on a premature line is at most that line's part of the step's tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch

from vineppo.analysis.values import TEMPERATURE, TOP_P
from vineppo.core.steps import step_token_ranges, token_char_offsets
from vineppo.credit import CreditContext, Episode, get_estimator
from vineppo.engine import SamplingParams
from vineppo.models.prompts import Prompter
from vineppo.tasks.arith import first_wrong_line
from vineppo.training.trainer import graded_episodes

LABELS = {"premature": "behaviour", "skip": "behaviour", "slip": "slip"}  # first-error kind -> analysed label
VINE = (("vineppo_k1", 1, 0), ("vineppo_k3", 3, 0), ("vineppo_k9", 9, 0), ("vineppo_adaptive", 9, 3))


def line_token_ranges(text: str, offsets: list[int]) -> list[tuple[int, int]]:
    """Token ranges [start, end) of the non-blank lines of `text`, from each token's first character offset: each
    line runs to the next non-blank line (text before the first joins it), cut by `steps.step_token_ranges`."""
    starts, pos = [], 0
    for line in text.split("\n"):
        if line.strip():
            starts.append(pos)
        pos += len(line) + 1
    if not starts:
        return []
    cuts = [0] + starts[1:] + [len(text)]
    return step_token_ranges([text[a:b] for a, b in zip(cuts, cuts[1:])], offsets)


def localisation(adv: torch.Tensor, lines: list[tuple[int, int]], bad: int) -> dict[str, float | None]:
    """{'share', 'before'} of one response's advantages (see the module doc) with bad line index `bad`."""
    negative = adv.clamp(max=0)
    total = float(negative.sum())
    s, e = lines[bad]
    share = float(negative[s:e].sum()) / total if total < 0 else None
    means = [float(adv[a:b].mean()) for a, b in lines[:bad] if b > a]
    return {"share": share, "before": sum(means) / len(means) if means else None}


def mean_se(values: list[float | None]) -> dict[str, float | int | None]:
    """Mean, standard error and count of the values that are not None."""
    x = [v for v in values if v is not None]
    if not x:
        return {"mean": None, "se": None, "n": 0}
    m = sum(x) / len(x)
    se = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) if len(x) > 1 else None
    return {"mean": m, "se": se, "n": len(x)}


@dataclass
class CreditStudy:
    """The size of one localisation study (`vineppo analyze-credit`)."""

    problems: int = 128  # test problems sampled
    samples: int = 8  # responses per problem: one group, as in training
    responses: int = 48  # wrong responses analysed per label (behaviour, slip), at most
    gt_k: int = 256  # continuations per state for the truth
    seed: int = 0  # problems, responses and continuations
    max_new_tokens: int = 160  # response and continuation length cap


def sample_episodes(engine, prompter: Prompter, task, examples: list, study: CreditStudy,
                    generator: torch.Generator) -> tuple[list[Episode], list]:
    """`study.samples` responses (or dialogues) to each of the first `study.problems` examples, as training's episodes."""
    problems = examples[: study.problems]
    prompts = [prompter.prompt(ex) for ex in problems]
    params = SamplingParams(TEMPERATURE, TOP_P, study.max_new_tokens, tuple(task.stop))
    outputs = engine.generate(prompts, study.samples, params, generator, examples=problems)
    drawn = [(g, ex, prompt, s) for g, (ex, prompt, samples) in enumerate(zip(problems, prompts, outputs))
             for s in samples]
    return graded_episodes(task, prompter.tokenizer, drawn), [ex for _, ex, _, _ in drawn]


def round_robin(episodes: list[Episode]) -> list[int]:
    """The episodes' indices, the first response of every problem first, then the second, ...: a study that takes
    the first few that qualify spreads over many problems."""
    rank, seen = [], {}  # per episode: its place among its group's responses
    for ep in episodes:
        rank.append(seen.get(ep.group, 0))
        seen[ep.group] = rank[-1] + 1
    return sorted(range(len(episodes)), key=lambda i: (rank[i], episodes[i].group))


def pick(episodes: list[Episode], owners: list, per_label: int) -> tuple[list[dict], dict[str, int]]:
    """The analysed responses (index, label, bad line, kind), up to per_label per label, and the count of every
    first-error kind among the wrong responses, taken `round_robin` over the problems."""
    kinds: dict[str, int] = {}
    chosen, taken = [], dict.fromkeys(set(LABELS.values()), 0)
    for i in round_robin(episodes):
        ep, ex = episodes[i], owners[i]
        if ep.reward > 0:
            continue
        found = first_wrong_line(ex, ep.text)
        line, kind = found if found is not None and not ep.truncated else (0, "other")
        kinds[kind] = kinds.get(kind, 0) + 1
        label = LABELS.get(kind)
        if label is not None and taken[label] < per_label:
            taken[label] += 1
            chosen.append({"episode": i, "label": label, "kind": kind, "bad_line": line})
    return chosen, kinds


def advantages(episodes: list[Episode], chosen: list[int], ctx: CreditContext, gt_k: int, seed: int,
               critic=None, progress=None) -> dict[str, list[torch.Tensor]]:
    """Per method, the advantages of episodes[chosen]: group methods see every episode of the groups."""
    subset = [episodes[i] for i in chosen]
    out = {}
    for name in ("grpo", "rloo", "tempo"):  # tempo: values from the prefixes the group's responses share
        full = get_estimator(name)(episodes, ctx).advantages
        out[name] = [full[i] for i in chosen]
    for n, (name, k, k_min) in enumerate(VINE + (("truth", gt_k, 0),)):
        gen = torch.Generator(device=getattr(ctx.rollouts, "device", "cpu")).manual_seed(seed * 1000 + n + 1)
        sub = replace(ctx, mc_k=k, mc_k_min=k_min, generator=gen, progress=progress(name) if progress else None)
        out[name] = get_estimator("vine")(subset, sub).advantages
    if critic is not None:
        out["ppo_critic"] = get_estimator("gae")(subset, replace(ctx, critic=critic, gae_lambda=1.0)).advantages
    return out


def analyze_credit(engine, prompter: Prompter, task, examples: list, study: CreditStudy = CreditStudy(),
                   critic=None, progress=None) -> dict:
    """Sample, label, score every method and summarise (see the module doc); the result is JSON-ready."""
    tokenizer = prompter.tokenizer
    gen = torch.Generator(device=getattr(engine, "device", "cpu")).manual_seed(study.seed)
    t0 = time.perf_counter()
    episodes, owners = sample_episodes(engine, prompter, task, examples, study, gen)
    chosen, kinds = pick(episodes, owners, study.responses)
    params = SamplingParams(TEMPERATURE, TOP_P, study.max_new_tokens, tuple(task.stop))
    ctx = CreditContext(rollouts=engine, tokenizer=tokenizer, score=task.score, params=params, mc_max_states=25)
    t1 = time.perf_counter()
    adv = advantages(episodes, [c["episode"] for c in chosen], ctx, study.gt_k, study.seed, critic, progress)
    t2 = time.perf_counter()
    rows = []
    for j, c in enumerate(chosen):
        ep = episodes[c["episode"]]
        lines = line_token_ranges(ep.text, token_char_offsets(tokenizer, ep.response_ids))
        s, e = lines[c["bad_line"]]
        row = {**c, "lines": len(lines), "bad_line_token_share": (e - s) / max(len(ep.response_ids), 1),
               "text": ep.text}
        for name, per in adv.items():
            row[name] = localisation(per[j], lines, c["bad_line"])
        rows.append(row)
    methods = list(adv)
    summary = {label: {m: {q: mean_se([r[m][q] for r in rows if r["label"] == label]) for q in ("share", "before")}
                       for m in methods}
               for label in sorted(set(LABELS.values()))}
    wrong = sum(ep.reward == 0 for ep in episodes)
    return {"summary": summary, "methods": methods, "first_error_kinds": kinds, "responses": len(episodes),
            "wrong": wrong, "analysed": {lab: sum(r["label"] == lab for r in rows) for lab in summary},
            "settings": {**asdict(study), "temperature": TEMPERATURE, "top_p": TOP_P},
            "timing": {"sampling_s": t1 - t0, "advantages_s": t2 - t1}, "rows": rows}
