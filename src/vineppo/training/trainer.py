"""The RL loop behind `vineppo train`: sample -> grade -> the algorithm's update -> evaluate, log, checkpoint.

One loop serves every algorithm; they differ only in the update registered under their name
(vineppo.training.algorithms: credit assignment + PPO, RestEM, DPO+) and its settings (vineppo.core.config.ALGOS).
Read `train`, then `iteration` top to bottom; the run it works on is made once by vineppo.training.run.setup. One
iteration reads in three files: this one, algorithms.py (for the PPO family: credit -> rollouts -> update -> summary)
and ppo.py (the update: minibatches of the clipped loss).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vineppo import agents
from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig, check_engine
from vineppo.core.errors import RewardError, UserError
from vineppo.core.grading import outcome_rewards
from vineppo.core.rewards import Call, Recording, TrainerState, recording
from vineppo.core.steps import every_n_tokens, step_token_ranges, token_char_offsets
from vineppo.core.tracking import Meter, console, plot_run
from vineppo.credit import Episode, flat_groups, groups
from vineppo.engine import Sample
from vineppo.models import parallel
from vineppo.tasks import Example, Task
from vineppo.training import runs
from vineppo.training.evaluation import EvalSettings, behaviour_counts, behaviour_table, evaluate
from vineppo.training.run import Run, RunState, disk_errors, run_dir, setup

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
    out = Path(resume) if resume else run_dir(cfg)
    with runs.locked(out, create=not resume, enabled=dist.is_main()):  # one run per folder, for its whole life
        run = setup(cfg, out, resume is not None, device, task, started)
        try:
            if run.state.iteration == 0 and (run.data.test or run.data.val):
                start_evaluation(run)
            for it in range(run.state.iteration, cfg.iterations):
                if iteration(run, it):
                    break
        except RewardError as e:  # a user's reward function failed: the run stops, saying what was kept
            kept = runs.latest(out)
            raise UserError(f"{e}. The run stopped; " + (f"the last good checkpoint is {kept}" if kept else
                                                         "no checkpoint had been saved yet")) from None
        return finish(run)


def start_evaluation(run: Run) -> None:
    """Evaluate the starting model (iteration 0) and log it."""
    run.bar.status("evaluating the starting model")
    t0 = time.perf_counter()
    scores = evaluate_policy(run, 0)
    run.state.start_eval_s += time.perf_counter() - t0
    run.state.start_test_pass1, run.state.start_test_behaviours = scores.get("test/pass@1"), _behaviours(scores)
    run.state.record(0, scores)
    if dist.is_main():  # the start's score as soon as it is known, not only in the final summary
        console.print("start: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if k.endswith("/pass@1")) +
                      f" ({time.perf_counter() - t0:.0f}s)", highlight=False)
    run.state.wall_clock_s = time.perf_counter() - run.clock
    with disk_errors(run.out):
        run.tracker.log(0, {**scores, "time/wall_clock_s": run.state.wall_clock_s})


@dataclass
class Drawn:
    """An iteration's prompts on this rank and what the engine sampled for them."""

    mine: list[tuple[int, Example]]  # (group: the prompt's index in the iteration's batch, its example)
    prompt_ids: list[list[int]]
    outputs: list[list[Sample]]  # per prompt, its samples


@dataclass
class Graded:
    """The responses graded and cut into steps, and the call of the reward functions that graded them."""

    sampled: list[Episode]  # every response
    episodes: list[Episode]  # what the update trains on: the rewarded ones (with --oversample, informative prompts)
    call: Call | None  # the reward functions' values and log_extra's columns on the responses (None: built-in grader)


def iteration(run: Run, it: int) -> bool:
    """Iteration `it` (from 0): sample, grade, the algorithm's update, evaluate, log, checkpoint; True if the last."""
    t0 = time.perf_counter()
    return_freed_memory()  # what the last update, evaluation and checkpoint freed
    run.bar.begin(it)
    gen, order_gen = generators(run.cfg, it, run.device)
    tell_progress(run, it)
    with recording(run.task.reward_log()) as logged:  # what the reward functions log while grading and training
        drawn = sample(run, it, gen)  # 1. this rank's share of the iteration's prompts, several responses each
        graded = grade(run, drawn)  # 2. scored in one batch, cut into steps
        sampled = sample_metrics(run, it, drawn, graded)  # (refuses a batch that is all cut off or all unrewarded)
        t1 = time.perf_counter()
        trained = update(run, it, graded.episodes, gen, order_gen)  # 3. the algorithm's update
        t2 = time.perf_counter()
    metrics = {**sampled,  # every measurement of the iteration, gathered here
               **summed(agents.counts(s for samples in drawn.outputs for s in samples)),
               **reward_stats([graded.call] if graded.call else []), **trained,
               "time/sampling_s": t1 - t0, "time/update_s": t2 - t1 - trained.get("time/credit_s", 0.0),
               **logged_metrics(logged, "metric/")}
    warn_without_signal(run, metrics)
    run.state.train_s += t2 - t0
    return record(run, it, metrics, graded, spent=t2 - t0)  # 4. evaluate, log, checkpoint


