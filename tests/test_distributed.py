"""Data parallelism on CPU with gloo: the same update with 2 processes as with 1 (replicated with DDP, or sharded
with FSDP2), and 2-process runs that resume on 1."""

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from vineppo.core.config import TrainConfig
from vineppo.models import parallel
from vineppo.training import algorithms
from vineppo.training.forward import Critic
from vineppo.training.ppo import Learner, Rollouts, UpdateConfig, ppo_update

pytestmark = pytest.mark.usefixtures("one_thread")  # the ranks run one thread each: the same float kernels here
CFG = UpdateConfig(epochs=2, minibatch=4, micro_batch=2, clip=0.2, kl_coef=0.1, temperature=0.7, grad_clip=1.0,
                   value_clip=0.2)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _critic():
    from transformers import LlamaModel

    torch.manual_seed(1)
    critic = Critic(LlamaModel(_config()), 32)
    torch.nn.init.normal_(critic.head.weight)  # a critic that has learned something, so its gradients are not tiny
    return critic


def _episodes():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(1, 50, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)]
    advantages = [torch.randn(len(r), generator=g) for r in responses]
    returns = [torch.rand(len(r), generator=g) for r in responses]
    values = [torch.rand(len(r), generator=g) for r in responses]
    return prompts, responses, advantages, returns, values


def _update(ids, fsdp=False):
    """Weights of policy and critic after a 2-epoch update on the episodes `ids` (this rank's share)."""
    cpu = torch.device("cpu")
    policy, reference, critic = _model(), _model(), _critic()
    reference = parallel.wrap(reference.requires_grad_(False), cpu, fsdp)
    policy_t, critic_t = parallel.wrap(policy, cpu, fsdp), parallel.wrap(critic, cpu, fsdp)
    prompts, responses, advantages, returns, values = _episodes()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    pick = lambda xs: [xs[i] for i in ids]  # noqa: E731
    data = Rollouts(pick(prompts), pick(responses), pick(advantages), 0, pick(returns), pick(values), ids=ids)
    ppo_update(Learner(policy_t, reference, opt, critic_t, critic_opt), data, CFG, torch.Generator().manual_seed(3))
    state = parallel.full_state(policy) if fsdp else policy.state_dict()
    critic_state = parallel.full_state(critic) if fsdp else critic.state_dict()
    return {**state, **{f"critic.{k}": v for k, v in critic_state.items()}}


def _fine_tune(ids, fsdp=False):
    """Weights after RestEM's and DPO+'s optimiser steps (algorithms.minibatch_steps: 2 epochs, likelihood on the
    episodes `ids`, this rank's share) through the model as `parallel.wrap` returns it."""
    policy = _model()
    trainee = parallel.wrap(policy, torch.device("cpu"), fsdp)
    prompts, responses, *_ = _episodes()
    ctx = algorithms.Context(cfg=TrainConfig(epochs=2, minibatch=4, micro_batch=2), tokenizer=None,
                             models=algorithms.Models(trainee, None, torch.optim.AdamW(policy.parameters(), lr=1e-2)),
                             order_generator=torch.Generator().manual_seed(3))

    def nll(idx, total):  # idx: positions in `ids`
        logp, mask = algorithms.sequence_logprobs(trainee, [prompts[ids[i]] for i in idx],
                                                  [responses[ids[i]] for i in idx], 0, ctx)
        return -(logp * mask).sum() / total, {}

    algorithms.minibatch_steps(ctx, ids, [float(len(responses[i])) for i in ids], nll)
    return parallel.full_state(policy) if fsdp else policy.state_dict()


def _worker(rank, store, out, fsdp, fn=_update):
    import torch.distributed as tdist

    log = open(f"{out}.rank{rank}.log", "w")  # the worker's own traceback, even when a signal ends it (_spawn)
    faulthandler.enable(file=log)
    try:
        _work(rank, store, out, fsdp, fn, tdist)
    except BaseException:
        traceback.print_exc(file=log)
        log.flush()
        raise
    # Leave without interpreter finalisation. Under FSDP2, DTensor's caches (sharding propagation, redistribute
    # planner, mesh topology) hold the device mesh and so the gloo group past destroy_process_group, and its worker
    # threads live on. One of them still releasing the barrier's work object (which frees an all-gather's tensors,
    # a decref that needs the GIL) while Python finalises is ended by Python (pthread_exit); the unwind through a
    # C++ destructor calls std::terminate: SIGABRT, about one spawn in 30 on a loaded 2-core machine.
    for stream in (log, sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _work(rank, store, out, fsdp, fn, tdist):
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    params = fn([0, 2, 4, 6, 7] if rank == 0 else [1, 3, 5], fsdp)  # uneven shares: rank 1 idles some steps
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in params.items()}, out)
    # Leave together: a rank that tears gloo down while its peer's worker threads still hold work can abort the peer
    # (SIGABRT seen once in CI under load).
    tdist.barrier()
    tdist.destroy_process_group()


