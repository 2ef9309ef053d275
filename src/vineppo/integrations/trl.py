"""VinePPO's per-step credit inside TRL's `GRPOTrainer` (`pip install "vineppo[trl]"`; docs/trl.md).

    from trl import GRPOConfig
    from vineppo.integrations.trl import VinePPOConfig, VinePPOTrainer

    trainer = VinePPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=accuracy, train_dataset=dataset,
                             args=GRPOConfig(...), vine_config=VinePPOConfig(mc_k=9, steps="lines"))
    trainer.train()

TRL samples and scores a batch as it always does. Then, per response, vineppo's step splitter finds its states,
`TRLRollouts` draws K continuations of each distinct state through TRL's own generation (`_generate_single_turn`:
vLLM colocate, vLLM server or transformers, whichever the run uses), `RewardFunctions` scores them with the run's
reward functions, and the registered estimator `vine` (the code `vineppo train` runs) turns the values into
per-token advantages, normalised as `vineppo train --advantage-norm` does. TRL's loss takes advantages of shape
(B, T) from a subclass. `TempoTrainer` does the same with `tempo` (values from the prefixes a group's responses
share: no continuations). The loss variants, importance sampling against vLLM, logging, checkpoints, `accelerate
launch`, DeepSpeed and PEFT stay TRL's; the settings that need one advantage per response are refused (`refusals`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
import trl
from accelerate.utils import gather_object
from torch import nn
from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.trainer.utils import is_async_callable

from vineppo.core import distributed as dist
from vineppo.core.config import RULES, TrainConfig, resolve
from vineppo.core.steps import every_n_tokens, make_splitter, step_token_ranges, token_char_offsets, token_steps
from vineppo.credit import Credit, CreditContext, Episode, get_estimator, needs, normalise, token_mean_std
from vineppo.engine.api import Request, Sample, SamplingParams
from vineppo.tasks import Example

TESTED_TRL = "1.16"  # the TRL minor this module is tested with (pyproject's `trl` extra pins it)
_DEFAULTS = TrainConfig()  # VinePPOConfig's defaults: `vineppo train`'s

if ".".join(trl.__version__.split(".")[:2]) != TESTED_TRL:
    warnings.warn(f"vineppo.integrations.trl is tested with TRL {TESTED_TRL} (it overrides GRPOTrainer's "
                  f"_calculate_rewards and calls its _generate_single_turn); found {trl.__version__}", stacklevel=2)


@dataclass
class VinePPOConfig:
    """vineppo's settings of a VinePPOTrainer or TempoTrainer; TRL's own stay in GRPOConfig (TEMPO reads steps,
    mc_states, gamma and advantage_norm)."""

    mc_k: int = _DEFAULTS.mc_k  # K: continuations per state
    steps: str = "lines"  # the step splitter: lines | paragraphs | sentences | tokens:N | regex:PATTERN (core.steps)
    mc_max_states: int = _DEFAULTS.mc_max_states  # states estimated per response; later ones take V = the reward
    mc_states: str = _DEFAULTS.mc_states  # which step starts are states: all | every:N | tokens:N | budget:B
    mc_k_min: int = _DEFAULTS.mc_k_min  # adaptive K: continuations in a state's first round (0: always mc_k)
    mc_rule: str = _DEFAULTS.mc_rule  # adaptive K: when a state is settled: agree | ci:W (Wilson half-width <= W)
    gamma: float = _DEFAULTS.gamma  # discount; VinePPO's λ is 0 by construction: A = r + γ V(next) - V(this)
    advantage_norm: str | None = None  # scale | whiten | none, as `vineppo train --advantage-norm`; None: the method's (`--algo vineppo`: scale, `tempo`: whiten)

    def check(self) -> VinePPOConfig:
        """This config, or a ValueError of one line naming the first bad field."""
        for f in fields(self):
            test, rule = RULES[f.name]
            if not test(getattr(self, f.name)) and not (f.name == "advantage_norm" and self.advantage_norm is None):
                raise ValueError(f"VinePPOConfig.{f.name}={getattr(self, f.name)!r}: {rule}")
        if self.steps == "turns":
            raise ValueError("VinePPOConfig.steps='turns': TRL's multi-turn path is not supported; steps of the text")
        if self.mc_states.startswith("entropy:"):
            raise ValueError(f"VinePPOConfig.mc_states={self.mc_states!r}: TRL's generation records no per-token "
                             f"entropies; choose all, every:N, tokens:N or budget:B")
        make_splitter(self.steps)  # a bad regular expression fails here, not in the first batch
        return self


# GRPOConfig settings that need one advantage per response: (argument, refused when, why), one line each.
REFUSED_ARGS = [
    ("importance_sampling_level", lambda a: a.importance_sampling_level != "token",
     ("a sequence-level ratio weighs all of a response's tokens by one ratio of them all, so one token's advantage "
      "moves every token's gradient; use 'token'")),
    ("loss_type", lambda a: a.loss_type == "vespo",
     "VESPO weighs a response by a function chosen by the sign of its one advantage"),
    ("multi_objective_aggregation", lambda a: a.multi_objective_aggregation != "sum_then_normalize",
     "'normalize_then_sum' normalises each reward within its group, and a continuation has no group"),
    ("scale_rewards", lambda a: a.scale_rewards != "group",
     "it scales GRPO's per-response advantage, which is not used; the normalisation is VinePPOConfig.advantage_norm"),
]


def refusals(arguments: dict[str, Any]) -> list[str]:
    """One line per setting of a GRPOTrainer's arguments (as its __init__ binds them) this module refuses."""
    found = [f"{name}: TRL's multi-turn path; VinePPOTrainer and TempoTrainer are single-turn"
             for name in ("tools", "environment_factory") if arguments.get(name)]
    if arguments.get("rollout_func") is not None:
        found.append("rollout_func: continuations are drawn through TRL's own generation, which it replaces")
    funcs = arguments.get("reward_funcs")
    for i, f in enumerate(funcs if isinstance(funcs, list) else [funcs]):
        if isinstance(f, (str, nn.Module)):
            found.append(f"reward_funcs[{i}]: a reward model; continuations are scored by reward functions only")
    args = arguments.get("args")
    if args is not None:
        found += [f"{name}={getattr(args, name)!r}: {why}" for name, refused, why in REFUSED_ARGS if refused(args)]
    return found


