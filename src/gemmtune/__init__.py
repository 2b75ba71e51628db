"""gemmtune: per-shape tuned GEMMs for PyTorch, with aiter-compatible config tables."""

from __future__ import annotations

import os as _os

from . import tuned_gemm
from .checks import check_paths
from .configs import ConfigTable
from .dispatch import check_tables_agree, get_dispatcher, resolve, set_capture, set_config, set_miss_hook_factory
from .keys import GemmKey
from .ops.registry import exports as _op_exports
from .tuner.online import from_env as _online_tuner_from_env
from .tuner.online import set_online_tuning
from .tuner.online import set_up_from_env as _set_up_online_tuning
from .tuner.online_distributed import sync_online_rows

# Online tuning is the dispatcher's miss hook, installed before any op runs: GEMMTUNE_TUNE_ONLINE needs no call.
set_miss_hook_factory(_online_tuner_from_env)

globals().update(_op_exports())  # the public ops and helpers, as their modules declare them (ops/registry.py)
_set_up_online_tuning(_os.environ)

__version__ = "0.1.0"


def load_config(paths: str | list[str]) -> ConfigTable:
    """Read and merge tuned tables (without putting them in effect; see set_config)."""
    return ConfigTable.load(check_paths("load_config", "paths", paths))


def __getattr__(name):
    # The model toolkit pulls in transformers: import it only when asked for.
    if name in ("optimize", "restore", "load_fp8_checkpoint"):
        from . import models

        return getattr(models, name)
    if name == "profile":
        from .profiling import profile

        return profile
    raise AttributeError(f"module 'gemmtune' has no attribute {name!r}")


def __dir__():
    # The lazy names of __getattr__ are public too: dir() and tab completion list every entry of __all__.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ConfigTable",
    "check_tables_agree",
    "GemmKey",
    "get_dispatcher",
    "load_config",
    "resolve",
    "set_capture",
    "set_config",
    "set_online_tuning",
    "sync_online_rows",
    "tuned_gemm",
    "optimize",
    "restore",
    "load_fp8_checkpoint",
    "profile",
    *_op_exports(),
]
