"""gemmtune: per-shape tuned GEMMs for PyTorch, with aiter-compatible config tables."""

from __future__ import annotations

from . import tuned_gemm
from .configs import ConfigTable
from .dispatch import get_dispatcher, resolve, set_capture, set_config
from .keys import GemmKey
from .ops import gemm

__version__ = "0.1.0"


def load_config(paths: str | list[str]) -> ConfigTable:
    """Read and merge tuned tables (without putting them in effect; see set_config)."""
    return ConfigTable.load(paths)


def __getattr__(name):
    # The model toolkit pulls in transformers: import it only when asked for.
    if name in ("optimize", "restore"):
        from . import models

        return getattr(models, name)
    if name == "profile":
        from .profiling import profile

        return profile
    raise AttributeError(f"module 'gemmtune' has no attribute {name!r}")


__all__ = [
    "ConfigTable",
    "GemmKey",
    "gemm",
    "get_dispatcher",
    "load_config",
    "resolve",
    "set_capture",
    "set_config",
    "tuned_gemm",
    "optimize",
    "restore",
    "profile",
]
