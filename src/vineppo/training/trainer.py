"""The RL loop behind `vineppo train`: sample -> grade -> the algorithm's update -> evaluate -> checkpoint.

One loop serves every algorithm; they differ only in the update registered under their name
(vineppo.training.algorithms: credit assignment + PPO, RestEM, DPO+) and its settings (vineppo.core.config.ALGOS).
Read `train` top to bottom.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import json
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vineppo import agents
from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig, check_engine
from vineppo.core.errors import RewardError, UserError
from vineppo.core.grading import outcome_rewards
from vineppo.core.rewards import Call, TrainerState
from vineppo.core.steps import every_n_tokens, step_token_ranges, token_char_offsets
from vineppo.core.tracking import Tracker, console, plan, plot_run, progress_bar
from vineppo.credit import Episode, groups, needs
from vineppo.engine import RolloutEngine, Sample, SamplingParams, make_engine
from vineppo.engine.budget import auto_token_budget, update_reserve
from vineppo.engine.loading import LoadSpec, load
from vineppo.models import lora, parallel
from vineppo.models.causal_lm import context_length, disable_dropout
from vineppo.models.prompts import Prompter
from vineppo.tasks import Example, Task, get_task
from vineppo.training import runs
from vineppo.training.algorithms import Context, get_algorithm, needs_reference
from vineppo.training.evaluation import EvalSettings, behaviour_counts, behaviour_table, evaluate
from vineppo.training.ppo import Critic
from vineppo.training.sft import default_model, is_saved_model

NO_SIGNAL_ITERATIONS = 3  # iterations in a row without a prompt of mixed outcomes before the run warns
TABLE_ROWS = 32  # sampled responses in each table of completions.jsonl (the first prompts' groups)
TIMES = ("wall_clock_s", "setup_s", "start_eval_s", "train_s", "eval_s", "save_s")  # the summary's seconds: all, parts
ALIASES = ("start_test_pass@1", "start_test_behaviours")  # also in the summary as sft_*, their names before

try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim  # glibc's; musl and macOS have none (nothing to do there)
except (AttributeError, OSError, TypeError):
    _MALLOC_TRIM = None


def train(cfg: TrainConfig, resume: Path | None = None, task: Task | None = None,
          started: float | None = None) -> dict:
    """Run (or resume) RL training as configured; returns the run summary. `task`: the task object to train on
    (the Python API's custom task), else the registered one `cfg.task` names, for `cfg`'s settings. `started`: the
    perf_counter() reading wall_clock_s counts from (the command line: the process start; default: this call)."""
    started = time.perf_counter() if started is None else started
    cfg = configs.validate(cfg)  # callers of this function may build a TrainConfig by hand
    check_engine(cfg.engine)  # a missing vLLM fails before anything loads
    device = dist.init(cfg.device)
    out = Path(resume) if resume else _run_dir(cfg)
    with runs.locked(out, create=not resume, enabled=dist.is_main()):  # one run per folder, for its whole life
        return _train(cfg, out, resume is not None, device, task, started)


@dataclass
class RunState:
    """A run's progress and records; a checkpoint's state.json holds it (keys spelled as in the summary)."""

    iteration: int = 0  # iterations done
    wall_clock_s: float = 0.0  # since the process started (Python API: since train() was called), over resumes
    setup_s: float = 0.0  # of which: from the start to the first evaluation (imports, data, model loading, engine)
    start_eval_s: float = 0.0  # of which: the starting model's evaluation (iteration 0)
    train_s: float = 0.0  # of which: sampling, credit and updates so far: what --time-budget-s counts
    eval_s: float = 0.0  # of which: the evaluations after iterations
    save_s: float = 0.0  # of which: writing checkpoints (the rest: logging, tables, the summary)
    start_test_pass1: float | None = None  # the starting model's test pass@1 (iteration 0; an SFT model or a release)
    best_test_pass1: float | None = None  # the best test pass@1 of any evaluation
    final_test_pass1: float | None = None  # the latest evaluation's test pass@1
    best_val_iteration: int | None = None  # the iteration with the best validation pass@1 (the earliest on ties)
    best_val_pass1: float | None = None
    test_at_best_val_pass1: float | None = None  # the test pass@1 at best_val_iteration
    start_test_behaviours: dict | None = None  # behaviour shares among the starting model's test samples
    final_test_behaviours: dict | None = None  # behaviour shares among the latest evaluation's test samples

    def to_json(self) -> dict:
        """The state as state.json and summary.json spell it (pass@1)."""
        return {k.replace("pass1", "pass@1"): v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, saved: dict) -> RunState:
        """The state of a state.json; one written before a field existed keeps that field's default."""
        names = {f.name for f in dataclasses.fields(cls)}
        renamed = ((k.replace("pass@1", "pass1").replace("sft_test_", "start_test_"), v) for k, v in saved.items())
        return cls(**{k: v for k, v in renamed if k in names})  # sft_test_*: the start's keys before their rename

    def record(self, iteration: int, scores: dict[str, float]) -> None:
        """Keep the best test pass@1, and the iteration with the best validation pass@1 (the earliest on ties)."""
        test, val = scores.get("test/pass@1"), scores.get("val/pass@1")
        if test is not None:
            self.best_test_pass1 = max(test, self.best_test_pass1 or 0.0)
        if val is not None and (self.best_val_pass1 is None or val > self.best_val_pass1):
            self.best_val_iteration, self.best_val_pass1, self.test_at_best_val_pass1 = iteration, val, test


class Bar:
    """The run's progress bar: one line, a phase text, advanced once per iteration. Where the output is not a
    terminal (a log file), each phase is a line of its own, so the log is never silent for a whole iteration."""

    def __init__(self, cfg: TrainConfig, done: int, enabled: bool, clock: float = 0.0):
        self.bar = progress_bar(enabled=enabled)
        self.bar.start()
        self.job = self.bar.add_task(f"{cfg.algo} on {cfg.task}", total=cfg.iterations, completed=done, status="")
        self.lines = enabled and not console.is_terminal
        self.clock, self.total, self.current = clock, cfg.iterations, None  # current: the iteration under way

    def begin(self, it: int) -> None:
        """Iteration `it` (from 0) starts."""
        self.current = it + 1

    def status(self, text: str) -> None:
        """Show the phase the run is in (a line of its own outside a terminal: the iteration, phase, seconds)."""
        self.bar.update(self.job, status=text)
        if self.lines:
            where = f"iter {self.current}/{self.total} " if self.current else ""
            console.print(f"{where}{text} ({time.perf_counter() - self.clock:.0f}s)", highlight=False, markup=False)

    def advance(self, text: str) -> None:
        """Count one iteration done, with its result as the status."""
        self.current = None
        self.bar.update(self.job, advance=1, status=text)

    def stop(self) -> None:
        """Leave the bar as it stands."""
        self.bar.stop()


@dataclass
class Run:
    """Everything the loop reads, made once by `setup`; `state` is what advances."""

    cfg: TrainConfig
    out: Path  # the run folder (locked)
    device: torch.device
    task: Task
    algorithm: Callable[..., dict[str, float]]  # vineppo.training.algorithms: the update registered under cfg.algo
    train_set: list[Example]
    test_set: list[Example]  # the evaluated test problems (empty: no evaluation)
    val_set: list[Example]  # the validation problems (empty: no model selection)
    prompter: Prompter
    tokenizer: Any
    models: Models
    sampler: torch.nn.Module  # what the engine samples from: the policy, or the frozen SFT model (DPO+'s offline samples)
    engine: RolloutEngine
    eval_engine: RolloutEngine  # samples the policy: the engine itself when it does, else a native one
    params: SamplingParams  # the training responses' sampling settings
    ctx: Context  # what the algorithm is handed; its generators are set per iteration
    tracker: Tracker
    bar: Bar
    state: RunState
    watch: _SignalWatch
    clock: float = 0.0  # perf_counter() at which wall_clock_s was 0 (the process start, less earlier runs' time)

    def sampling(self, *nets: torch.nn.Module):
        """Around the engine: it samples from whole weights (sharded models gathered), in the run's dtype."""
        return parallel.sampling(self.device, self.cfg.dtype, *nets)


def _train(cfg: TrainConfig, out: Path, resume: bool, device: torch.device, task: Task | None = None,
           started: float = 0.0) -> dict:
    """The run, its folder locked: set up, evaluate the starting model, iterate, summarise."""
    run = setup(cfg, out, resume, device, task, started)
    try:
        if run.state.iteration == 0 and (run.test_set or run.val_set):
            run.bar.status("evaluating the starting model")
            t0 = time.perf_counter()
            scores = evaluate_policy(run, 0)
            run.state.start_eval_s += time.perf_counter() - t0
            run.state.start_test_pass1, run.state.start_test_behaviours = scores.get("test/pass@1"), _behaviours(scores)
            run.state.record(0, scores)
            run.state.wall_clock_s = time.perf_counter() - run.clock
            with _disk_errors(out):
                run.tracker.log(0, {**scores, "time/wall_clock_s": run.state.wall_clock_s})
        for it in range(run.state.iteration, cfg.iterations):
            if iteration(run, it):
                break
    except RewardError as e:  # a user's reward function failed: the run stops, saying what was kept
        kept = runs.latest(out)
        raise UserError(f"{e}. The run stopped; " + (f"the last good checkpoint is {kept}" if kept else
                                                     "no checkpoint had been saved yet")) from None
    return finish(run)


def setup(cfg: TrainConfig, out: Path, resume: bool, device: torch.device, task: Task | None = None,
          started: float | None = None) -> Run:
    """Folder and data checks before any model loads, the run's plan, then the models, engines, tracker and (on
    resume) state. `started`: the perf_counter() reading wall_clock_s counts from (default: now)."""
    started = time.perf_counter() if started is None else started
    main = dist.is_main()
    if cfg.dtype == "auto":  # resolved once, so config.yaml (and a resume) records what the run computes in
        cfg = dataclasses.replace(cfg, dtype=parallel.pick_dtype(cfg.dtype, device))
        if main:
            console.print(f"--dtype auto: {cfg.dtype} on this {device.type}", highlight=False)
    task = task or get_task(cfg.task, cfg)
    algorithm = get_algorithm(cfg)
    found = runs.resume_point(out, cfg.iterations) if resume else []
    if main and not resume:
        runs.start_fresh(out)
    train_set, test_set, val_set = _load_data(cfg, task)
    if main:
        _announce(cfg, out, device, found, len(test_set) + len(val_set))

    # Models: the policy, its frozen SFT reference, and the critic when the estimator uses one.
    model_dir = _sft_model(cfg, train_missing=not resume) if main else None
    model_dir = str(dist.broadcast_object(str(model_dir) if model_dir else None))
    if main and resume:
        runs.check_start_model(out, model_dir)
    got = load(LoadSpec(model_dir, task, cfg.prompt_format, cfg.data, cfg.data_seed, str(device),
                        policy_dtype(cfg) or "float32", engine=None, verbose=main))  # the engine: on the sampler, below
    policy, tokenizer, prompter = got.model, got.tokenizer, got.prompter
    _check_lengths(cfg, prompter, policy, train_set, test_set, val_set)
    models = build_models(cfg, policy, device)
    policy = models.trained.policy
    sampler = {"policy": policy, "sft": models.reference}[cfg.sample_from]
    budget = _token_budget(cfg, sampler, models, main)
    engine = dialogues(cfg, task, prompter, make_engine(cfg.engine, sampler, tokenizer, model_dir=model_dir,
                                                          token_budget=budget, cuda_graphs=cfg.cuda_graphs))
    eval_engine = engine if sampler is policy else dialogues(cfg, task, prompter, make_engine(
        "native", policy, tokenizer, token_budget=budget, cuda_graphs=cfg.cuda_graphs))
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(task.stop))

    state = RunState.from_json(runs.load_checkpoint(found, models.trained, device)) if resume else RunState()
    if main:  # on resume, config.yaml records the total now asked for, so a plain --resume continues to it
        with _disk_errors(out):
            configs.save(cfg, out / "config.yaml")
            if not resume:
                runs.record_start_model(out, model_dir)
    dist.barrier()
    tracker = Tracker(out, cfg.tensorboard, cfg.wandb, dataclasses.asdict(cfg),
                      keep_until=state.iteration if resume else None, enabled=main)
    clock = started - state.wall_clock_s
    state.setup_s += time.perf_counter() - started
    bar = Bar(cfg, state.iteration, enabled=main, clock=clock)
    ctx = Context(cfg=cfg, policy=models.policy, reference=models.reference, optimizer=models.trained.optimizer,
                  tokenizer=tokenizer, engine=engine, params=params, score=task.score, critic=models.critic,
                  critic_opt=models.trained.critic_opt, status=bar.status,
                  sampling=lambda: parallel.sampling(device, cfg.dtype, sampler, models.trained.critic))
    return Run(cfg=cfg, out=out, device=device, task=task, algorithm=algorithm, train_set=train_set, test_set=test_set,
               val_set=val_set, prompter=prompter, tokenizer=tokenizer, models=models, sampler=sampler, engine=engine,
               eval_engine=eval_engine, params=params, ctx=ctx, tracker=tracker, bar=bar, state=state,
               watch=_SignalWatch(enabled=main), clock=clock)


