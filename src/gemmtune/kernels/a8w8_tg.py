"""8-bit GEMMs on the Triton GEMM kernel (kernels/triton_gemm.py's `_tg_kernel`): y[M, N] =
(xq[M, K] @ wq[N, K]^T) * xs * ws (+ bias), xq and wq both int8 (int32 accumulation, exact) or both
fp8 e4m3 (fp32 accumulation).

The same kernel body as the bf16 configs (TMA descriptors, persistent grid, grouped tile order,
split-K with a deterministic reduction), run on 8-bit operands: the fp32 (or converted int32) tile sum
is scaled once in the epilogue (xs one element or per row of x [M, 1]; ws one element or per column of
y [1, N]), after any split-K sum, then the bias, then the cast to y's dtype. Configs are named
`a8w8_tg_...` (the `tg_` name after the 8-bit prefix), so a table row says which family it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .skinny_a8w8 import check_operands, skinny_a8w8_ref
from .triton_gemm import TGConfig, TGKernel

a8w8_tg_ref = skinny_a8w8_ref  # dequantize both operands in fp32, fp32 matmul, bias, one cast
WHO = "a8w8 tg"


@dataclass(frozen=True)
class A8W8TGConfig(TGConfig):
    """A TGConfig run on 8-bit operands; `name` is the stable id stored in a8w8 tables."""

    PREFIX: ClassVar[str] = "a8w8_tg"

    def validate_own(self) -> None:
        super().validate_own()
        if self.bk < 32:
            raise ValueError(f"{self.name}: an 8-bit MMA step is 32 deep (block_k >= 32)")


def parse_config(name: str) -> A8W8TGConfig | None:
    """The config a kernel name spells, or None when it is not one of ours."""
    return A8W8TGConfig.parse(name)


def check(xq, wq, xs, ws, bias) -> None:
    """ValueError naming the problem when the operands are not an 8-bit GEMM this kernel runs."""
    check_operands(xq, wq, xs, ws, bias, who=WHO)
    if xq.numel() >= 2**31:
        raise ValueError(f"{WHO}: xq {tuple(xq.shape)} too large for 32-bit offsets")


def a8w8_tg_launch(kern: TGKernel, xq, wq, xs, ws, bias, y) -> torch.Tensor:
    """y (preallocated [M, N], fp32/bf16/fp16) = (xq @ wq^T) * xs * ws (+ bias) with one bound config.
    No host sync, no data-dependent allocation: graph-safe (the split-K buffers are per call)."""
    return kern(xq, wq, bias, y, xs=xs, ws=ws)


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """Output allocation like `like` (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


def gemm_a8w8_tg(xq, wq, xs, ws, bias=None, out_dtype=torch.bfloat16, cfg: A8W8TGConfig | None = None):
    """The checked one-off entry (tests, examples); the backend binds a TGKernel once instead."""
    cfg = cfg or A8W8TGConfig(128, 128, 128, 8, 8, 3)
    check(xq, wq, xs, ws, bias)
    y = _empty((xq.shape[0], wq.shape[0]), torch.empty(0, device=xq.device, dtype=out_dtype))
    tiles = -(-xq.shape[0] // cfg.bm) * -(-wq.shape[0] // cfg.bn)
    return a8w8_tg_launch(TGKernel(cfg, xq.device, lock_tiles=tiles), xq, wq, xs, ws, bias, y)
