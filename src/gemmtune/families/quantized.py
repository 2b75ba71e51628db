"""The quantized GEMM families' tables: a8w8 (int8 / fp8, per-tensor or per-token x per-channel
scales), a8w8 with pre-shuffled weights, fp8 block-scale (1x128 activation groups x 128x128 weight
blocks, with and without pre-shuffle), batched a8w8 and MXFP4 a4w4 block-scale.

Each loads aiter's table of its name unchanged. Their keys: aiter's columns, then gemmtune's own
(scale kind, bias, out dtype, libtype) with aiter's implied values as defaults, so aiter rows read
as what aiter tuned them for. A family whose op this build cannot run keeps its rows and says so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..keys import dtype_name
from .base import Column, Family, Roles, bool_col, dtype_col, int_col

FP8 = getattr(torch, "float8_e4m3fn", None)


def _scale_kind(text: str) -> str:
    t = text.strip().lower().replace("-", "_")
    if t not in ("per_tensor", "per_token"):
        raise ValueError("expected per_tensor or per_token")
    return t


class QuantKey(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = torch.int8
    scale: str = "per_token"  # per_tensor | per_token (x [M,1] scales x w [1,N] scales)
    bias: bool = False
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        b = "+bias" if self.bias else ""
        return (f"M={self.M} N={self.N} K={self.K}{b} {dtype_name(self.q_dtype_w)} {self.scale} "
                f"->{dtype_name(self.outdtype)}")  # fmt: skip


class BlockKey(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = FP8 or torch.int8
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        q = dtype_name(self.q_dtype_w)
        return f"M={self.M} N={self.N} K={self.K} {q} 1x128/128x128 ->{dtype_name(self.outdtype)}"


class BatchedQuantKey(NamedTuple):
    B: int
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = torch.int8
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return f"B={self.B} M={self.M} N={self.N} K={self.K} {dtype_name(self.q_dtype_w)} ->{dtype_name(self.outdtype)}"


class FP4Key(NamedTuple):
    M: int
    N: int
    K: int
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return f"M={self.M} N={self.N} K={self.K} mxfp4 ->{dtype_name(self.outdtype)}"


_QROLES = Roles(libtype="libtype", solidx="kernelId", err_ratio="err_ratio")
_MNK = (int_col("M"), int_col("N"), int_col("K"))
_OUT = dtype_col("outdtype", default=torch.bfloat16)
_TAIL = ("kernelId", "splitK", "us", "kernelName", "tflops", "bw", "errRatio")


class _QuantFamily(Family):
    roles = _QROLES
    implied_libtype = "ck"

    def describe(self, key) -> str:
        return f"{self.name} {key.describe()}"


class A8W8(_QuantFamily):
    name = "a8w8"
    description = "int8/fp8 GEMM with per-tensor or per-token x per-channel scales (gemm_a8w8, int8_gemm)"
    ops = ("gemm_a8w8", "int8_gemm")
    env_var = "GEMMTUNE_CONFIG_A8W8"
    aiter_tables = ("a8w8_tuned_gemm.csv",)
    key_type = QuantKey
    key_columns = (*_MNK, dtype_col("q_dtype_w", default=torch.int8), Column("scale", "scale", _scale_kind,
                   str, "per_token"), bool_col("bias"), _OUT)  # fmt: skip
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "q_dtype_w", *_TAIL, "libtype", "scale", "bias", "outdtype")
    untuned_columns = ("M", "N", "K", "q_dtype_w", "scale", "bias", "outdtype")
    signature = frozenset({"M", "N", "K", "q_dtype_w"})
    excludes = frozenset({"B", "token"})
    name_hints = ("a8w8_tuned", "a8w8_untuned", "a8w8", "int8")
    kernel_hints = ("a8w8_rowwise",)
    unrunnable = "the a8w8 op is not built yet"


class A8W8BPreshuffle(A8W8):
    name = "a8w8_bpreshuffle"
    description = "a8w8 with the weight pre-shuffled for the kernel (gemm_a8w8_bpreshuffle)"
    ops = ("gemm_a8w8_bpreshuffle",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BPRESHUFFLE"
    aiter_tables = ("a8w8_bpreshuffle_tuned_gemm.csv",)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "q_dtype_w", "libtype", *_TAIL, "scale", "bias", "outdtype")
    name_hints = ("a8w8_bpreshuffle", "bpreshuffle")
    kernel_hints = ("BpreShuffle",)
    unrunnable = "the a8w8_bpreshuffle op is not built yet"


class Blockscale(_QuantFamily):
    name = "a8w8_blockscale"
    description = "fp8 GEMM with 1x128 activation and 128x128 weight block scales (gemm_a8w8_blockscale)"
    ops = ("gemm_a8w8_blockscale",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BLOCKSCALE"
    aiter_tables = ("a8w8_blockscale_tuned_gemm.csv",)
    key_type = BlockKey
    key_columns = (*_MNK, dtype_col("q_dtype_w", default=FP8 or torch.int8), _OUT)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "libtype", *_TAIL, "q_dtype_w", "outdtype")
    untuned_columns = ("M", "N", "K", "q_dtype_w", "outdtype")
    signature = frozenset({"M", "N", "K"})
    excludes = frozenset({"B", "token", "bias", "solidx", "scale"})
    name_hints = ("a8w8_blockscale_tuned", "a8w8_blockscale_untuned", "blockscale")
    kernel_hints = ("a8w8_blockscale", "fp8gemm_bf16_blockscale")
    unrunnable = "the a8w8_blockscale op is not built yet"


class BlockscaleBPreshuffle(Blockscale):
    name = "a8w8_blockscale_bpreshuffle"
    description = "fp8 block-scale GEMM with the weight pre-shuffled (gemm_a8w8_blockscale_bpreshuffle)"
    ops = ("gemm_a8w8_blockscale_bpreshuffle",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BLOCKSCALE_BPRESHUFFLE"
    aiter_tables = ("a8w8_blockscale_bpreshuffle_tuned_gemm.csv",)
    name_hints = ("a8w8_blockscale_bpreshuffle", "blockscale_bpreshuffle")
    kernel_hints = ("blockscale_BpreShuffle", "blockscale_bpreshuffle")
    unrunnable = "the a8w8_blockscale_bpreshuffle op is not built yet"


class BatchedA8W8(_QuantFamily):
    name = "batched_a8w8"
    description = "batched int8 GEMM with per-token x per-channel scales (batched_gemm_a8w8)"
    ops = ("batched_gemm_a8w8",)
    env_var = "GEMMTUNE_CONFIG_BATCHED_A8W8"
    aiter_tables = ("a8w8_tuned_batched_gemm.csv",)
    key_type = BatchedQuantKey
    key_columns = (int_col("B"), *_MNK, dtype_col("q_dtype_w", default=torch.int8), _OUT)
    tuned_columns = ("gfx", "cu_num", "B", "M", "N", "K", *_TAIL, "libtype", "q_dtype_w", "outdtype")
    untuned_columns = ("B", "M", "N", "K", "q_dtype_w", "outdtype")
    signature = frozenset({"B", "M", "N", "K"})
    excludes = frozenset({"token", "transA", "transB"})
    name_hints = ("a8w8_tuned_batched", "a8w8_untuned_batched", "a8w8_batched", "batched_a8w8")
    kernel_hints = ("a8w8_batched",)
    unrunnable = "no batched a8w8 op in gemmtune yet"


class A4W4(_QuantFamily):
    name = "a4w4_blockscale"
    description = "MXFP4 GEMM with 1x32 block scales (gemm_a4w4)"
    ops = ("gemm_a4w4",)
    env_var = "GEMMTUNE_CONFIG_A4W4"
    aiter_tables = ("a4w4_blockscale_tuned_gemm.csv",)
    key_type = FP4Key
    key_columns = (*_MNK, _OUT)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", *_TAIL, "libtype", "outdtype")
    untuned_columns = ("M", "N", "K")
    signature = frozenset({"M", "N", "K", "kernelId"})
    excludes = frozenset({"B", "token", "q_dtype_w", "libtype", "solidx", "bias"})
    name_hints = ("a4w4_blockscale", "a4w4")
    kernel_hints = ("f4gemm", "fp4")
    unrunnable = "MXFP4 needs fp4 tensor cores (gfx950 / sm100); gemmtune has no fp4 GEMM"


FAMILIES = (A8W8(), A8W8BPreshuffle(), Blockscale(), BlockscaleBPreshuffle(), BatchedA8W8(), A4W4())