def _announce(cfg: TrainConfig, out: Path, device: torch.device, found: list[Path], evaluated: int) -> None:
    """The run's first lines: what trains on what, its preset and folder, then its plan (and a warning for GPU-sized
    settings on a CPU). `found`: a resume's checkpoints (none for a fresh run)."""
    done = int(json.loads((found[0] / "state.json").read_text()).get("iteration", 0)) if found else 0
    console.print(f"{'resuming ' if found else ''}{cfg.algo} on {cfg.task}, preset {cfg.preset or 'none'}, "
                  f"run folder {out}", highlight=False, soft_wrap=True)
    for line in plan(cfg, device.type, done, evaluated):
        if line:
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def _token_budget(cfg: TrainConfig, sampler: torch.nn.Module, models: Models, main: bool) -> int:
    """--token-budget, or when 0 the device's default (on a GPU: from the memory free once the update's gradients and
    optimiser state are set aside), said in one line."""
    if cfg.token_budget:
        return cfg.token_budget
    trained = [models.trained.policy] + ([models.trained.critic] if models.trained.critic is not None else [])
    budget, line = auto_token_budget(sampler, sum(update_reserve(m) for m in trained))
    if main and next(sampler.parameters()).device.type == "cuda":
        console.print(line, highlight=False, soft_wrap=True)
    return budget