@dataclass
class Scored:
    """What TRL's `_calculate_rewards` saw of one generation batch (this process's rows) and gave back (all rows)."""

    inputs: list[dict]  # the dataset rows, one per completion
    prompts: list  # text or chat turns
    completion_ids: list[list[int]]
    rewards: torch.Tensor  # (all processes' completions, reward functions), NaN where a function gave None


class RewardFunctions:
    """vineppo's Scorer (`score(items, texts, token_ids)`) over a GRPOTrainer's reward functions, called in this
    process only: TRL's `_calculate_rewards` gathers over processes, and each process has its own continuations."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.rows: dict[str, tuple[Any, dict, list[int]]] = {}  # example id -> (prompt, dataset row, prompt ids)

    def completion(self, text: str, ids: list[int], prompt: Any, prompt_ids: list[int]) -> Any:
        """A completion as TRL hands its own to reward functions: the text, or for chat prompts a message."""
        if not is_conversational({"prompt": prompt}):
            return text
        tok = self.trainer._tokenizer
        if getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None:
            return [parse_response(tok, ids, prefix=prompt_ids, tools=self.trainer.tools)]
        return [{"role": "assistant", "content": text}]

    def score(self, items: list[Example], texts: list[str], token_ids: list[list[int]]) -> list[float | None]:
        """The weighted sum of the reward functions per completion (TRL's sum: a None leaves its function out), None
        where every function gave None; log_metric and log_extra are the responses' only, so here they log nothing."""
        t = self.trainer
        rows = [self.rows[ex.id] for ex in items]
        prompts = [p for p, _, _ in rows]
        completions = [self.completion(x, ids, p, pids) for x, ids, (p, _, pids) in zip(texts, token_ids, rows)]
        keys = [k for k in rows[0][1] if k not in ("prompt", "completion", "completion_ids")] if rows else []
        kwargs = {k: [row[k] for _, row, _ in rows] for k in keys}
        kwargs.update(trainer_state=t.state, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
        values = torch.full((len(items), len(t.reward_funcs)), float("nan"))
        for j, (func, name) in enumerate(zip(t.reward_funcs, t.reward_func_names)):
            out = func(prompts=prompts, completions=completions, completion_ids=token_ids, **kwargs)
            if is_async_callable(func):
                out = asyncio.run_coroutine_threadsafe(out, t.async_loop).result()
            if len(out) != len(items):
                raise ValueError(f"reward function {name!r} returned {len(out)} rewards for {len(items)} continuations")
            values[:, j] = torch.tensor([float("nan") if r is None else r for r in out], dtype=torch.float32)
        return weighted(values, t.reward_weights)


def weighted(values: torch.Tensor, weights: torch.Tensor) -> list[float | None]:
    """Per row of (completions, reward functions): the weighted nansum, as TRL sums them; None for an all-NaN row."""
    total = (values * weights.to(values.device).unsqueeze(0)).nansum(dim=1)
    return [None if torch.isnan(row).all() else float(s) for row, s in zip(values, total)]


class TRLRollouts:
    """vineppo's rollout interface (`continuations(Request)`) over a GRPOTrainer's own generation.

    `_generate_single_turn` is collective under vLLM (server: prompts gathered to the main process; colocate with
    tensor parallelism), DeepSpeed ZeRO-3 and FSDP (parameters gathered), so every process calls it the same number
    of times: one call per round, with a dummy prompt where a process has nothing to draw, and under a vLLM server
    (or colocated vLLM with tensor parallelism) the same number of prompts on every process (the answer is sliced by
    process index)."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.truncated = 0  # continuations cut off by their room (scored by the reward functions all the same)

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """result[i][j]: req.k samples continuing sequences[i][:boundaries[i][j]] (adaptive rounds: `req.more`)."""
        req = req.checked()
        out: list[list[list[Sample]]] = [[[] for _ in bs] for bs in req.boundaries]
        want = [(i, j, req.k) for i, bs in enumerate(req.boundaries) for j in range(len(bs))]
        while True:
            jobs = [(i, j, n) for i, j, n in want if n > 0]
            drawn = self.draw([(req.sequences[i][:req.boundaries[i][j]], n, req.budgets[i][j]) for i, j, n in jobs])
            if drawn is None:  # no process has anything left to draw
                return out
            for (i, j, _), samples in zip(jobs, drawn):
                out[i][j] += samples
            if req.progress is not None:
                req.progress(sum(len(s) for per in out for s in per),
                             sum(len(x.token_ids) for per in out for s in per for x in s))
            want = [(i, j, req.more(i, j, out[i][j])) for i, j, _ in jobs] if req.more is not None else []

    def draw(self, jobs: list[tuple[list[int], int, int]]) -> list[list[Sample]] | None:
        """n continuations of each (prefix, n, room), cut to their room, in one generation call on every process;
        None (and no call) when no process has a job."""
        t = self.trainer
        rows = sum(n for _, n, _ in jobs)
        same = {n for _, n, _ in jobs}
        everyone = dist.all_gather_objects((rows, same.pop() if len(same) == 1 else 1,
                                            max((r for *_, r in jobs), default=1)))
        if not any(r for r, _, _ in everyone):
            return None
        ks = {k for r, k, _ in everyone if r}  # the server strides the gathered prompts by one n for all
        k = ks.pop() if len(ks) == 1 else 1
        sliced = t.use_vllm and (t.vllm_mode == "server" or t.vllm_tensor_parallel_size > 1)
        width = max(r for r, _, _ in everyone) if sliced else max(rows, 1)
        prompts = [list(p) for p, n, _ in jobs for _ in range(n)]
        prompts += [[t._tokenizer.eos_token_id]] * (width - rows)  # dummies: their samples are dropped
        with self.max_tokens(max(r for _, _, r in everyone)):
            ids, _ = t._generate_single_turn(prompts, None, {}, k)
        ends = {*t.eos_token_ids, t._tokenizer.pad_token_id}
        out, at = [], 0
        for _, n, room in jobs:
            samples = []
            for got in ids[at:at + n]:
                got = list(got)[:room]
                self.truncated += not (got and got[-1] in ends)
                # TRL's rule: its reward functions score a completion cut off at max_completion_length like any
                # other (vine's own rule gives 0 to a cut-off one), so every continuation goes to be scored
                samples.append(Sample(got, t._tokenizer.decode(got, skip_special_tokens=True), [], "stop"))
            out.append(samples)
            at += n
        return out

    @contextmanager
    def max_tokens(self, n: int):
        """Generation limited to n new tokens (the longest room of the round) instead of max_completion_length."""
        t = self.trainer
        limits = ((getattr(t, "generation_config", None), "max_new_tokens"),
                  (getattr(t, "vllm_generation", None), "max_completion_length"))
        held = [(obj, key, getattr(obj, key)) for obj, key in limits if obj is not None]
        kwargs = getattr(t, "generation_kwargs", None)
        saved = dict(kwargs) if kwargs is not None else None
        try:
            for obj, key, _ in held:
                setattr(obj, key, n)
            if kwargs is not None:
                kwargs["max_new_tokens"] = n
            yield
        finally:
            for obj, key, value in held:
                setattr(obj, key, value)
            if saved is not None:
                kwargs.clear()
                kwargs.update(saved)


class StepCreditTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are per token, from the vineppo estimator registered as `estimator_name`."""

    estimator_name = ""
    algo = ""  # the `vineppo train --algo` it matches: its normalisation is the default one

    def __init__(self, *positional: Any, vine_config: VinePPOConfig | None = None, **named: Any):
        arguments = inspect.signature(GRPOTrainer.__init__).bind(self, *positional, **named).arguments
        refused = refusals(arguments)
        if refused:
            raise ValueError(f"{type(self).__name__} refuses {refused[0]} (docs/trl.md)")
        self.vine_config = (vine_config or VinePPOConfig()).check()
        self.advantage_norm = self.vine_config.advantage_norm or resolve({}, {"algo": self.algo}).advantage_norm
        self.estimator = get_estimator(self.estimator_name)  # tests may plant another one
        self.splitter = make_splitter(self.vine_config.steps)
        self.scorer: RewardFunctions | None = None
        self._scored: Scored | None = None
        super().__init__(*positional, **named)
        if self._is_vlm:
            raise ValueError(f"{type(self).__name__} refuses processing_class: a multimodal processor (text only)")
        self.scorer = RewardFunctions(self)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of the batch (gathered over processes), kept with what they scored."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored = Scored(inputs, prompts, [list(c) for c in completion_ids_list], rewards)
        return rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's batch with its (B,) advantages replaced by vineppo's (B, T) ones (in training; evaluation keeps
        GRPO's and draws no continuations)."""
        output = super()._generate_and_score_completions(inputs)
        scored, self._scored = self._scored, None
        if not self.model.training:
            return output
        t0 = time.perf_counter()
        episodes = self.episodes(scored, output)
        has = [i for i, ep in enumerate(episodes) if ep.reward is not None]  # TRL: an unscorable one gets 0
        rollouts = TRLRollouts(self)
        ctx = CreditContext(rollouts=rollouts, tokenizer=self._tokenizer, score=self.scorer.score,
                            params=SamplingParams(self.temperature, self.top_p, self.max_completion_length),
                            **{f.name: getattr(self.vine_config, f.name) for f in fields(VinePPOConfig)
                               if f.name not in ("steps", "advantage_norm")})
        credit = self.credit([episodes[i] for i in has], ctx)
        normed = normalise(credit.advantages, self.advantage_norm)
        advantages = [torch.zeros(len(ep.response_ids)) for ep in episodes]
        for i, a in zip(has, normed):
            advantages[i] = a.float()
        table = torch.zeros(output["completion_ids"].shape)
        for i, a in enumerate(advantages):
            table[i, :len(a)] = a
        output["advantages"] = table.to(self.accelerator.device)
        monte_carlo = needs(self.estimator_name).rollouts
        stats = {**credit.stats, "mc/truncated": float(rollouts.truncated)} if monte_carlo else credit.stats
        self.log_credit(stats, credit.advantages, advantages, time.perf_counter() - t0)
        return output

    def credit(self, episodes: list[Episode], ctx: CreditContext) -> Credit:
        """The estimator's credit of this process's scorable episodes."""
        return self.estimator(episodes, ctx)

    def episodes(self, scored: Scored, output: dict) -> list[Episode]:
        """This process's responses as vineppo episodes: prompt and response ids, TRL's weighted reward, steps."""
        n, tok = len(scored.inputs), self._tokenizer
        start = self.accelerator.process_index * n
        rewards = weighted(scored.rewards[start:start + n].float().cpu(), self.reward_weights)
        ends, every = {*self.eos_token_ids, tok.pad_token_id}, token_steps(self.vine_config.steps)
        self.scorer.rows = {}
        out = []
        for i, (ids, reward) in enumerate(zip(scored.completion_ids, rewards)):
            prompt_ids = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            group = (start + i) // self.num_generations  # TRL's groups: num_generations rows in a row, over processes
            example = Example(f"group-{group}", "", "", "")
            self.scorer.rows[example.id] = (scored.prompts[i], scored.inputs[i], prompt_ids)
            text = tok.decode(ids, skip_special_tokens=True)
            steps = every_n_tokens(len(ids), every) if every else \
                step_token_ranges(self.splitter(text), token_char_offsets(tok, ids))
            out.append(Episode(prompt_ids, ids, text, reward, group, example, steps, not (ids and ids[-1] in ends)))
        return out

    def log_credit(self, stats: dict[str, float], raw: list[torch.Tensor], final: list[torch.Tensor],
                   seconds: float) -> None:
        """Into TRL's metrics, over all processes: the estimator's statistics (mc/* summed, the rest averaged), the
        advantages' mean and std before normalisation, the share of non-zero tokens after, the seconds of credit."""
        keys = sorted(stats)
        nonzero = float(sum(int((a != 0).sum()) for a in final))
        summed = dist.all_sum([stats[k] for k in keys] + [nonzero, float(sum(len(a) for a in final)), seconds])
        world, metrics = dist.world(), self._metrics["train"]
        for k, v in zip(keys, summed):
            metrics[k].append(v if k.startswith("mc/") else v / world)
        mean, std = token_mean_std(raw)
        metrics["advantage/mean"].append(mean)
        metrics["advantage/std"].append(std)
        metrics["advantage/nonzero"].append(summed[-3] / max(summed[-2], 1.0))
        metrics["time/mc_s" if needs(self.estimator_name).rollouts else "time/credit_s"].append(summed[-1] / world)
        # the completions table's advantage column: each response's mean token advantage instead of GRPO's
        means = gather_object([float(a.mean()) if len(a) else 0.0 for a in final])
        logged = self._logs["advantages"]
        for _ in range(min(len(means), len(logged))):
            logged.pop()
        logged.extend(means)


class VinePPOTrainer(StepCreditTrainer):
    """TRL's GRPOTrainer with VinePPO's advantages: each step's value from K continuations drawn through TRL's own
    generation and scored by the run's reward functions (`vine`, the estimator of `vineppo train --algo vineppo`)."""

    estimator_name = "vine"
    algo = "vineppo"


class TempoTrainer(StepCreditTrainer):
    """TRL's GRPOTrainer with TEMPO's advantages: step values from the prefixes a group's responses share (`tempo`),
    no continuations; a group's responses may sit on several processes, so every process values the whole batch."""

    estimator_name = "tempo"
    algo = "tempo"

    def credit(self, episodes: list[Episode], ctx: CreditContext) -> Credit:
        """The estimator over every process's episodes (gathered), this process's share of the advantages."""
        parts = dist.all_gather_objects(episodes)
        start = sum(len(p) for p in parts[:dist.rank()])
        whole = self.estimator([ep for part in parts for ep in part], ctx)
        return Credit(whole.advantages[start:start + len(episodes)], stats=whole.stats)


__all__ = ["REFUSED_ARGS", "RewardFunctions", "Scored", "StepCreditTrainer", "TRLRollouts", "TempoTrainer",
           "VinePPOConfig", "VinePPOTrainer", "refusals", "weighted"]
