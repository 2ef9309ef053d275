"""Data parallelism on CPU with gloo: the same update with 2 processes as with 1, and 2-process runs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from vineppo.ppo import UpdateConfig, ppo_update

CFG = UpdateConfig(epochs=2, minibatch=4, micro_batch=2, clip=0.2, kl_coef=0.1, temperature=0.7, grad_clip=1.0,
                   value_clip=0.2)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _episodes():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(1, 50, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)]
    advantages = [torch.randn(len(r), generator=g) for r in responses]
    return prompts, responses, advantages


def _update(ids):
    policy, reference = _model(), _model()
    prompts, responses, advantages = _episodes()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    pick = lambda xs: [xs[i] for i in ids]  # noqa: E731
    ppo_update(policy, reference, opt, pick(prompts), pick(responses), pick(advantages), CFG, pad_id=0,
               generator=torch.Generator().manual_seed(3), ids=ids)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def _worker(rank, store, out):
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    params = _update(list(range(rank, 8, 2)))  # strided shards, as the trainer deals prompts
    if rank == 0:
        torch.save(params, out)
    tdist.destroy_process_group()


def test_update_with_two_processes_equals_one(tmp_path):
    single = _update(list(range(8)))
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "params.pt")), nprocs=2, join=True)
    double = torch.load(tmp_path / "params.pt")
    start = _model().state_dict()
    assert any(not torch.equal(start[k], single[k]) for k in single)  # the update did move the weights
    for k in single:
        assert torch.allclose(single[k], double[k], atol=1e-5), k


def _torchrun(n, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "vineppo",
            "train", *args]


SMALL = ["--prompts-per-iter=4", "--samples-per-prompt=4", "--max-new-tokens=64", "--mc-k=2", "--mc-max-states=4",
         "--minibatch=8", "--micro-batch=8", "--eval-problems=4", "--eval-samples=2", "--eval-every=1",
         "--save-every=1", "--tensorboard=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_process_run_counts_every_episode_and_state_once(tiny_sft, tmp_path):
    out = tmp_path / "run"
    subprocess.run(_torchrun(2, "--model", str(tiny_sft), "--iterations=2", "--out", str(out), *SMALL), check=True,
                   env=ENV, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["episodes"] == 16
        assert r["mc/states"] > 0 and r["mc/states_run"] == r["mc/states"]
        assert r["mc/continuations"] == 2 * r["mc/states"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and 0.0 <= summary["final_test_pass@1"] <= 1.0


def test_killed_two_process_run_resumes_on_one(tiny_sft, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_torchrun(2, "--model", str(tiny_sft), "--iterations=3", "--out", str(out),
                                      "--eval-problems=0", *SMALL[:-5], "--save-every=1", "--tensorboard=false"),
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not latest.exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.read_text().strip() < "iter-000003", "the run finished before it could be killed"
    subprocess.run([sys.executable, "-m", "vineppo", "train", "--resume", str(out)], check=True, env=ENV,
                   capture_output=True, timeout=600)
    rows = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3


def test_device_auto_on_single_gpu(monkeypatch):
    """--device auto on a machine with CUDA resolves to a CUDA device, in one place, for every command."""
    import vineppo.distributed as dist
    from vineppo.errors import UserError
    from vineppo.models import pick_device

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