def iteration(run: Run, it: int) -> bool:
    """Iteration `it` (from 0): sample, grade, the algorithm's update, evaluate, log, checkpoint; True if the last."""
    cfg, state = run.cfg, run.state
    # Every random choice of an iteration comes from (seed, iteration, rank): a resumed run, or one on
    # a different number of ranks, draws the same prompts as the uninterrupted one.
    rng = random.Random(f"{cfg.seed}-{it}")
    gen = torch.Generator(device=run.device).manual_seed(hash((cfg.seed, it, dist.rank())) % 2**62)
    order_gen = torch.Generator().manual_seed(hash((cfg.seed, it)) % 2**62)

    # 1. Sample: this rank's share of the iteration's prompts, several responses each.
    t0 = time.perf_counter()
    return_freed_memory()  # what the last update, evaluation and checkpoint freed
    run.bar.begin(it)
    _progress(run, it)
    run.bar.status("sampling")
    picked = [rng.randrange(len(run.train_set)) for _ in range(cfg.prompts_per_iter * cfg.oversample)]
    mine = [(g, run.train_set[i]) for g, i in enumerate(picked)][dist.rank()::dist.world()]
    prompt_ids = run.prompter.encode([ex for _, ex in mine])
    _agent_stats(run, "")  # drop the counts of the evaluations' dialogues: the metrics below are this sampling's
    with run.sampling(run.sampler):
        records = {"records": [ex for _, ex in mine]} if run.task.agent is not None else {}  # dialogues' rows
        outputs = run.engine.generate(prompt_ids, cfg.samples_per_prompt, run.params, gen, **records)

    # 2. Grade (in one batch) and cut into steps; a response without a reward (a custom reward's None) is left out
    # of the loss; with --oversample, keep the prompts whose responses differ in reward.
    drawn = [(g, ex, ids, s) for (g, ex), ids, samples in zip(mine, prompt_ids, outputs) for s in samples]
    run.bar.status("grading")
    sampled = graded_episodes(run.task, run.tokenizer, drawn)
    calls = log.take_calls() if (log := run.task.reward_log()) else []  # the responses' call of the reward functions
    rewarded = [ep for ep in sampled if ep.reward is not None]
    episodes = _informative(rewarded, cfg.prompts_per_iter) if cfg.oversample > 1 else rewarded
    metrics = _sample_metrics(run, it, mine, outputs, sampled, episodes)
    metrics.update(_agent_stats(run, ""))
    metrics.update(_reward_stats(calls[-1:]))
    run.watch.update(metrics)
    t1 = time.perf_counter()

    # 3. The algorithm's update on these episodes (vineppo.training.algorithms): credit + PPO, RestEM or DPO+.
    try:
        metrics.update(run.algorithm(episodes, dataclasses.replace(run.ctx, generator=gen, order_generator=order_gen)))
    except FloatingPointError as e:
        raise UserError(f"iteration {it + 1}: {e}; try a lower --lr. Nothing was saved after the last good "
                        f"checkpoint: {runs.latest(run.out) or 'none yet'}") from None
    run.engine.push_weights(run.sampler)  # vLLM samples from its own copy of the weights: reload it (native: nothing)
    return_freed_memory()  # the update's, before an evaluation
    metrics.update(_agent_stats(run, "mc/"))  # the Monte Carlo dialogues' (VinePPO over turns)
    t2 = time.perf_counter()
    metrics.update({"time/sampling_s": t1 - t0, "time/update_s": t2 - t1 - metrics.get("time/credit_s", 0.0)})
    metrics.update(_logged_metrics(run, "metric/"))  # the reward functions' log_metric calls of this iteration
    state.train_s += t2 - t0
    return _record(run, it, metrics, sampled, calls[-1] if calls else None)


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim); False where there is none to call."""
    # glibc keeps the heap an iteration frees for reuse, but the next iteration's tensors differ in size: without
    # this a CPU run's resident set keeps GBs it no longer uses (measured: results/agents/PROTOCOL-guess-number.md).
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def _record(run: Run, it: int, metrics: dict[str, float], sampled: list[Episode], call: Call | None) -> bool:
    """Step 4 of iteration `it`: evaluate, log, write a completions table, checkpoint; True if it is the last."""
    cfg, state, done = run.cfg, run.state, it + 1
    # the mean over ranks, so every rank stops at the same iteration; no collective when there is no budget
    last = done == cfg.iterations or (cfg.time_budget_s > 0 and
                                      cfg.time_budget_s <= dist.all_sum([state.train_s])[0] / dist.world())
    if (run.test_set or run.val_set) and (last or (cfg.eval_every and done % cfg.eval_every == 0)):
        run.bar.status("evaluating")
        t0 = time.perf_counter()
        scores = evaluate_policy(run, done)
        state.eval_s += time.perf_counter() - t0
        metrics.update(scores)
        state.final_test_pass1, state.final_test_behaviours = scores.get("test/pass@1"), _behaviours(scores)
        state.record(done, scores)
    state.iteration, state.wall_clock_s = done, time.perf_counter() - run.clock
    metrics.update({"time/wall_clock_s": state.wall_clock_s, "time/train_s": state.train_s})
    table = _table(run, sampled, call) if last or done == 1 or (cfg.completions_every and
                                                                 done % cfg.completions_every == 0) else None
    with _disk_errors(run.out):
        run.tracker.log(done, metrics)
        if table is not None:
            run.tracker.table(done, table)
    if last or (cfg.save_every and done % cfg.save_every == 0):
        run.bar.status("saving")
        t0 = time.perf_counter()
        runs.save_checkpoint(run.out, run.models.trained, run.tokenizer, state.to_json(), cfg.keep_checkpoints,
                             record=(run.prompter.format, cfg.dtype))
        state.save_s += time.perf_counter() - t0
    status = f"reward {metrics['train/reward']:.3f}" + (f" test {metrics['test/pass@1']:.3f}"
                                                        if "test/pass@1" in metrics else "")
    run.bar.advance(status)
    if dist.is_main() and not console.is_terminal:
        console.print(f"iter {done}/{cfg.iterations} {status} ({state.wall_clock_s:.0f}s)")
    return last


def _progress(run: Run, it: int) -> None:
    """Tell the reward functions (`trainer_state`) how far training is, `it` iterations done; the calls kept since
    the last take (Monte Carlo, evaluations) are dropped, so the next one taken is the responses'."""
    if (log := run.task.reward_log()) is not None:
        log.state = TrainerState(global_step=it, max_steps=run.cfg.iterations,
                                 epoch=it * run.cfg.prompts_per_iter / len(run.train_set))
        log.take_calls()


