"""a16w16: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), 16-bit (or fp32) inputs; aiter's bf16_tuned_gemm.csv."""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES
from ..kernels.gemm_ref import fp32_matmul
from ..keys import GemmKey
from .base import Family, bool_col, dtype_col, generator, int_col, inv_sqrt, randn

# aiter's 18 columns; gemmtune's tables add the verified M range after them (aiter reads by name).
AITER_TUNED_COLUMNS = (
    "gfx", "cu_num", "M", "N", "K", "bias", "dtype", "outdtype", "scaleAB", "bpreshuffle",
    "libtype", "solidx", "splitK", "us", "kernelName", "err_ratio", "tflops", "bw",
)  # fmt: skip


class A16W16(Family):
    name = "a16w16"
    description = "16-bit GEMM in nn.Linear layout (gemm, gemm_a16w16)"
    ops = ("gemm", "gemm_a16w16")
    env_var = "GEMMTUNE_CONFIG"
    aiter_tables = ("bf16_tuned_gemm.csv",)
    key_type = GemmKey
    key_columns = (
        int_col("M"), int_col("N"), int_col("K"), bool_col("bias"), dtype_col("dtype"),
        dtype_col("outdtype"), bool_col("scaleAB"), bool_col("bpreshuffle"),
    )  # fmt: skip
    tuned_columns = AITER_TUNED_COLUMNS
    untuned_columns = ("M", "N", "K", "bias", "dtype", "outdtype", "scaleAB", "bpreshuffle")
    computed_dtypes = {"dtype": FLOAT_DTYPES, "outdtype": FLOAT_DTYPES}
    signature = frozenset({"M", "N", "K"})
    excludes = frozenset({"B", "q_dtype_w", "kernelId", "token", "act", "alpha", "beta", "pattern"})
    name_hints = ("bf16", "a16w16")

    def make_inputs(self, key: GemmKey, device, sets, seed):
        gen = generator(device, seed)
        out = []
        for _ in range(sets):
            x = randn((key.M, key.K), device, gen, key.dtype)
            w = randn((key.N, key.K), device, gen, key.dtype, inv_sqrt(key.K))
            b = randn((key.N,), device, gen, key.dtype) if key.bias else None
            out.append((x, w, b))
        return out

    def set_bytes(self, key: GemmKey) -> int:
        return (key.N + key.M) * key.K * key.dtype.itemsize

    def reference(self, key: GemmKey, inputs):
        x, w, b = inputs
        y = fp32_matmul(x.reshape(-1, key.K), w.t())
        return y + b.float() if b is not None else y

    def output_shape(self, key: GemmKey):
        return (key.M, key.N)

    def check_variants(self, key: GemmKey, inputs):
        # The dispatcher also hands runners x [1, M, K] views with padded (non-contiguous) rows.
        x, w, b = inputs
        wide = torch.full((key.M, key.K + 8), float("nan"), dtype=x.dtype, device=x.device)
        wide[:, : key.K] = x
        return [("x [1, M, K] non-contiguous", (wide[:, : key.K].unsqueeze(0), w, b), (1, key.M, key.N))]

    def bytes(self, key: GemmKey) -> int:
        return (key.M * key.K + key.N * key.K) * key.dtype.itemsize + key.M * key.N * key.outdtype.itemsize

    def flops(self, key: GemmKey) -> int:
        return 2 * key.M * key.N * key.K


FAMILY = A16W16()
