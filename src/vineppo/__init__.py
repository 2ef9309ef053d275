"""vineppo: RL fine-tuning of language models with Monte Carlo credit assignment (VinePPO).

The Python API: `from vineppo import TrainConfig, train, evaluate` (vineppo.api). The names load on first use,
so the command line starts without torch.
"""

__version__ = "0.1.0"
__all__ = ["TrainConfig", "evaluate", "train"]


def __getattr__(name: str):
    if name in ("train", "evaluate"):
        from vineppo import api  # loads torch and transformers: only when the Python API is used

        return getattr(api, name)
    if name == "TrainConfig":
        from vineppo.core.config import TrainConfig  # the settings, loaded when asked for (the CLI starts without them)

        return TrainConfig
    raise AttributeError(f"module 'vineppo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