def _reward_stats(calls: list[Call]) -> dict[str, float]:
    """rewards/NAME/mean and rewards/NAME/std over all ranks: each reward function's values (before weighting) on the
    iteration's responses, those it gave None left out; none for a task without reward functions of its own."""
    names = list(dict.fromkeys(n for part in dist.all_gather_objects(list(calls[0].values) if calls else [])
                               for n in part))
    out = {}
    for name in names:
        values = [v for call in calls for v in call.values.get(name, []) if v is not None]
        n, total, squares = dist.all_sum([float(len(values)), sum(values), sum(v * v for v in values)])
        if n:
            mean = total / n
            std = max(squares / n - mean * mean, 0.0) ** 0.5
            out.update({f"rewards/{name}/mean": mean, f"rewards/{name}/std": std})
    return out


def _logged_metrics(run: Run, prefix: str) -> dict[str, float]:
    """The mean over all ranks of each scalar the reward functions gave `log_metric` since the last take, as
    PREFIX + NAME."""
    log = run.task.reward_log()
    if log is None:
        return {}
    sums: dict[str, list[float]] = {}
    for part in dist.all_gather_objects(log.take_metrics()):
        for name, (total, n) in part.items():
            sums.setdefault(name, [0.0, 0])
            sums[name][0] += total
            sums[name][1] += n
    return {prefix + name: total / n for name, (total, n) in sorted(sums.items())}