def generators(cfg: TrainConfig, it: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """Iteration `it`'s generators: sampling and data selection (seed, iteration, rank), and the minibatch order
    (seed, iteration), equal on every rank. A resumed run, or one on another number of ranks, draws the same."""
    gen = torch.Generator(device=device).manual_seed(hash((cfg.seed, it, dist.rank())) % 2**62)
    return gen, torch.Generator().manual_seed(hash((cfg.seed, it)) % 2**62)


def sample(run: Run, it: int, gen: torch.Generator) -> Drawn:
    """This rank's share of the iteration's prompts (drawn with replacement from (seed, iteration)), and
    --samples-per-prompt responses to each from the engine."""
    cfg = run.cfg
    run.bar.status("sampling")
    rng = random.Random(f"{cfg.seed}-{it}")
    picked = [rng.randrange(len(run.data.train)) for _ in range(cfg.prompts_per_iter * cfg.oversample)]
    mine = [(g, run.data.train[i]) for g, i in enumerate(picked)][dist.rank()::dist.world()]
    prompt_ids = run.prompter.encode([ex for _, ex in mine])
    meter = Meter("sampling", len(mine) * cfg.samples_per_prompt, run.bar.status)
    with parallel.sampling(run.device, cfg.dtype, run.sampler):
        outputs = run.engine.generate(prompt_ids, cfg.samples_per_prompt, run.params, gen, meter,
                                      examples=[ex for _, ex in mine])
    return Drawn(mine, prompt_ids, outputs)


def grade(run: Run, drawn: Drawn) -> Graded:
    """The responses scored in one batch and cut into steps; a response without a reward (a custom reward's None) is
    left out of the update; with --oversample, the prompts whose responses differ in reward are kept first."""
    run.bar.status("grading")
    with recording(run.task.reward_log()) as calls:
        sampled = graded_episodes(run.task, run.tokenizer, [(g, ex, ids, s) for (g, ex), ids, samples in
                                                            zip(drawn.mine, drawn.prompt_ids, drawn.outputs)
                                                            for s in samples])
    rewarded = [ep for ep in sampled if ep.reward is not None]
    episodes = _informative(rewarded, run.cfg.prompts_per_iter) if run.cfg.oversample > 1 else rewarded
    return Graded(sampled, episodes, calls.calls[-1] if calls.calls else None)


def update(run: Run, it: int, episodes: list[Episode], gen: torch.Generator,
           order_gen: torch.Generator) -> dict[str, float]:
    """The algorithm's update on this iteration's episodes (credit + PPO, RestEM or DPO+), then the engine's weights
    brought up to date; its metrics."""
    try:
        metrics = run.algorithm(episodes, dataclasses.replace(run, generator=gen, order_generator=order_gen))
    except FloatingPointError as e:
        raise UserError(f"iteration {it + 1}: {e}; try a lower --lr. Nothing was saved after the last good "
                        f"checkpoint: {runs.latest(run.out) or 'none yet'}") from None
    run.engine.push_weights(run.sampler)  # vLLM samples from its own copy of the weights: reload it (native: nothing)
    return_freed_memory()  # the update's, before an evaluation
    return metrics


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim); False where there is none to call."""
    # glibc keeps the heap an iteration frees for reuse, but the next iteration's tensors differ in size: without
    # this a CPU run's resident set keeps GBs it no longer uses (measured: results/agents/PROTOCOL-guess-number.md).
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def record(run: Run, it: int, metrics: dict[str, float], graded: Graded, spent: float) -> bool:
    """Step 4 of iteration `it` (which took `spent` training seconds): evaluate, log, write a completions table,
    checkpoint; True if it is the last."""
    cfg, state, done = run.cfg, run.state, it + 1
    last = done == cfg.iterations or budget_spent(cfg.time_budget_s, state.train_s, spent)
    if (run.data.test or run.data.val) and (last or (cfg.eval_every and done % cfg.eval_every == 0)):
        run.bar.status("evaluating")
        t0 = time.perf_counter()
        scores = evaluate_policy(run, done)
        state.eval_s += time.perf_counter() - t0
        metrics.update(scores)
        state.final_test_pass1, state.final_test_behaviours = scores.get("test/pass@1"), _behaviours(scores)
        state.record(done, scores)
    state.iteration, state.wall_clock_s = done, time.perf_counter() - run.clock
    metrics.update({"time/wall_clock_s": state.wall_clock_s, "time/train_s": state.train_s})
    table = completions_table(run, graded.sampled, graded.call) if last or done == 1 or (
        cfg.completions_every and done % cfg.completions_every == 0) else None
    with disk_errors(run.out):
        run.tracker.log(done, metrics)
        if table is not None:
            run.tracker.table(done, table)
    if last or (cfg.save_every and done % cfg.save_every == 0):
        run.bar.status("saving")
        t0 = time.perf_counter()
        keep = runs.Keep(cfg.keep_checkpoints, cfg.save_weights_only)
        runs.save_checkpoint(run.out, run.models.trained, run.tokenizer, state.to_json(), keep,
                             record=(run.prompter.format, cfg.dtype))
        state.save_s += time.perf_counter() - t0
    status = f"reward {metrics['train/reward']:.3f}" + (f" test {metrics['test/pass@1']:.3f}"
                                                        if "test/pass@1" in metrics else "")
    run.bar.advance(status)
    if dist.is_main() and not console.is_terminal:
        console.print(f"iter {done}/{cfg.iterations} {status} ({state.wall_clock_s:.0f}s)")
    if not run.paced and not last and dist.is_main():
        run.paced = True
        console.print(pace(cfg, done, spent, state), highlight=False, soft_wrap=True)
    return last


def pace(cfg: TrainConfig, done: int, spent: float, state: RunState) -> str:
    """The time the run has left, from what its first iteration here (`spent` training seconds) and its start's
    evaluation measured: iterations left (fewer where --time-budget-s ends it) and evaluations left."""
    left = cfg.iterations - done
    if cfg.time_budget_s > 0:
        left = min(left, max(0, int((cfg.time_budget_s - state.train_s) // max(spent, 1e-9))))
    every = [i for i in range(done + 1, done + left + 1) if cfg.eval_every and i % cfg.eval_every == 0]
    evals = (len(every) + int(left > 0 and done + left not in every)) if cfg.eval_problems else 0  # and the last
    measured = f"iteration {done} took {spent:.0f} s" + (f" and an evaluation {state.start_eval_s:.0f} s"
                                                        if evals and state.start_eval_s else "")
    seconds = left * spent + evals * state.start_eval_s
    return (f"pace: {measured}: about {seconds / 60:.0f} minutes more ({left} iteration{'s' * (left != 1)}, "
            f"{evals} evaluation{'s' * (evals != 1)}; checkpoints not counted)")


def budget_spent(budget_s: float, train_s: float, spent: float) -> bool:
    """True when --time-budget-s has no room for one more iteration as long as the last (`spent`): the run stops
    before an iteration that would overshoot, not after it. The mean over ranks, so every rank stops together; no
    collective without a budget."""
    if budget_s <= 0:
        return False
    train_s, spent = (x / dist.world() for x in dist.all_sum([train_s, spent]))
    return train_s + spent > budget_s


def evaluate_policy(run: Run, iteration: int) -> dict[str, float]:
    """test/pass@1 and val/pass@1 (for the splits that are evaluated) of the policy now, the test behaviours, and
    what the reward functions logged while scoring them (test/metric/NAME)."""
    cfg, scores = run.cfg, {}
    tell_progress(run, iteration)
    settings = EvalSettings.of(cfg, seed=cfg.seed + iteration)
    with recording(run.task.reward_log()) as logged:
        for key, examples in (("test/pass@1", run.data.test), ("val/pass@1", run.data.val)):
            if not examples:
                continue
            mine = examples[dist.rank()::dist.world()]
            meter = Meter(f"evaluating {key.split('/')[0]}", len(mine) * (settings.samples + 1), run.bar.status)
            with parallel.sampling(run.device, cfg.dtype, run.models.trained.policy):
                result = evaluate(run.eval_engine, run.task, mine, settings, run.prompter, progress=meter)
            total, n = dist.all_sum([result["pass@1"] * len(mine), float(len(mine))])
            scores[key] = total / max(n, 1)
            if run.task.behaviour and key == "test/pass@1":  # which ways of answering the samples took, how well
                table = behaviour_table(run.task, dist.all_sum(behaviour_counts(run.task, result["results"])))
                scores.update({f"test/behaviour/{name}": v["share"] for name, v in table.items()})
                scores.update({f"test/behaviour_pass@1/{name}": v["pass@1"] for name, v in table.items()
                               if v["pass@1"] is not None})
    return scores | logged_metrics(logged, "test/metric/")


def finish(run: Run) -> dict:
    """Close the bar and tracker, draw the run's plot, write summary.json; returns the summary."""
    run.bar.stop()
    run.tracker.close()
    main, state = dist.is_main(), run.state.to_json()
    if main:
        with disk_errors(run.out):
            plot_run(run.out)
    summary = {k: state[k] for k in ("start_test_pass@1", "final_test_pass@1", "best_test_pass@1")}
    if state["start_test_pass@1"] is not None and state["final_test_pass@1"] is not None:
        summary["gain"] = state["final_test_pass@1"] - state["start_test_pass@1"]
    summary.update({k: state[k] for k in ("start_test_behaviours", "final_test_behaviours") if state.get(k)})
    summary.update({"iterations": state["iteration"], **{k: state[k] for k in TIMES},
                    "time_budget_reached": run.cfg.time_budget_s > 0 and (state["iteration"] < run.cfg.iterations or
                                                                          state["train_s"] >= run.cfg.time_budget_s)})
    if run.data.val:  # the model selection: the iteration with the best validation pass@1, and its test pass@1
        summary.update({k: state[k] for k in ("best_val_iteration", "best_val_pass@1", "test_at_best_val_pass@1")})
    summary = rounded(summary)
    summary.update({k.replace("start_", "sft_"): summary[k] for k in ALIASES if k in summary})
    if main:
        with disk_errors(run.out):
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


