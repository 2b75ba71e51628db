"""aiter's two other MoE tables, loaded so they keep their rows and say why nothing runs from them:
- fhmoe (`tuned_fhmoe.csv`, AITER_CONFIG_FHMOE): MoE with a fused shared expert and padded dims, kernels
  chosen by hand (no timing column: its rows read as overrides);
- grouped_fmoe (`tuned_grouped_fmoe.csv`, AITER_CONFIG_GROUPED_FMOE): gfx1250 grouped-GEMM MoE tiles.
Their keys are the fused-MoE key plus the columns that set them apart; no gemmtune op computes them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import Column, Family, Roles
from .fmoe import FAMILY as FMOE


def _int(text: str) -> int:
    return int(text)


def _text(text: str) -> str:
    return text.strip()


# token .. doweight_stage1, aiter's fused-MoE key; its grouped table writes topk -1 (any topk).
_MOE_COLUMNS = tuple(c._replace(parse=_int) if c.name == "topk" else c for c in FMOE.key_columns[:12])


class FhMoeKey(NamedTuple):
    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    act_type: str
    dtype: torch.dtype
    q_dtype_a: torch.dtype
    q_dtype_w: torch.dtype
    q_type: str
    use_g1u1: bool
    doweight_stage1: bool
    shared_expert_id: int = -1
    hidden_pad: int = 0
    intermediate_pad: int = 0
    gate_mode: str = ""


class GroupedMoeKey(NamedTuple):
    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    act_type: str
    dtype: torch.dtype
    q_dtype_a: torch.dtype
    q_dtype_w: torch.dtype
    q_type: str
    use_g1u1: bool
    doweight_stage1: bool
    gate_mode: str = ""


class _AiterMoe(Family):
    m_field = "token"
    implied_libtype = "aiter"
    signature = FMOE.signature

    def kernel_name_of(self, raw: dict[str, str]) -> str:
        return f"{raw.get('kernelName1', '').strip()}|{raw.get('kernelName2', '').strip()}"


class FusedHybridMoe(_AiterMoe):
    name = "fhmoe"
    description = "aiter's fused MoE with a fused shared expert and padded dims (tuned_fhmoe.csv)"
    env_var = "GEMMTUNE_CONFIG_FHMOE"
    aiter_tables = ("tuned_fhmoe.csv",)
    key_type = FhMoeKey
    key_columns = (*_MOE_COLUMNS, Column("shared_expert_id", "shared_expert_id", _int, str, -1),
                   Column("hidden_pad", "hidden_pad", _int, str, 0),
                   Column("intermediate_pad", "intermediate_pad", _int, str, 0),
                   Column("gate_mode", "gate_mode", _text, str, ""))  # fmt: skip
    roles = Roles(libtype=None, solidx="block_m", splitk="ksplit", kernel_name="kernelName1", err_ratio="err1")
    us_required = False
    tuned_columns = ("gfx", "cu_num", *(c.name for c in key_columns[:5]), "shared_expert_id",
                     *(c.name for c in key_columns[5:12]), "hidden_pad", "intermediate_pad", "gate_mode", "block_m",
                     "ksplit", "kernelName1", "kernelName2")  # fmt: skip
    untuned_columns = ("gfx", "cu_num", *(c.name for c in _MOE_COLUMNS))
    excludes = frozenset({"max_m", "tile_m"})
    name_hints = ("fhmoe",)
    unrunnable = "gemmtune has no fused-hybrid MoE op (aiter's fhmoe kernels)"


class GroupedMoe(_AiterMoe):
    name = "grouped_fmoe"
    description = "aiter's grouped-GEMM MoE tiles for gfx1250 (tuned_grouped_fmoe.csv)"
    env_var = "GEMMTUNE_CONFIG_GROUPED_FMOE"
    aiter_tables = ("tuned_grouped_fmoe.csv",)
    key_type = GroupedMoeKey
    key_columns = (*_MOE_COLUMNS, Column("gate_mode", "gate_mode", _text, str, ""))
    roles = Roles(libtype=None, solidx="tile_m", splitk="split_k1", kernel_name="kernelName1", err_ratio="err1")
    tuned_columns = ("gfx", "cu_num", *(c.name for c in _MOE_COLUMNS), "max_m", "tile_m", "tile_n", "tile_k",
                     "kernelName1", "kernelName2", "us", "tflops", "bw")  # fmt: skip
    untuned_columns = ("cu_num", *(c.name for c in _MOE_COLUMNS), "gate_mode")
    excludes = frozenset({"shared_expert_id", "hidden_pad"})
    name_hints = ("grouped_fmoe", "grouped_moe")
    unrunnable = "gemmtune has no grouped-GEMM MoE op of aiter's gfx1250 tiles"


FAMILIES = (FusedHybridMoe(), GroupedMoe())