def _table(run: Run, sampled: list[Episode], call: Call | None) -> list[dict]:
    """The first TABLE_ROWS sampled responses over all ranks, as rows of the completions table: the prompt (text or
    chat turns), the response, its reward, how it ended, each reward function's value and log_extra's columns."""
    finished = [i for i, ep in enumerate(sampled) if not ep.truncated]  # what the reward functions were called on
    whole = call and all(len(v) == len(finished) for v in [*call.values.values(), *call.extra.values()])
    scored = {i: k for k, i in enumerate(finished)} if whole else {}
    rows = []
    for i, ep in enumerate(sampled[:TABLE_ROWS]):
        row = {"example": ep.example.id, "prompt": run.task.chat_turns(ep.example) or ep.example.problem,
               "completion": ep.text, "reward": ep.reward, "finish": "length" if ep.truncated else "stop"}
        if i in scored:
            row.update({name: values[scored[i]] for name, values in call.values.items()})
            row.update({column: values[scored[i]] for column, values in call.extra.items()})
        rows.append(row)
    return [row for part in dist.all_gather_objects(rows) for row in part][:TABLE_ROWS]


def _sample_metrics(run: Run, it: int, mine: list, outputs: list, sampled: list[Episode],
                    episodes: list[Episode]) -> dict[str, float]:
    """The iteration's sample statistics over all ranks; refuses an iteration whose responses all hit the limit."""
    rewarded = [ep for ep in sampled if ep.reward is not None]
    n, truncated, reward, tokens, mixed, prompts, kept_mixed, scored = dist.all_sum([
        float(len(sampled)), float(sum(ep.truncated for ep in sampled)), sum(ep.reward for ep in rewarded),
        float(sum(len(ep.response_ids) for ep in sampled)), float(_mixed_prompts(rewarded)), float(len(mine)),
        float(_mixed_prompts(episodes)), float(len(rewarded))])
    if truncated == n:
        raise UserError(f"iteration {it + 1}: all {int(n)} responses hit max_new_tokens={run.cfg.max_new_tokens} "
                        f"(reward 0, nothing to learn); raise --max-new-tokens or check the model. Last good "
                        f"checkpoint: {runs.latest(run.out) or 'none yet'}")
    if scored == 0:
        raise UserError(f"iteration {it + 1}: no response of {int(n)} got a reward (the reward functions returned None "
                        f"for all of them). Last good checkpoint: {runs.latest(run.out) or 'none yet'}")
    metrics = {"train/reward": reward / scored, "train/truncated": truncated / n, "train/response_tokens": tokens / n,
               "episodes": n, "train/mixed_prompts": mixed / max(prompts, 1.0),
               "train/kept_mixed_prompts": kept_mixed / run.cfg.prompts_per_iter, "train/no_reward": 1 - scored / n}
    if run.task.behaviour:  # the share of each way of answering among the iteration's samples
        labels = [run.task.behaviour(ex, s.text) for (_, ex), samples in zip(mine, outputs) for s in samples]
        counts = dist.all_sum([float(labels.count(name)) for name in run.task.behaviours])
        metrics.update({f"train/behaviour/{name}": c / n for name, c in zip(run.task.behaviours, counts)})
    return metrics


