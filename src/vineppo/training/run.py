"""A training run's state, made once by `setup`: its folder, data, models, engines, tracker and progress (`Run`), and
what a checkpoint's state.json holds of it (`RunState`). The loop itself is vineppo.training.trainer."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vineppo import agents
from vineppo.core import config as configs
from vineppo.core import distributed as dist
from vineppo.core.config import TrainConfig
from vineppo.core.errors import UserError
from vineppo.core.tracking import Tracker, console, plan, progress_bar
from vineppo.credit import needs
from vineppo.engine import RolloutEngine, SamplingParams, make_engine
from vineppo.engine.budget import auto_token_budget, update_reserve
from vineppo.engine.loading import LoadSpec, load
from vineppo.models import lora, parallel
from vineppo.models.causal_lm import context_length, disable_dropout
from vineppo.models.prompts import Prompter
from vineppo.tasks import Example, Task, get_task
from vineppo.training import runs
from vineppo.training.algorithms import Context, Models, get_algorithm, needs_reference
from vineppo.training.forward import Critic
from vineppo.training.sft import default_model, is_saved_model


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
class Data:
    """The examples a run reads, loaded before any model."""

    train: list[Example]
    test: list[Example]  # the evaluated test problems (empty: no evaluation)
    val: list[Example]  # the validation problems (empty: no model selection)


@dataclass(kw_only=True)
class Run(Context):
    """Everything the loop reads, made once by `setup`; the algorithm's update reads it as its Context (settings,
    models, engine, grader), `state` is what advances."""

    out: Path  # the run folder (locked)
    device: torch.device
    task: Task
    algorithm: Callable[..., dict[str, float]]  # vineppo.training.algorithms: the update registered under cfg.algo
    data: Data
    prompter: Prompter
    sampler: torch.nn.Module  # what the engine samples from: the policy, or the frozen SFT model (DPO+'s samples)
    eval_engine: RolloutEngine  # samples the policy: the engine itself when it does, else a native one
    tracker: Tracker
    bar: Bar
    state: RunState
    clock: float = 0.0  # perf_counter() at which wall_clock_s was 0 (the process start, less earlier runs' time)
    flat: int = 0  # iterations in a row without a prompt of mixed outcomes (the trainer warns once at a limit)
    warned: bool = False  # that warning was given
    paced: bool = False  # the expected time left was said (after this process's first iteration)


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
    data = load_data(cfg, task)
    if main:
        _announce(cfg, out, device, found, len(data.test) + len(data.val))

    # Models: the policy, its frozen SFT reference, and the critic when the estimator uses one.
    model_dir = sft_model(cfg, train_missing=not resume) if main else None
    model_dir = str(dist.broadcast_object(str(model_dir) if model_dir else None))
    if main and resume:
        runs.check_start_model(out, model_dir)
    got = load(LoadSpec(model_dir, task, cfg.prompt_format, cfg.data, cfg.data_seed, str(device),
                        policy_dtype(cfg) or "float32", engine=None, verbose=main))  # the engine: on the sampler, below
    check_lengths(cfg, got.prompter, got.model, data)
    models = build_models(cfg, got.model, device)
    policy = models.trained.policy
    sampler = {"policy": policy, "sft": models.reference}[cfg.sample_from]
    budget = token_budget(cfg, sampler, models, main)
    engine = dialogues(cfg, task, got.prompter, make_engine(cfg.engine, sampler, got.tokenizer, model_dir=model_dir,
                                                              token_budget=budget, cuda_graphs=cfg.cuda_graphs))
    eval_engine = engine if sampler is policy else dialogues(cfg, task, got.prompter, make_engine(
        "native", policy, got.tokenizer, token_budget=budget, cuda_graphs=cfg.cuda_graphs))

    state = RunState.from_json(runs.load_checkpoint(found, models.trained, device)) if resume else RunState()
    if main:  # on resume, config.yaml records the total now asked for, so a plain --resume continues to it
        with disk_errors(out):
            configs.save(cfg, out / "config.yaml")
            if not resume:
                runs.record_start_model(out, model_dir)
    dist.barrier()
    tracker = Tracker(out, cfg.tensorboard, cfg.wandb, dataclasses.asdict(cfg),
                      keep_until=state.iteration if resume else None, enabled=main)
    clock = started - state.wall_clock_s
    state.setup_s += time.perf_counter() - started
    bar = Bar(cfg, state.iteration, enabled=main, clock=clock)
    return Run(cfg=cfg, models=models, tokenizer=got.tokenizer, engine=engine, score=task.score, status=bar.status,
               params=configs.section(SamplingParams, cfg, stop=tuple(task.stop), entropy=entropy_states(cfg)),
               sampling=lambda: parallel.sampling(device, cfg.dtype, sampler, models.trained.critic),
               out=out, device=device, task=task, algorithm=algorithm, data=data, prompter=got.prompter,
               sampler=sampler, eval_engine=eval_engine, tracker=tracker, bar=bar, state=state, clock=clock)


def _announce(cfg: TrainConfig, out: Path, device: torch.device, found: list[Path], evaluated: int) -> None:
    """The run's first lines: what trains on what, its preset and folder, then its plan (and a warning for GPU-sized
    settings on a CPU). `found`: a resume's checkpoints (none for a fresh run)."""
    done = int(json.loads((found[0] / "state.json").read_text()).get("iteration", 0)) if found else 0
    console.print(f"{'resuming ' if found else ''}{cfg.algo} on {cfg.task}, preset {cfg.preset or 'none'}, "
                  f"run folder {out}", highlight=False, soft_wrap=True)
    for line in plan(cfg, device.type, done, evaluated):
        if line:
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def token_budget(cfg: TrainConfig, sampler: torch.nn.Module, models: Models, main: bool) -> int:
    """--token-budget, or when 0 the device's default (on a GPU: from the memory free once the update's gradients and
    optimiser state are set aside), said in one line."""
    if cfg.token_budget:
        return cfg.token_budget
    trained = [models.trained.policy] + ([models.trained.critic] if models.trained.critic is not None else [])
    budget, line = auto_token_budget(sampler, sum(update_reserve(m) for m in trained))
    if main and next(sampler.parameters()).device.type == "cuda":
        console.print(line, highlight=False, soft_wrap=True)
    return budget