# A drawn response: (its group: the prompt's index in the iteration's batch, the example, the prompt's ids, the sample).
Draw = tuple[int, Example, list[int], Sample]


def graded_episodes(task: Task, tokenizer, drawn: list[Draw]) -> list[Episode]:
    """Drawn responses scored in one batch (Task.score) and cut into steps."""
    rewards = outcome_rewards(task.score, [ex for _, ex, _, _ in drawn], [s for *_, s in drawn])
    return [_episode(task, tokenizer, d, r) for d, r in zip(drawn, rewards)]


def _episode(task: Task, tokenizer, drawn: Draw, reward: float | None) -> Episode:
    """One graded response, its reasoning steps mapped to token ranges (runs of `task.step_tokens` tokens, or a
    dialogue's turns); a dialogue keeps its turns and the prompt its engine gave it."""
    group, ex, prompt_ids, sample = drawn
    n, turns = len(sample.token_ids), sample.dialogue
    if task.step_turns and turns is not None:
        steps = list(zip(turns.starts, turns.starts[1:] + [n]))
    elif task.step_tokens:
        steps = every_n_tokens(n, task.step_tokens)
    else:
        steps = step_token_ranges(task.response_steps(sample.text), token_char_offsets(tokenizer, sample.token_ids))
    return Episode(turns.prompt_ids if turns is not None else prompt_ids, list(sample.token_ids), sample.text, reward,
                   group, ex, steps, sample.finish_reason != "stop", list(sample.logprobs), sample.entropies, turns)


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