def _spawn(tmp_path, fsdp, fn=_update):
    """Two workers running `fn`; a failure shows each worker's own traceback, not only spawn's."""
    out = tmp_path / "params.pt"
    try:
        mp.spawn(_worker, args=(str(tmp_path / "store"), str(out), fsdp, fn), nprocs=2, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        logs = "\n".join(f"--- rank {r} ---\n{Path(f'{out}.rank{r}.log').read_text()}" for r in range(2)
                         if Path(f"{out}.rank{r}.log").exists())
        raise AssertionError(f"a worker failed: {e}\n{logs}") from None
    return torch.load(out)


def _check(cmd, **kw):
    """subprocess.run(cmd) that fails with the command's own output (every rank's traceback), not only its code."""
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, **kw)
    assert done.returncode == 0, (f"{' '.join(cmd[-8:])} exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done


# Two ranks sum their gradients in another order than one process; AdamW at lr 1e-2 turns that rounding, on
# entries whose gradient is near 0, into weight differences of up to 1.3e-5 (transformers 5.24, torch 2.13).
ATOL = 1e-4


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_update_with_two_processes_equals_one(tmp_path, fsdp):
    single = _update(list(range(8)))  # one process encodes shared prompts once; the ranks pack each with its response
    double = _spawn(tmp_path, fsdp)
    start = {**_model().state_dict(), **{f"critic.{k}": v for k, v in _critic().state_dict().items()}}
    assert any(not torch.equal(start[k], single[k]) for k in single if not k.startswith("critic."))
    assert any(not torch.equal(start[k], single[k]) for k in single if k.startswith("critic."))
    assert single.keys() == double.keys()
    for k in single:  # ATOL: float rounding, not a wrong gradient (that moves weights by about lr = 1e-2)
        assert torch.allclose(single[k], double[k], atol=ATOL), k


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_restem_and_dpo_steps_with_two_processes_equal_one(tmp_path, fsdp):
    single = _fine_tune(list(range(8)))
    double = _spawn(tmp_path, fsdp, _fine_tune)
    start = _model().state_dict()
    assert any(not torch.equal(start[k], single[k]) for k in single)  # the steps did move the weights
    assert single.keys() == double.keys()
    for k in single:  # ATOL: float rounding, not a wrong gradient (that moves weights by about lr = 1e-2)
        assert torch.allclose(single[k], double[k], atol=ATOL), k


def _torchrun(n, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "vineppo",
            "train", *args]


SMALL = ["--prompts-per-iter=4", "--samples-per-prompt=4", "--max-new-tokens=64", "--mc-k=2", "--mc-max-states=4",
         "--minibatch=8", "--micro-batch=8", "--eval-problems=4", "--eval-samples=2", "--eval-every=1",
         "--save-every=1", "--tensorboard=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_process_run_counts_every_episode_and_state_once(tiny_sft, tmp_path, fsdp):
    out = tmp_path / "run"
    _check(_torchrun(2, "--model", str(tiny_sft), "--iterations=2", "--out", str(out), f"--fsdp={fsdp}", *SMALL),
           timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["episodes"] == 16
        assert r["mc/states"] > 0 and r["mc/states_run"] == r["mc/states"]
        assert r["mc/continuations"] == 2 * r["mc/states"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and 0.0 <= summary["final_test_pass@1"] <= 1.0
    ckpt = out / "checkpoints" / "iter-000002"
    assert (ckpt / "optimizer").is_dir() != (ckpt / "optimizer.pt").exists() == (not fsdp)  # shards under --fsdp
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # the gathered weights: a plain transformers folder
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_sft).parameters())


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: torchrun starts each worker in a session of its own, so killing
    torchrun's process group leaves the workers running (and holding the run folder's lock)."""
    os.kill(pid, signal.SIGSTOP)  # no new children while we look
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for kid in [int(c) for c in children.read_text().split()] if children.exists() else []:
        _kill_tree(kid)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("flags", [[], ["--fsdp=true", "--algo=ppo"]], ids=["ddp", "fsdp-ppo"])
def test_killed_two_process_run_resumes_on_one(tiny_sft, tmp_path, flags):
    out = tmp_path / "run"
    proc = subprocess.Popen(_torchrun(2, "--model", str(tiny_sft), "--iterations=3", "--out", str(out),
                                      "--eval-problems=0", *SMALL[:-5], "--save-every=1", "--tensorboard=false",
                                      *flags),
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not latest.exists():
        time.sleep(0.05)
    _kill_tree(proc.pid)
    proc.wait()
    assert latest.read_text().strip() < "iter-000003", "the run finished before it could be killed"
    _check([sys.executable, "-m", "vineppo", "train", "--resume", str(out)], timeout=600)
    rows = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3


def test_device_auto_on_single_gpu(monkeypatch):
    """--device auto on a machine with CUDA resolves to a CUDA device, in one place, for every command."""
    import vineppo.core.distributed as dist
    from vineppo.core.distributed import pick_device
    from vineppo.core.errors import UserError

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []  # nothing may touch a real GPU: these record what would have happened
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist.tdist, "init_process_group", lambda backend: calls.append(("group", backend)))
    assert pick_device("auto") == pick_device(None) == torch.device("cuda")
    assert dist.init("auto") == torch.device("cuda", 0)  # one GPU, no torchrun
    assert dist.init("cuda:1") == torch.device("cuda", 1)
    assert dist.init("cpu") == torch.device("cpu")
    assert calls == []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.init("auto") == torch.device("cuda", 1)  # under torchrun: this rank's GPU, NCCL
    assert calls == [("set_device", torch.device("cuda", 1)), ("group", "nccl")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RANK")
    assert dist.init("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="CUDA is not available"):
        dist.init("cuda")


def test_shutdown_leaves_a_process_group_it_did_not_make(tmp_path):
    import torch.distributed as tdist

    from vineppo.core import distributed as dist

    # vLLM in this process makes its own one-rank group; ending it under vLLM made its exit raise a traceback
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.shutdown()
        assert tdist.is_initialized()
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
