"""Shared fixtures: a tiny arith SFT model trained once per test session (about half a minute on 2 cores)."""

from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not spin against other processes); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory) -> Path:
    """A 2-layer Llama fine-tuned briefly on arith: it writes the format and ends with EOS, mostly wrong."""
    from vineppo.training.sft import SFTConfig, run_sft

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "tiny-sft"
    # The clean references and AdamW: the model the training tests were calibrated on (with arith's default mixture
    # of premature answers it writes shorter responses, so the length reward of the learning test starts at 0.75).
    return run_sft(SFTConfig("arith", out=out, data="premature=0", max_steps=150, batch_size=16, lr=3e-3,
                             optimizer="adamw", hidden=64, layers=2, progress=False))
