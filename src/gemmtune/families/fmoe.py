"""fmoe: fused mixture-of-experts (gate+up GEMM, activation, down GEMM, routing-weight combine);
aiter's tuned_fmoe.csv, whose two stages are timed apart (us1/kernelName1, us2/kernelName2).

The key is aiter's: token, model_dim, inter_dim, expert, topk, act_type, dtype, q_dtype_a, q_dtype_w,
q_type, use_g1u1, doweight_stage1; the token count is what the untuned rule walks. A row's solution
is its two kernel names; gemmtune's own rows name their backend as `libtype:` in front of kernelName1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..keys import dtype_name, parse_bool
from .base import Column, Family, Roles, dtype_col, int_col


class MoeKey(NamedTuple):
    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    act_type: str = "ActivationType.Silu"
    dtype: torch.dtype = torch.bfloat16
    q_dtype_a: torch.dtype = torch.bfloat16
    q_dtype_w: torch.dtype = torch.bfloat16
    q_type: str = "QuantType.No"
    use_g1u1: bool = True
    doweight_stage1: bool = False

    def describe(self) -> str:
        q = "" if self.q_type == "QuantType.No" else f" {self.q_type} {dtype_name(self.q_dtype_w)}"
        return (f"tokens={self.token} dim={self.model_dim} inter={self.inter_dim} E={self.expert} "
                f"topk={self.topk} {self.act_type.split('.')[-1]}{q}")  # fmt: skip


def _flag(text: str) -> bool:
    return parse_bool(text)


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("empty")
    return text.strip()


def _int01(v: bool) -> str:
    return str(int(v))


class FusedMoe(Family):
    name = "fmoe"
    description = "fused MoE: grouped gate+up, activation, down, weighted combine (fused_moe, grouped_gemm)"
    ops = ("fused_moe", "grouped_gemm")
    env_var = "GEMMTUNE_CONFIG_FMOE"
    aiter_tables = ("tuned_fmoe.csv",)
    key_type = MoeKey
    m_field = "token"
    key_columns = (
        int_col("token"), int_col("model_dim"), int_col("inter_dim"), int_col("expert"), int_col("topk"),
        Column("act_type", "act_type", _text, str, "ActivationType.Silu"), dtype_col("dtype"),
        dtype_col("q_dtype_a"), dtype_col("q_dtype_w"), Column("q_type", "q_type", _text, str, "QuantType.No"),
        Column("use_g1u1", "use_g1u1", _flag, _int01, True),
        Column("doweight_stage1", "doweight_stage1", _flag, _int01, False),
    )  # fmt: skip
    roles = Roles(libtype=None, solidx="block_m", splitk="ksplit", kernel_name="kernelName1", err_ratio="err1")
    tuned_columns = (
        "cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
        "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1", "block_m", "ksplit", "us1", "kernelName1", "err1",
        "us2", "kernelName2", "err2", "us", "run_1stage", "tflops", "bw", "_tag", "gfx",
    )  # fmt: skip
    untuned_columns = tuple(c.name for c in key_columns)
    signature = frozenset({"token", "model_dim", "inter_dim", "expert", "topk"})
    name_hints = ("fmoe", "moe")
    unrunnable = "the fused_moe op is not built yet"

    def describe(self, key: MoeKey) -> str:
        return f"fmoe {key.describe()}"


FAMILY = FusedMoe()