def warn_without_signal(run: Run, metrics: dict[str, float]) -> None:
    """Count iterations in a row without a prompt of mixed outcomes; at NO_SIGNAL_ITERATIONS, warn once (one line)."""
    run.flat = run.flat + 1 if metrics["train/mixed_prompts"] == 0 else 0
    if run.flat < NO_SIGNAL_ITERATIONS or run.warned or not dist.is_main():
        return
    run.warned = True
    console.print(f"warning: {run.flat} iterations in a row without a prompt whose responses differ in reward "
                  f"(train/reward {metrics['train/reward']:.2f}): the outcomes give no learning signal. Likely "
                  f"causes: answers in a format the grader cannot parse (see `parsable` in `vineppo eval --json`), "
                  f"or --max-new-tokens too small ({metrics['train/truncated']:.0%} of responses cut off)",
                  highlight=False, markup=False, soft_wrap=True)


def _behaviours(scores: dict[str, float]) -> dict[str, float] | None:
    """The behaviour shares among an evaluation's samples ({} keys of test/behaviour/NAME), or None."""
    shares = {k.rsplit("/", 1)[1]: v for k, v in scores.items() if k.startswith("test/behaviour/")}
    return shares or None


def tell_progress(run: Run, it: int) -> None:
    """Tell the reward functions (`trainer_state`) how far training is: `it` iterations done."""
    if (log := run.task.reward_log()) is not None:
        log.state = TrainerState(global_step=it, max_steps=run.cfg.iterations,
                                 epoch=it * run.cfg.prompts_per_iter / len(run.data.train))