def evaluate_policy(run: Run, iteration: int) -> dict[str, float]:
    """test/pass@1 and val/pass@1 (for the splits that are evaluated) of the policy now, and the test behaviours."""
    cfg, scores = run.cfg, {}
    _progress(run, iteration)
    settings = EvalSettings(cfg.eval_samples, cfg.eval_temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed + iteration)
    for key, examples in (("test/pass@1", run.test_set), ("val/pass@1", run.val_set)):
        if not examples:
            continue
        mine = examples[dist.rank()::dist.world()]
        with run.sampling(run.models.trained.policy):
            result = evaluate(run.eval_engine, run.task, mine, settings, run.prompter)
        total, n = dist.all_sum([result["pass@1"] * len(mine), float(len(mine))])
        scores[key] = total / max(n, 1)
        if run.task.behaviour and key == "test/pass@1":  # which ways of answering the samples took, and how well
            table = behaviour_table(run.task, dist.all_sum(behaviour_counts(run.task, result["results"])))
            scores.update({f"test/behaviour/{name}": v["share"] for name, v in table.items()})
            scores.update({f"test/behaviour_pass@1/{name}": v["pass@1"] for name, v in table.items()
                           if v["pass@1"] is not None})
    return scores | _logged_metrics(run, "test/metric/")  # what the reward functions logged while scoring them


def finish(run: Run) -> dict:
    """Close the bar and tracker, draw the run's plot, write summary.json; returns the summary."""
    run.bar.stop()
    run.tracker.close()
    main, state = dist.is_main(), run.state.to_json()
    if main:
        with _disk_errors(run.out):
            plot_run(run.out)
    summary = {k: state[k] for k in ("start_test_pass@1", "final_test_pass@1", "best_test_pass@1")}
    if state["start_test_pass@1"] is not None and state["final_test_pass@1"] is not None:
        summary["gain"] = state["final_test_pass@1"] - state["start_test_pass@1"]
    summary.update({k: state[k] for k in ("start_test_behaviours", "final_test_behaviours") if state.get(k)})
    summary.update({"iterations": state["iteration"], **{k: state[k] for k in TIMES},
                    "time_budget_reached": 0 < run.cfg.time_budget_s <= state["train_s"]})
    if run.val_set:  # the model selection: the iteration with the best validation pass@1, and its test pass@1
        summary.update({k: state[k] for k in ("best_val_iteration", "best_val_pass@1", "test_at_best_val_pass@1")})
    summary = rounded(summary)
    summary.update({k.replace("start_", "sft_"): summary[k] for k in ALIASES if k in summary})
    if main:
        with _disk_errors(run.out):
            runs.write_atomic(run.out / "summary.json", json.dumps(summary, indent=2) + "\n")
    summary["out"] = str(run.out)
    return summary


def rounded(value: Any) -> Any:
    """A summary's numbers as a person reads them: seconds (keys ending in _s) to 0.1, other floats to 6 decimals
    (0.02, not 0.019999999999999997), inside dicts and lists too."""
    if isinstance(value, dict):
        return {k: round(v, 1) if k.endswith("_s") and isinstance(v, float) else rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return round(value, 6) if isinstance(value, float) else value


@dataclass
class Models:
    """A run's models: what checkpoints hold, the modules the update trains through, and the KL reference."""

    trained: runs.Trained  # policy (as the engine samples from it), critic, their optimisers
    policy: torch.nn.Module  # the policy as the update runs it (a DDP wrapper, or trained.policy itself), ctx.policy
    critic: torch.nn.Module | None  # the critic as the update runs it, ctx.critic
    reference: Any  # the frozen SFT model (LoRA: the policy with its adapters off); None if unused (needs_reference)


def policy_dtype(cfg: TrainConfig) -> str | None:
    """The dtype to load the policy in: LoRA's frozen base may be bf16; weights that train stay float32."""
    return cfg.dtype if cfg.lora_r and cfg.dtype != "float32" else None


def build_models(cfg: TrainConfig, policy: torch.nn.Module, device: torch.device) -> Models:
    """Reference, critic, LoRA adapters, sharding or replication, and optimisers around the loaded `policy`."""
    parallel.round_weights(policy, cfg.dtype)  # before the copies: reference and critic start from the same values
    critic = Critic.from_model(policy).float() if needs(cfg.estimator).critic else None  # a copy; trained in float32
    for net in (policy, critic):  # the update runs in train mode; PPO's ratio and KL must not see dropout noise
        if net is not None:
            disable_dropout(net)
    reference = None  # none is built when the run does not use it (--kl-coef 0 in the PPO family)
    if cfg.lora_r:
        torch.manual_seed(cfg.seed)  # the adapters' initialisation
        policy = lora.add_adapters(policy, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets)
        reference = lora.AdaptersOff(policy) if needs_reference(cfg) else None
    elif needs_reference(cfg):  # a copy, not a second load; frozen weights are held in bf16 under --dtype bfloat16
        reference = copy.deepcopy(policy).requires_grad_(False).to(parallel.DTYPES[cfg.dtype] or policy.dtype)
        reference = parallel.wrap(reference, device, cfg.fsdp)
    trainee = parallel.wrap(policy, device, cfg.fsdp, cfg.gradient_checkpointing)  # shards `policy` in place
    critic_trainee = parallel.wrap(critic, device, cfg.fsdp, cfg.gradient_checkpointing) if critic else None
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr) if critic else None
    return Models(runs.Trained(policy, optimizer, critic, critic_opt, cfg.fsdp), trainee, critic_trainee, reference)


