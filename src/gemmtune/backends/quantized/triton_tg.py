"""The a8w8 `triton` candidates on the Triton GEMM kernel (kernels/a8w8_tg.py): `a8w8_tg_...` configs,
offered above M = 32 beside kernels/a8w8.py's `a8w8_...` ones (quantized/triton.py's
TritonA8W8Backend asks this module for them and hands it their rows).

The candidate space is lib/triton_tiles.py's `config_space` for a 1-byte key (its 8-bit tiles:
128-deep K steps, 128x128 / 128x256 / 256x128, plain, persistent, split-K and TMA variants, PDL up to
M = 256; for 8-bit keys only also split-K where a grid of several waves ends in a poor one, the
flattened persistent grid `_pf`, and for int8 256-deep TMA tiles). `DEFAULT` is what an untuned int8
key above M = 32 runs. `make_runner` compiles the config before returning (on stand-in operands that specialize
like the real ones), so a runner can be captured in a CUDA graph at once; `compile_items` names the
kernels the tuner's precompile builds that way ahead, in parallel processes.
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels._common import pdl_enabled
from ...kernels.a8w8_tg import A8W8TGConfig, a8w8_tg_launch, check, parse_config
from ...kernels.triton_gemm import TGKernel
from ...keys import GemmKey
from ..base import Runner, Solution
from ..lib.triton_tiles import (
    SMEM_MARGIN,
    cdiv,
    config_solution,
    config_space,
    hardware,
    solution_from_name,
    twin,
)

MIN_M = 33  # decode sizes stay with the a8w8_ tiles and the skinny kernels
PREFIX = "a8w8_tg_"


def is_tg_name(kernel_name: str) -> bool:
    """Does a kernel name spell one of this module's configs?"""
    return kernel_name.startswith(PREFIX) and parse_config(kernel_name) is not None


def _gemm_key(key) -> GemmKey:
    """The a16w16 key config_space prunes by: 1-byte operands pick its 8-bit tiles (int8 a few more)."""
    return GemmKey(key.M, key.N, key.K, key.bias, key.q_dtype_w, key.outdtype)


def candidates(key, device: torch.device) -> list[Solution]:
    if key.M < MIN_M:
        return []
    return [config_solution(c) for c in config_space(_gemm_key(key), hardware(device), A8W8TGConfig)]


def solution_from_row(solidx: int, kernel_name: str) -> Solution | None:
    return solution_from_name(parse_config, kernel_name, solidx)


def supports(kernel_name: str, key, device: torch.device) -> bool:
    cfg = parse_config(kernel_name)
    if cfg is None:
        return False
    hw = hardware(device)
    return cfg.smem_bytes(1) + SMEM_MARGIN <= hw.smem and (not cfg.tma or (hw.tma and key.K % 16 == 0))


def standins(key, device: torch.device) -> tuple:
    """Operands that specialize a kernel like key's (M, N twins; K, dtypes, scale kind, bias), and y."""
    m, n = twin(max(key.M, 1)), twin(key.N)
    per_tensor = key.scale == "per_tensor"
    xq = torch.randn(m, key.K, device=device).to(key.q_dtype_w)
    wq = torch.randn(n, key.K, device=device).to(key.q_dtype_w)
    xs = torch.ones((1,) if per_tensor else (m, 1), device=device)
    ws = torch.ones((1,) if per_tensor else (1, n), device=device)
    b = torch.zeros(n, device=device, dtype=key.outdtype) if key.bias else None
    return xq, wq, xs, ws, b, torch.empty((m, n), device=device, dtype=key.outdtype)


def make_runner(kernel_name: str, key, device: torch.device) -> Runner:
    cfg = parse_config(kernel_name)
    if cfg is None or not supports(kernel_name, key, device):
        raise ValueError(f"triton a8w8 cannot run {kernel_name!r} for {key} on {device}")
    if cfg.pdl and not pdl_enabled(device):
        cfg = dataclasses.replace(cfg, pdl=0)  # the same kernel, plain launch
    kern = TGKernel(cfg, device, lock_tiles=cdiv(max(key.M, 1), cfg.bm) * cdiv(key.N, cfg.bn))
    n, k, out = key.N, key.K, key.outdtype

    def run(xq, wq, xs, ws, bias):
        if xq.dim() != 2 or xq.shape[1] != k or wq.shape != (n, k):
            check(xq, wq, xs, ws, bias)
            raise ValueError(f"{cfg.name} runner for N={n} K={k} got xq {tuple(xq.shape)}, wq {tuple(wq.shape)}")
        y = torch.empty((xq.shape[0], n), device=xq.device, dtype=out)
        return a8w8_tg_launch(kern, xq, wq, xs, ws, bias, y)

    # Compile now, unless a CUDA graph is being captured (a launch there would be recorded).
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        a8w8_tg_launch(kern, *standins(key, device))
    return run


# What an untuned int8 key above M = 32 runs (quantized/policy.py; fp8 keeps cuBLASLt):
# the config that won 22 of the 36 int8 prefill points on an H100 (M 1024-4096, Llama-3-8B /
# Llama-3-70B tp8 / Qwen3-32B shapes; its non-TMA twin 2 more, the 128x256 4-stage tile 9:
# benchmarks/results/h100/a8w8_vs_bf16/prefill_int8.md), as that twin where TMA cannot run
# (K % 16 != 0, pre-Hopper).
DEFAULT = A8W8TGConfig(128, 128, 128, 8, 8, 3, tma=True)


def default_name(key, device: torch.device) -> str | None:
    """DEFAULT's name for `key`, its non-TMA twin where TMA cannot run; None below MIN_M or where
    neither fits this device."""
    if key.M < MIN_M:
        return None
    for cfg in (DEFAULT, dataclasses.replace(DEFAULT, tma=False)):
        if supports(cfg.name, key, device):
            return cfg.name
    return None


def compile_items(jobs: list, scope=None) -> list[tuple[str, tuple]]:
    """The (kernel name, key) pairs whose runners compile every kernel the a8w8_tg_ (solution, key) jobs
    need, one per distinct compiled kernel (other jobs are passed over)."""
    uniq: dict[tuple, tuple] = {}
    for sol, key in jobs:
        cfg = parse_config(sol.kernel_name)
        if cfg is None:
            continue
        kernel = dataclasses.replace(cfg, split_k=min(cfg.split_k, 2)).name  # the split is a runtime value
        sig = (kernel, key.q_dtype_w, key.scale, key.bias, key.outdtype, twin(key.N), key.K % 16 == 0, key.K % cfg.bk)
        uniq.setdefault(sig, (cfg.name, key._replace(M=MIN_M)))
    return list(uniq.values())
