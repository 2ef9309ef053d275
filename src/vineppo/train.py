"""`vineppo train`: the RL loop. Sample -> grade -> credit assignment -> PPO update -> evaluate -> checkpoint.

One loop serves every algorithm; they differ only in the credit estimator (vineppo.credit) and its
settings (vineppo.config.ALGOS). Read `train` top to bottom.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from vineppo import config as configs
from vineppo import distributed as dist
from vineppo.config import TrainConfig
from vineppo.credit import CreditContext, Episode, get_estimator
from vineppo.engine import Engine, SamplingParams
from vineppo.errors import UserError
from vineppo.grading import outcome_reward
from vineppo.ppo import Critic, UpdateConfig, mean_std, ppo_update, whiten
from vineppo.prompts import Prompter, save_format
from vineppo.steps import step_token_ranges, token_char_offsets
from vineppo.tasks import Example, Task, get_task
from vineppo.tracking import Tracker, console, progress_bar

DEFAULT_PRESET = "arith-tiny"


def train(cfg: TrainConfig, resume: Path | None = None) -> dict:
    """Run (or resume) RL training as configured; returns the run summary."""
    device = dist.init(cfg.device)
    main = dist.is_main()
    task = get_task(cfg.task)
    out = Path(resume) if resume else _run_dir(cfg)
    estimator = get_estimator(cfg.estimator)

    # Models: the policy, its frozen SFT reference, and the critic when the estimator uses one.
    model_dir = _sft_model(cfg) if main else None
    model_dir = str(dist.broadcast_object(str(model_dir) if model_dir else None))
    from vineppo.models import load_model

    policy, tokenizer = load_model(model_dir, device=str(device), verbose=main)
    reference = copy.deepcopy(policy).requires_grad_(False)
    critic = Critic.from_model(policy) if cfg.estimator == "gae" else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr) if critic else None
    engine = Engine(policy, tokenizer, token_budget=cfg.token_budget)
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(task.stop))
    update_cfg = UpdateConfig(cfg.epochs, cfg.minibatch, cfg.micro_batch, cfg.clip, cfg.kl_coef, cfg.temperature,
                              cfg.grad_clip, cfg.value_clip)

    prompter = Prompter(task, tokenizer, cfg.prompt_format, model=model_dir, data=cfg.data, seed=cfg.data_seed)
    train_set = task.load("train", cfg.data, cfg.data_seed)
    test_set = task.load(cfg.eval_split, cfg.eval_data, cfg.data_seed)[: cfg.eval_problems] if cfg.eval_problems else []
    if not train_set:
        raise UserError(f"task {cfg.task}: the training set is empty")

    state = {"iteration": 0, "wall_clock_s": 0.0, "sft_test_pass@1": None, "best_test_pass@1": None,
             "final_test_pass@1": None}
    if resume:
        state = _load_checkpoint(out, policy, optimizer, critic, critic_opt, device)
    elif main:
        out.mkdir(parents=True, exist_ok=True)
        configs.save(cfg, out / "config.yaml")
    dist.barrier()
    tracker = Tracker(out, cfg.tensorboard, cfg.wandb, dataclasses.asdict(cfg),
                      keep_until=state["iteration"] if resume else None, enabled=main)

    def evaluate_now(iteration: int) -> float:
        from vineppo.evaluate import evaluate

        mine = test_set[dist.rank()::dist.world()]
        result = evaluate(policy, tokenizer, task, mine, samples=cfg.eval_samples, temperature=cfg.eval_temperature,
                          top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + iteration,
                          token_budget=cfg.token_budget, prompter=prompter)
        total, n = dist.all_sum([result["pass@1"] * len(mine), float(len(mine))])
        return total / max(n, 1)

    bar = progress_bar(enabled=main)
    bar.start()
    job = bar.add_task(f"{cfg.algo} on {cfg.task}", total=cfg.iterations, completed=state["iteration"], status="")
    clock = time.perf_counter() - state["wall_clock_s"]
    if state["sft_test_pass@1"] is None and test_set:
        bar.update(job, status="evaluating the SFT model")
        state["sft_test_pass@1"] = state["best_test_pass@1"] = evaluate_now(0)
        tracker.log(0, {"test/pass@1": state["sft_test_pass@1"]})
        clock = time.perf_counter()  # the clock measures training, not the SFT model's evaluation

    for it in range(state["iteration"], cfg.iterations):
        # Every random choice of an iteration comes from (seed, iteration, rank): a resumed run, or one on
        # a different number of ranks, draws the same prompts as the uninterrupted one.
        rng = random.Random(f"{cfg.seed}-{it}")
        gen = torch.Generator(device=device).manual_seed(hash((cfg.seed, it, dist.rank())) % 2**62)
        order_gen = torch.Generator().manual_seed(hash((cfg.seed, it)) % 2**62)
        metrics: dict[str, float] = {}

        # 1. Sample: this rank's share of the iteration's prompts, several responses each.
        t0 = time.perf_counter()
        bar.update(job, status="sampling")
        picked = [rng.randrange(len(train_set)) for _ in range(cfg.prompts_per_iter)]
        mine = [(g, train_set[i]) for g, i in enumerate(picked)][dist.rank()::dist.world()]
        prompt_ids = [prompter.prompt(ex) for _, ex in mine]
        outputs = engine.generate(prompt_ids, cfg.samples_per_prompt, params, gen)

        # 2. Grade and cut into steps.
        episodes = [_episode(task, tokenizer, ids, s, g, ex) for (g, ex), ids, samples in zip(mine, prompt_ids, outputs)
                    for s in samples]
        n_trunc = sum(ep.truncated for ep in episodes)
        totals = dist.all_sum([float(len(episodes)), float(n_trunc), sum(ep.reward for ep in episodes),
                               float(sum(len(ep.response_ids) for ep in episodes))])
        if totals[1] == totals[0]:
            raise UserError(f"iteration {it + 1}: all {int(totals[0])} responses hit max_new_tokens="
                            f"{cfg.max_new_tokens} (reward 0, nothing to learn); raise --max-new-tokens or check the "
                            f"model. Last good checkpoint: {_latest(out) or 'none yet'}")
        metrics.update({"train/reward": totals[2] / totals[0], "train/truncated": totals[1] / totals[0],
                        "train/response_tokens": totals[3] / totals[0], "episodes": totals[0]})
        t1 = time.perf_counter()

        # 3. Credit assignment: per-token advantages from the configured estimator.
        bar.update(job, status="credit assignment")
        mc_engine = dist.BalancedContinuations(engine)
        ctx = CreditContext(engine=mc_engine, tokenizer=tokenizer, grade=task.grade, critic=critic, params=params,
                            generator=gen, mc_k=cfg.mc_k, mc_max_states=cfg.mc_max_states, gamma=cfg.gamma,
                            lam=cfg.gae_lambda)
        credit = estimator(episodes, ctx)
        adv_mean, adv_std = mean_std(credit.advantages)
        metrics.update({"advantage/mean": adv_mean, "advantage/std": adv_std})
        metrics.update(_reduce_stats(credit.stats))
        if mc_engine.states_run:
            metrics["mc/states_run"] = dist.all_sum([float(mc_engine.states_run)])[0]
        advantages = whiten(credit.advantages) if cfg.whiten_advantages else credit.advantages
        t2 = time.perf_counter()

        # 4. PPO update (the same code for every algorithm).
        bar.update(job, status="updating")
        policy.train()
        try:
            stats = ppo_update(policy, reference, optimizer, [ep.prompt_ids for ep in episodes],
                               [ep.response_ids for ep in episodes], advantages, update_cfg, tokenizer.pad_token_id,
                               order_gen, critic, critic_opt, credit.returns, credit.values,
                               ids=[ep.group * cfg.samples_per_prompt + j % cfg.samples_per_prompt
                                    for j, ep in enumerate(episodes)])
        except FloatingPointError as e:
            raise UserError(f"iteration {it + 1}: {e}; try a lower --lr. Nothing was saved after the last good "
                            f"checkpoint: {_latest(out) or 'none yet'}") from None
        policy.eval()
        stats = dict(zip(stats, dist.all_sum(list(stats.values()))))
        tok = max(stats["tokens"], 1.0)
        metrics.update({"loss": stats["loss"] / tok, "kl": stats["kl"] / tok, "clip_fraction": stats["clipped"] / tok,
                        "entropy": stats["entropy"] / tok, "grad_norm": stats["grad_norm"] / max(stats["steps"], 1)})
        if critic is not None:
            metrics["value_loss"] = stats["value_loss"] / tok
        t3 = time.perf_counter()
        metrics.update({"time/sampling_s": t1 - t0, "time/credit_s": t2 - t1, "time/update_s": t3 - t2})

        # 5. Evaluate, log, checkpoint.
        done = it + 1
        if test_set and (done == cfg.iterations or (cfg.eval_every and done % cfg.eval_every == 0)):
            bar.update(job, status="evaluating")
            acc = evaluate_now(done)
            metrics["test/pass@1"] = acc
            state["final_test_pass@1"] = acc
            state["best_test_pass@1"] = max(acc, state["best_test_pass@1"] or 0.0)
        state["iteration"] = done
        state["wall_clock_s"] = time.perf_counter() - clock
        metrics["time/wall_clock_s"] = state["wall_clock_s"]
        tracker.log(done, metrics)
        if done == cfg.iterations or (cfg.save_every and done % cfg.save_every == 0):
            bar.update(job, status="saving")
            _save_checkpoint(out, policy, prompter, optimizer, critic, critic_opt, state, cfg.keep_checkpoints)
        status = f"reward {metrics['train/reward']:.3f}" + (f" test {metrics['test/pass@1']:.3f}"
                                                            if "test/pass@1" in metrics else "")
        bar.update(job, advance=1, status=status)
        if main and not console.is_terminal:
            console.print(f"iter {done}/{cfg.iterations} {status} ({state['wall_clock_s']:.0f}s)")

    bar.stop()
    tracker.close()
    summary = {k: state[k] for k in ("sft_test_pass@1", "final_test_pass@1", "best_test_pass@1")}
    summary.update({"iterations": state["iteration"], "wall_clock_s": state["wall_clock_s"]})
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["out"] = str(out)
    return summary


def _episode(task: Task, tokenizer, prompt_ids: list[int], sample, group: int, ex: Example) -> Episode:
    """Grade one sampled response and map its reasoning steps to token ranges."""
    reward = outcome_reward(task.grade, sample.text, ex.answer, sample.finish_reason)
    offsets = token_char_offsets(tokenizer, sample.token_ids)
    steps = step_token_ranges(task.split_steps(sample.text), offsets)
    return Episode(prompt_ids, list(sample.token_ids), sample.text, reward, group, ex.answer, steps,
                   sample.finish_reason != "stop")


def _reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """Counts (mc/*) are summed over ranks; other statistics are averaged."""
    keys = sorted(stats)
    summed = dist.all_sum([stats[k] for k in keys])
    return {k: v if k.startswith("mc/") else v / dist.world() for k, v in zip(keys, summed)}


def _sft_model(cfg: TrainConfig) -> Path | str:
    """The starting model: the given one, or the task's default tiny SFT model (trained once, then cached)."""
    if cfg.model != "auto":
        return cfg.model
    from vineppo.sft import ensure_sft_model

    return ensure_sft_model(cfg.task)


def _run_dir(cfg: TrainConfig) -> Path:
    if cfg.out:
        out = Path(cfg.out)
        if (out / "config.yaml").exists():
            raise UserError(f"--out {out} already holds a run; use --resume {out} to continue it, or another --out")
        return out
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.algo}-{cfg.task}-{stamp}"


# Checkpoints: runs/X/checkpoints/iter-000010/{model files, vineppo.json, optimizer.pt, critic.pt, state.json}.
# A checkpoint is written to a temporary folder and renamed into place, and `latest` is replaced atomically
# after that, so a crash mid-write never leaves a broken latest checkpoint.

def _latest(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def _save_checkpoint(out: Path, policy, prompter: Prompter, optimizer, critic, critic_opt, state: dict,
                     keep: int) -> None:
    if not dist.is_main():
        dist.barrier()
        return
    root = out / "checkpoints"
    name = f"iter-{state['iteration']:06d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_pretrained(tmp, safe_serialization=True)
    prompter.tokenizer.save_pretrained(tmp)
    save_format(tmp, prompter.format)  # the checkpoint evaluates and trains on in the format it learned
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if critic is not None:
        torch.save({"critic": critic.state_dict(), "optimizer": critic_opt.state_dict()}, tmp / "critic.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(name + "\n")
    os.replace(pointer_tmp, root / "latest")
    for old in sorted(p for p in root.glob("iter-*") if p.is_dir())[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _load_checkpoint(out: Path, policy, optimizer, critic, critic_opt, device) -> dict:
    from safetensors.torch import load_file

    ckpt = _latest(out)
    if ckpt is None or not ckpt.is_dir():
        raise UserError(f"--resume {out}: no checkpoint found (expected {out / 'checkpoints' / 'latest'})")
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(f, device=str(device)))
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # tied embeddings are not saved twice
        raise UserError(f"{ckpt}: checkpoint does not match the model ({len(missing)} missing, {len(unexpected)} extra)")
    policy.tie_weights()
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device))
    if critic is not None:
        saved = torch.load(ckpt / "critic.pt", map_location=device)
        critic.load_state_dict(saved["critic"])
        critic_opt.load_state_dict(saved["optimizer"])
    return json.loads((ckpt / "state.json").read_text())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `vineppo train`: --config, --resume, --json, and one flag per TrainConfig field."""
    p.add_argument("--config", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR from its last checkpoint")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    configs.add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Entry point of `vineppo train`."""
    overrides = configs.overrides_from(args)
    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.exists():
            raise UserError(f"--resume {args.resume}: no config.yaml there (not a run folder)")
        cfg = configs.load(saved)
        if overrides.get("iterations"):
            cfg.iterations = overrides.pop("iterations")
        if overrides:
            raise UserError(f"--resume takes only --iterations besides the run folder (got {', '.join(overrides)})")
    else:
        cfg = configs.resolve(configs.load_preset(args.config or DEFAULT_PRESET), overrides)
    try:
        summary = train(cfg, Path(args.resume) if args.resume else None)
        main = dist.is_main()
    finally:
        dist.shutdown()
    if main:
        print(json.dumps(summary) if args.json else f"run folder: {summary['out']}\n{json.dumps(summary, indent=2)}")
    return 0