def reward_stats(calls: list[Call]) -> dict[str, float]:
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


def logged_metrics(logged: Recording, prefix: str) -> dict[str, float]:
    """The mean over all ranks of each scalar the reward functions gave `log_metric` in a recording, as PREFIX+NAME."""
    sums: dict[str, list[float]] = {}
    for part in dist.all_gather_objects(logged.sums()):
        for name, (total, n) in part.items():
            sums.setdefault(name, [0.0, 0])
            sums[name][0] += total
            sums[name][1] += n
    return {prefix + name: total / n for name, (total, n) in sorted(sums.items())}


def summed(counts: dict[str, float]) -> dict[str, float]:
    """Counts summed over all ranks, whichever names each rank has."""
    names = sorted({k for part in dist.all_gather_objects(sorted(counts)) for k in part})
    return dict(zip(names, dist.all_sum([counts.get(k, 0.0) for k in names])))


def completions_table(run: Run, sampled: list[Episode], call: Call | None) -> list[dict]:
    """The first TABLE_ROWS sampled responses over all ranks, as rows of the completions table: the prompt (text or
    chat turns), the response, its reward, how it ended, each reward function's value and log_extra's columns."""
    finished = [i for i, ep in enumerate(sampled) if not ep.truncated]  # what the reward functions were called on
    whole = call and all(len(v) == len(finished) for v in [*call.values.values(), *call.extra.values()])
    scored = {i: k for k, i in enumerate(finished)} if whole else {}
    rows = []
    for i, ep in enumerate(sampled[:TABLE_ROWS]):
        row = {"example": ep.example.id, "prompt": run.task.chat_turns(ep.example) or ep.example.problem,
               "completion": ep.dialogue.messages if ep.dialogue is not None else ep.text,  # a dialogue: messages
               "reward": ep.reward, "finish": "length" if ep.truncated else "stop"}
        if i in scored:
            row.update({name: values[scored[i]] for name, values in call.values.items()})
            row.update({column: values[scored[i]] for column, values in call.extra.items()})
        rows.append(row)
    return [row for part in dist.all_gather_objects(rows) for row in part][:TABLE_ROWS]


def sample_metrics(run: Run, it: int, drawn: Drawn, graded: Graded) -> dict[str, float]:
    """The iteration's sample statistics over all ranks; refuses, before its update, an iteration whose responses all
    hit the length limit or all went without a reward."""
    mine, outputs, sampled, episodes = drawn.mine, drawn.outputs, graded.sampled, graded.episodes
    rewarded = [ep for ep in sampled if ep.reward is not None]
    n, truncated, reward, tokens, mixed, prompts, kept_mixed, scored, flat, kept = dist.all_sum([
        float(len(sampled)), float(sum(ep.truncated for ep in sampled)), sum(ep.reward for ep in rewarded),
        float(sum(len(ep.response_ids) for ep in sampled)), float(_mixed_prompts(rewarded)), float(len(mine)),
        float(_mixed_prompts(episodes)), float(len(rewarded)), *map(float, flat_groups(episodes))])
    if truncated == n:
        raise UserError(f"iteration {it + 1}: all {int(n)} responses hit max_new_tokens={run.cfg.max_new_tokens} "
                        f"(reward 0, nothing to learn); raise --max-new-tokens or check the model. Last good "
                        f"checkpoint: {runs.latest(run.out) or 'none yet'}")
    if scored == 0:
        raise UserError(f"iteration {it + 1}: no response of {int(n)} got a reward (the reward functions returned None "
                        f"for all of them). Last good checkpoint: {runs.latest(run.out) or 'none yet'}")
    metrics = {"train/reward": reward / scored, "train/truncated": truncated / n, "train/response_tokens": tokens / n,
               "episodes": n, "train/mixed_prompts": mixed / max(prompts, 1.0),
               "train/kept_mixed_prompts": kept_mixed / run.cfg.prompts_per_iter, "train/no_reward": 1 - scored / n,
               "signal/flat_groups": flat / max(kept, 1.0)}  # the update's groups whose rewards are all equal
    if run.task.behaviour:  # the share of each way of answering among the iteration's samples
        labels = [run.task.behaviour(ex, s.text) for (_, ex), samples in zip(mine, outputs) for s in samples]
        counts = dist.all_sum([float(labels.count(name)) for name in run.task.behaviours])
        metrics.update({f"train/behaviour/{name}": c / n for name, c in zip(run.task.behaviours, counts)})
    return metrics