def graded_episodes(task: Task, tokenizer, drawn: list[tuple[int, Example, list[int], Sample]]) -> list[Episode]:
    """Drawn responses (group, example, prompt ids, sample) scored in one batch (Task.score) and cut into steps."""
    rewards = outcome_rewards(task.score, [ex for _, ex, _, _ in drawn], [s for *_, s in drawn])
    return [_episode(task, tokenizer, ids, s, g, ex, r) for (g, ex, ids, s), r in zip(drawn, rewards)]


def _episode(task: Task, tokenizer, prompt_ids: list[int], sample, group: int, ex: Example,
             reward: float | None) -> Episode:
    """One graded response, its reasoning steps mapped to token ranges (runs of `task.step_tokens` tokens, or a
    dialogue's turns); a dialogue keeps its mask, its record and the prompt its engine gave it."""
    n = len(sample.token_ids)
    if task.step_turns and sample.turns is not None:
        steps = list(zip(sample.turns, sample.turns[1:] + [n]))
    elif task.step_tokens:
        steps = every_n_tokens(n, task.step_tokens)
    else:
        steps = step_token_ranges(task.response_steps(sample.text), token_char_offsets(tokenizer, sample.token_ids))
    return Episode(sample.prompt_ids or prompt_ids, list(sample.token_ids), sample.text, reward, group, ex, steps,
                   sample.finish_reason != "stop", list(sample.logprobs), sample.mask, sample.record)


def dialogues(cfg: TrainConfig, task: Task, prompter: Prompter, engine: RolloutEngine) -> RolloutEngine:
    """The engine, or for a task with tools or an environment one whose samples are dialogues (vineppo.agents)."""
    return agents.for_task(engine, task, prompter, cfg.reward_timeout_s, resume=needs(cfg.estimator).rollouts)


def _agent_stats(run: Run, prefix: str) -> dict[str, float]:
    """The dialogues' counts since the last take (turns, tool calls and their faults), summed over ranks."""
    take = getattr(run.engine, "take_stats", None)  # a dialogue engine's (vineppo.agents); others count nothing
    if take is None:
        return {}
    mine = take()
    names = sorted({k for part in dist.all_gather_objects(sorted(mine)) for k in part})
    return {prefix + k: v for k, v in zip(names, dist.all_sum([mine.get(k, 0.0) for k in names]))}


def _informative(episodes: list[Episode], keep: int) -> list[Episode]:
    """The episodes of `keep` prompts over all ranks: prompts whose responses differ in reward first, then the
    rest, each in draw order; kept prompts are numbered 0..keep-1 in that order, the same on every rank.

    A prompt whose responses all agree gives GRPO and RLOO no signal and VinePPO little (its states are mostly
    decided), so the expensive Monte Carlo and update go to the prompts that can teach something.
    """
    groups = _outcomes(episodes)
    mixed = {g for part in dist.all_gather_objects(groups) for g, rewards in part.items() if len(rewards) > 1}
    drawn = sorted({g for part in dist.all_gather_objects(list(groups)) for g in part})
    chosen = sorted(drawn, key=lambda g: (g not in mixed, g))[:keep]
    number = {g: k for k, g in enumerate(chosen)}
    return [dataclasses.replace(ep, group=number[ep.group]) for ep in episodes if ep.group in number]


def _outcomes(episodes: list[Episode]) -> dict[int, set[float]]:
    """The rewards seen per prompt."""
    return {g: {episodes[i].reward for i in members} for g, members in groups(episodes).items()}


def _mixed_prompts(episodes: list[Episode]) -> int:
    """Prompts whose responses differ in reward: a batch without any gives GRPO/RLOO no signal, and VinePPO rarely."""
    return sum(len(r) > 1 for r in _outcomes(episodes).values())


