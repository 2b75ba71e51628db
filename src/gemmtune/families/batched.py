"""batched: y[b] = a[b] @ b[b] for b < B, a (B, M, K), b (B, K, N); aiter's bf16_tuned_batched_gemm.csv.

Runners take the logical operands, a as a (B, M, K) view and b as a (B, K, N) view, with whatever
strides the caller's layout gives (`transA`/`transB` in the key say which layout was stored: a stored
as (B, K, M), b stored as (B, N, K)). aiter's own table has no layout columns: its CK kernel reads the
weight as (B, N, K), so its rows read as transB=True. gemmtune writes aiter's 13 columns, then
libtype, dtype, outdtype, transA, transB and the verified M range (aiter reads its tables by column name
and ignores the rest).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import FLOAT_DTYPES
from ..kernels.gemm_ref import fp32_matmul
from ..keys import dtype_name
from .base import Family, Roles, bool_col, dtype_col, generator, int_col, inv_sqrt, randn


class BatchedKey(NamedTuple):
    B: int
    M: int
    N: int
    K: int
    dtype: torch.dtype = torch.bfloat16
    outdtype: torch.dtype = torch.bfloat16
    transA: bool = False
    transB: bool = True

    def describe(self) -> str:
        lay = f"{'T' if self.transA else 'N'}{'T' if self.transB else 'N'}"
        return (f"B={self.B} M={self.M} N={self.N} K={self.K} {lay} "
                f"{dtype_name(self.dtype)}->{dtype_name(self.outdtype)}")  # fmt: skip


def stored(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A logical (B, R, C) operand stored as (B, C, R) when `transposed`: the same values, transposed strides."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if transposed else t.contiguous()


class Batched(Family):
    name = "batched"
    description = "batched 16-bit GEMM, (B, M, K) @ (B, K, N) (batched_gemm)"
    ops = ("batched_gemm",)
    env_var = "GEMMTUNE_CONFIG_BATCHED"
    aiter_tables = ("bf16_tuned_batched_gemm.csv",)
    key_type = BatchedKey
    key_columns = (
        int_col("B"), int_col("M"), int_col("N"), int_col("K"), dtype_col("dtype"),
        dtype_col("outdtype"), bool_col("transA"), bool_col("transB", default=True),
    )  # fmt: skip
    roles = Roles(libtype="libtype", solidx="kernelId", err_ratio="err_ratio")
    tuned_columns = (
        "gfx", "cu_num", "B", "M", "N", "K", "kernelId", "splitK", "us", "kernelName", "tflops", "bw",
        "errRatio", "libtype", "dtype", "outdtype", "transA", "transB",
    )  # fmt: skip
    untuned_columns = ("B", "M", "N", "K", "dtype", "outdtype", "transA", "transB")
    computed_dtypes = {"dtype": FLOAT_DTYPES, "outdtype": FLOAT_DTYPES}
    signature = frozenset({"B", "M", "N", "K"})
    excludes = frozenset({"q_dtype_w", "token"})
    name_hints = ("bf16_tuned_batched", "bf16_untuned_batched", "batched")
    kernel_hints = ("bf16_batched",)
    implied_libtype = "ck"

    def make_inputs(self, key: BatchedKey, device, sets, seed):
        gen = generator(device, seed)
        out = []
        for _ in range(sets):
            a = randn((key.B, key.M, key.K), device, gen, key.dtype)
            b = randn((key.B, key.K, key.N), device, gen, key.dtype, inv_sqrt(key.K))
            out.append((stored(a, key.transA), stored(b, key.transB)))
        return out

    def set_bytes(self, key: BatchedKey) -> int:
        return key.B * (key.M + key.N) * key.K * key.dtype.itemsize

    def reference(self, key: BatchedKey, inputs):
        a, b = inputs
        return fp32_matmul(a, b)

    def output_shape(self, key: BatchedKey):
        return (key.B, key.M, key.N)

    def check_variants(self, key: BatchedKey, inputs):
        # Views the op can pass: a batch-strided slice of a wider tensor (MLA's per-head q is a
        # transpose of (tokens, heads, dim)), and the other layout of each operand.
        a, b = inputs
        wide = torch.full((key.M, key.B, key.K + 8), float("nan"), dtype=a.dtype, device=a.device)
        wide[:, :, : key.K] = a.transpose(0, 1)
        a_heads = wide[:, :, : key.K].transpose(0, 1)
        return [
            ("a (B, M, K) strided per head", (a_heads, b), (key.B, key.M, key.N)),
            ("other layouts", (stored(a, not key.transA), stored(b, not key.transB)), (key.B, key.M, key.N)),
        ]

    def bytes(self, key: BatchedKey) -> int:
        e = key.dtype.itemsize
        return key.B * ((key.M * key.K + key.K * key.N) * e + key.M * key.N * key.outdtype.itemsize)

    def flops(self, key: BatchedKey) -> int:
        return 2 * key.B * key.M * key.N * key.K


FAMILY = Batched()
