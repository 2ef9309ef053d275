"""vineppo: RL fine-tuning of language models with Monte Carlo credit assignment (VinePPO).

The Python API (vineppo.api): `from vineppo import TrainConfig, train, evaluate`.
"""

import sys
import types

__version__ = "0.1.0"


class CallableModule(types.ModuleType):
    """A command's module that, called, runs the Python API's function of its name: `from vineppo import train`
    finds the module `vineppo.train` (a submodule wins over any function of that name), so the module is what a
    user calls."""

    def __call__(self, *args, **kwargs):
        from vineppo import api  # the API imports the command modules: loaded at the first call, not before

        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


def callable_module(name: str) -> None:
    """Make the loaded module `name` a CallableModule (vineppo.train, vineppo.evaluate)."""
    sys.modules[name].__class__ = CallableModule


def __getattr__(name: str):
    if name == "TrainConfig":
        from vineppo.config import TrainConfig  # the settings, loaded when asked for (the CLI starts without them)

        return TrainConfig
    raise AttributeError(f"module 'vineppo' has no attribute {name!r}")