class _SignalWatch:
    """Warns once per run when NO_SIGNAL_ITERATIONS iterations in a row have no prompt with mixed outcomes."""

    def __init__(self, enabled: bool):
        self.enabled, self.flat, self.warned = enabled, 0, False

    def update(self, metrics: dict[str, float]) -> None:
        """Count this iteration; print the warning (one line) the first time the count reaches the limit."""
        self.flat = self.flat + 1 if metrics["train/mixed_prompts"] == 0 else 0
        if self.flat < NO_SIGNAL_ITERATIONS or self.warned or not self.enabled:
            return
        self.warned = True
        console.print(f"warning: {self.flat} iterations in a row without a prompt whose responses differ in reward "
                      f"(train/reward {metrics['train/reward']:.2f}): the outcomes give no learning signal. Likely "
                      f"causes: answers in a format the grader cannot parse (see `parsable` in `vineppo eval --json`), "
                      f"or --max-new-tokens too small ({metrics['train/truncated']:.0%} of responses cut off)",
                      highlight=False, markup=False, soft_wrap=True)


def _behaviours(scores: dict[str, float]) -> dict[str, float] | None:
    """The behaviour shares among an evaluation's samples ({} keys of test/behaviour/NAME), or None."""
    shares = {k.rsplit("/", 1)[1]: v for k, v in scores.items() if k.startswith("test/behaviour/")}
    return shares or None


def _load_data(cfg: TrainConfig, task: Task) -> tuple[list[Example], list[Example], list[Example]]:
    """The training set, the evaluated test problems and the validation problems, read before any model loads."""
    train_set = task.load("train", cfg.data, cfg.data_seed)
    if not train_set:
        raise UserError(f"task {cfg.task}: the training set is empty")
    val_set = task.load("validation", cfg.data, cfg.data_seed)[: cfg.val_problems] if cfg.val_problems else []
    if not cfg.eval_problems:
        return train_set, [], val_set
    try:
        test_set = task.load(cfg.eval_split, cfg.eval_data, cfg.data_seed)
    except UserError as e:  # the loaders name --data, the file flag of the other commands; here it is --eval-data
        raise UserError(str(e).replace("--data", "--eval-data")) from None
    return train_set, test_set[: cfg.eval_problems], val_set


def _check_lengths(cfg: TrainConfig, prompter: Prompter, model, train_set: list[Example],
                   test_set: list[Example], val_set: list[Example]) -> None:
    """Refuse, before any work, a prompt that with --max-new-tokens does not fit the model's context or one engine row."""
    ctx = context_length(model)
    for split, examples in (("training", train_set), (cfg.eval_split, test_set), ("validation", val_set)):
        if not examples:
            continue
        lengths = [len(ids) for ids in prompter.encode(examples)]
        n = max(lengths)
        ex = examples[lengths.index(n)]
        where = f"{split} problem {ex.id!r}: its prompt is {n} tokens"
        if n >= ctx:
            raise UserError(f"{where}; the model's context is {ctx} (leave out the long problems)")
        if n + cfg.max_new_tokens > ctx:
            raise UserError(f"{where}, and with --max-new-tokens {cfg.max_new_tokens} it exceeds the model's context "
                            f"({ctx}); lower --max-new-tokens to {ctx - n} or leave out the long problems")
        if cfg.token_budget and n + cfg.max_new_tokens > cfg.token_budget:
            raise UserError(f"--token-budget {cfg.token_budget} is smaller than one row: {where}, plus "
                            f"--max-new-tokens {cfg.max_new_tokens}")


@contextmanager
def _disk_errors(out: Path):
    """A failed write of config, record or summary as one line: what failed and that the checkpoints are intact."""
    try:
        yield
    except UserError as e:
        kept = runs.latest(out)
        raise UserError(f"{e}; nothing was lost: " + (f"the checkpoints in {kept.parent} are intact" if kept else
                                                       "no training had been done yet")) from None
    except OSError as e:  # metrics, config or record: the work since the last checkpoint is what a resume redoes
        kept = runs.latest(out)
        raise UserError(f"cannot write in {out}: {runs.reason(e)}; " + (
            f"the checkpoints in {kept.parent} are intact: --resume {out} continues from {kept.name}" if kept else
            "no checkpoint had been saved yet")) from None


def _sft_model(cfg: TrainConfig, train_missing: bool = True) -> Path | str:
    """The starting model: the given one, or the task's default SFT model (`sft.default_model`)."""
    if cfg.model != "auto":
        return cfg.model
    folder = default_model(cfg.task, cfg.data, train_missing=False)
    if train_missing and not is_saved_model(folder):
        console.print(f"--model auto: no SFT model of {cfg.task} yet; training one first with `vineppo sft`'s defaults "
                      f"(saved to {folder} and reused by later runs), then RL", highlight=False, soft_wrap=True)
    return default_model(cfg.task, cfg.data, train_missing)


def _run_dir(cfg: TrainConfig) -> Path:
    if cfg.out:
        return Path(cfg.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.algo}-{cfg.task}-{stamp}"