def entropy_states(cfg: TrainConfig) -> bool:
    """True when the states are chosen by the sampler's entropies (--mc-states entropy:M): the engine records them."""
    return cfg.mc_states.startswith("entropy:")


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
    return Models(trainee, reference, optimizer, critic_trainee, critic_opt,
                  trained=runs.Trained(policy, optimizer, critic, critic_opt, cfg.fsdp))


def dialogues(cfg: TrainConfig, task: Task, prompter: Prompter, engine: RolloutEngine) -> RolloutEngine:
    """The engine, or for a task with tools or an environment one whose samples are dialogues (vineppo.agents)."""
    return agents.for_task(engine, task, prompter, cfg.reward_timeout_s, resume=needs(cfg.estimator).rollouts)


def load_data(cfg: TrainConfig, task: Task) -> Data:
    """The training set, the evaluated test problems and the validation problems, read before any model loads."""
    train_set = task.load("train", cfg.data, cfg.data_seed)
    if cfg.train_ids:
        train_set = chosen(train_set, Path(cfg.train_ids))
    if not train_set:
        raise UserError(f"task {cfg.task}: the training set is empty")
    val_set = task.load("validation", cfg.data, cfg.data_seed)[: cfg.val_problems] if cfg.val_problems else []
    if not cfg.eval_problems:
        return Data(train_set, [], val_set)
    try:
        test_set = task.load(cfg.eval_split, cfg.eval_data, cfg.data_seed)
    except UserError as e:  # the loaders name --data, the file flag of the other commands; here it is --eval-data
        raise UserError(str(e).replace("--data", "--eval-data")) from None
    return Data(train_set, test_set[: cfg.eval_problems], val_set)


def chosen(examples: list[Example], path: Path) -> list[Example]:
    """The examples whose ids `path` lists, one a line (blank lines and # comments skipped), in its order."""
    by_id = {ex.id: ex for ex in examples}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"--train-ids {path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if name not in by_id:
            raise UserError(f"--train-ids {path}:{n}: no training example {name!r} (ids look like {examples[0].id!r})"
                            if examples else f"--train-ids {path}: the training split is empty")
        out.append(by_id[name])
    return out


def check_lengths(cfg: TrainConfig, prompter: Prompter, model, data: Data) -> None:
    """Refuse, before any work, a prompt that with --max-new-tokens does not fit the model's context or one engine row."""
    ctx = context_length(model)
    for split, examples in (("training", data.train), (cfg.eval_split, data.test), ("validation", data.val)):
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
def disk_errors(out: Path):
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


def sft_model(cfg: TrainConfig, train_missing: bool = True) -> Path | str:
    """The starting model: the given one, or the task's default SFT model (`sft.default_model`)."""
    if cfg.model != "auto":
        return cfg.model
    folder = default_model(cfg.task, cfg.data, train_missing=False)
    if train_missing and not is_saved_model(folder):
        console.print(f"--model auto: no SFT model of {cfg.task} yet; training one first with `vineppo sft`'s defaults "
                      f"(saved to {folder} and reused by later runs), then RL", highlight=False, soft_wrap=True)
    return default_model(cfg.task, cfg.data, train_missing)


def run_dir(cfg: TrainConfig) -> Path:
    """--out, or a fresh folder runs/ALGO-TASK-TIME."""
    if cfg.out:
        return Path(cfg.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.algo}-{cfg.task}-{stamp}"
