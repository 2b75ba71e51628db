"""gemmtune: per-shape tuned GEMMs for PyTorch, with aiter-compatible config tables."""

from __future__ import annotations

from . import tuned_gemm
from .configs import ConfigTable
from .dispatch import get_dispatcher, resolve, set_capture, set_config, set_miss_hook_factory
from .keys import GemmKey
from .ops import (
    batched_gemm,
    batched_gemm_a8w8,
    cutlass_gemm,
    fused_moe,
    gemm,
    gemm_a8w8,
    gemm_a8w8_blockscale,
    gemm_a8w8_blockscale_bpreshuffle,
    gemm_a8w8_bpreshuffle,
    gemm_bias,
    gemm_epilogue,
    gemm_gelu,
    gemm_relu,
    grouped_gemm,
    int8_gemm,
    prepare_expert_weights,
    prune_2_4,
    softcap_attention,
    sparse_gemm,
)
from .tuner.online import OnlineTuner, set_online_tuning

# Online tuning is the dispatcher's miss hook, installed before any op runs: GEMMTUNE_TUNE_ONLINE needs no call.
set_miss_hook_factory(OnlineTuner.from_env)

__version__ = "0.1.0"


def load_config(paths: str | list[str]) -> ConfigTable:
    """Read and merge tuned tables (without putting them in effect; see set_config)."""
    return ConfigTable.load(paths)


def __getattr__(name):
    # The model toolkit pulls in transformers: import it only when asked for.
    if name in ("optimize", "restore", "load_fp8_checkpoint"):
        from . import models

        return getattr(models, name)
    if name == "profile":
        from .profiling import profile

        return profile
    raise AttributeError(f"module 'gemmtune' has no attribute {name!r}")


__all__ = [
    "ConfigTable",
    "GemmKey",
    "batched_gemm",
    "batched_gemm_a8w8",
    "cutlass_gemm",
    "fused_moe",
    "gemm",
    "gemm_a8w8",
    "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle",
    "gemm_a8w8_bpreshuffle",
    "gemm_bias",
    "gemm_epilogue",
    "gemm_gelu",
    "gemm_relu",
    "grouped_gemm",
    "int8_gemm",
    "prune_2_4",
    "softcap_attention",
    "sparse_gemm",
    "get_dispatcher",
    "load_config",
    "prepare_expert_weights",
    "resolve",
    "set_capture",
    "set_config",
    "set_online_tuning",
    "tuned_gemm",
    "optimize",
    "restore",
    "load_fp8_checkpoint",
    "profile",
]
