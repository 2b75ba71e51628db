"""fmoe: fused mixture-of-experts (gate+up GEMM, activation, down GEMM, routing-weight combine);
aiter's tuned_fmoe.csv, whose two stages are timed apart (us1/kernelName1, us2/kernelName2).

The key is aiter's: token, model_dim, inter_dim, expert, topk, act_type, dtype, q_dtype_a, q_dtype_w,
q_type, use_g1u1, doweight_stage1; the token count is what the untuned rule walks. Two gemmtune columns
follow aiter's, and their defaults make aiter's rows read as what aiter tuned:
- expert is the number of experts in the weight tensors one rank holds (local routed + shared), as
  aiter keys it; global_expert is the router's expert count when expert parallelism splits them
  (0: no EP, the ids range over the local routed experts). Keying on the local count alone would
  make an EP=8 rank of a 256-expert model share rows with a 32-expert model (different routing).
- shared_expert: how many shared experts are fused in as the last experts of the weights (every
  token takes them with weight 1, after its topk routed ones); topk counts routed experts only.

Stages: stage 1 is gate+up and the gated activation into one intermediate row per slot (slot s =
t * TK + j for token t and routing column j, TK = topk + shared_expert), stage 2 the down GEMM and the
routing-weight combine. The tuner times the stages apart (us1/err1, us2/err2 of the kernels a row
names) and then the best pairs whole: `us` is the whole call as timed (aiter writes us1 + us2).

A row's solution is its two kernel names. aiter's tables have no libtype column: gemmtune's own rows
write their backend as `libtype:` in front of kernelName1 (`triton:moe1_...`); a row without a prefix
is aiter's. The row's kernel name as gemmtune holds it is `kernelName1|kernelName2` (prefix removed).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from ..errors import NotRunnableError
from ..keys import dtype_name, parse_bool
from .base import LOW_BIT, Column, Family, Roles, dtype_col, generator, int_col, inv_sqrt, quant_dtype_col, randn


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
    global_expert: int = 0  # router's expert count under expert parallelism; 0: no EP
    shared_expert: int = 0  # shared experts fused as the last `shared_expert` experts of the weights

    @property
    def local_routed(self) -> int:
        return self.expert - self.shared_expert

    @property
    def slots(self) -> int:
        """(token, expert) rows the two stages compute: each token's top-k routed experts and the shared ones."""
        return self.token * (self.topk + self.shared_expert)

    @property
    def num_routed(self) -> int:
        """The range of the router's ids."""
        return self.global_expert or self.local_routed

    def describe(self) -> str:
        q = "" if self.q_type == "QuantType.No" else f" {self.q_type} {dtype_name(self.q_dtype_w)}"
        ep = f" of {self.global_expert} (EP)" if self.global_expert else ""
        sh = f" +{self.shared_expert} shared" if self.shared_expert else ""
        w = " doweight1" if self.doweight_stage1 else ""
        return (f"tokens={self.token} dim={self.model_dim} inter={self.inter_dim} E={self.expert}{ep}{sh} "
                f"topk={self.topk} {self.act_type.split('.')[-1]}{q}{w}")  # fmt: skip


# activation names of the op <-> aiter's ActivationType spelling (GeluTanh is gemmtune's own)
ACT_TYPES = {"silu": "ActivationType.Silu", "gelu": "ActivationType.Gelu", "gelu_tanh": "ActivationType.GeluTanh"}
_ACT_NAMES = {v: k for k, v in ACT_TYPES.items()}


def act_type_of(activation: str) -> str:
    return ACT_TYPES[activation]


def act_name(act_type: str) -> str:
    """The op's activation name for a key's act_type ("" when no kernel here computes it)."""
    return _ACT_NAMES.get(act_type, "")


def join_name(stage1: str, stage2: str) -> str:
    return f"{stage1}|{stage2}"


def split_name(kernel_name: str) -> tuple[str, str]:
    n1, _, n2 = kernel_name.partition("|")
    return n1, n2 or n1


_PREFIX = re.compile(r"^([a-z][a-z0-9_]*):(.*)$")


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError("must be an integer >= 0")
    return v


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
        quant_dtype_col("q_dtype_a"), quant_dtype_col("q_dtype_w"),
        Column("q_type", "q_type", _text, str, "QuantType.No"),
        Column("use_g1u1", "use_g1u1", _flag, _int01, True),
        Column("doweight_stage1", "doweight_stage1", _flag, _int01, False),
        Column("global_expert", "global_expert", _nonneg_int, str, 0),
        Column("shared_expert", "shared_expert", _nonneg_int, str, 0),
    )  # fmt: skip
    roles = Roles(libtype=None, solidx="block_m", splitk="ksplit", kernel_name="kernelName1", err_ratio="err1")
    tuned_columns = (
        "cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
        "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1", "block_m", "ksplit", "us1", "kernelName1", "err1",
        "us2", "kernelName2", "err2", "us", "run_1stage", "tflops", "bw", "_tag", "gfx", "global_expert",
        "shared_expert",
    )  # fmt: skip
    untuned_columns = tuple(c.name for c in key_columns)
    signature = frozenset({"token", "model_dim", "inter_dim", "expert", "topk"})
    # aiter's fused-hybrid and grouped MoE tables (families/aiter_moe.py) add these columns.
    excludes = frozenset({"shared_expert_id", "hidden_pad", "gate_mode", "max_m", "tile_m"})
    name_hints = ("fmoe", "moe")

    stages = (1, 2)
    stage_columns = {1: ("us1", "kernelName1", "err1"), 2: ("us2", "kernelName2", "err2")}

    def describe(self, key: MoeKey) -> str:
        return f"fmoe {key.describe()}"

    # ---- solution naming (hooks the generic row parsing calls) ------------------------------------
    def libtype_of(self, raw: dict[str, str]) -> str:
        """`triton:` in front of kernelName1 names gemmtune's backend; aiter's rows have no prefix."""
        m = _PREFIX.match(raw.get("kernelName1", "").strip())
        return m.group(1) if m else self.implied_libtype

    def kernel_name_of(self, raw: dict[str, str]) -> str:
        n1 = raw.get("kernelName1", "").strip()
        m = _PREFIX.match(n1)
        return join_name(m.group(2) if m else n1, raw.get("kernelName2", "").strip())

    def solution_record(self, libtype: str, kernel_name: str) -> dict[str, str]:
        n1, n2 = split_name(kernel_name)
        prefix = "" if libtype == self.implied_libtype else f"{libtype}:"
        return {"kernelName1": f"{prefix}{n1}", "kernelName2": n2}

    def why_not_here(self, key: MoeKey) -> str | None:
        """aiter's fp4 / int4 / MX MoE rows and activations no kernel here computes fall back."""
        low = [d for d in (key.dtype, key.q_dtype_a, key.q_dtype_w) if d in LOW_BIT.values()]
        if low:
            return f"{dtype_name(low[0])} MoE needs kernels gemmtune has not (aiter's fp4 / int4 MoE)"
        if not act_name(key.act_type):
            return f"{key.act_type} has no kernel here (gemmtune computes {', '.join(ACT_TYPES.values())})"
        return None

    # ---- computing ----------------------------------------------------------------------------
    def make_inputs(self, key: MoeKey, device, sets, seed):
        """(hidden, w1, w2, topk_weights, topk_ids, expert_map) with real top-k routing: softmax of
        random router logits, top-k, renormalized (Mixtral's router). Under EP this rank holds the
        first local experts of the global range."""
        why = self.why_not_here(key)
        if why:
            raise NotRunnableError(f"{self.describe(key)}: {why}")
        gen = generator(device, seed)
        gated = 2 if key.use_g1u1 else 1
        out = []
        for _ in range(sets):
            hidden = randn((key.token, key.model_dim), device, gen, key.dtype)
            w1 = randn((key.expert, gated * key.inter_dim, key.model_dim), device, gen, key.dtype,
                       inv_sqrt(key.model_dim))  # fmt: skip
            w2 = randn((key.expert, key.model_dim, key.inter_dim), device, gen, key.dtype, inv_sqrt(key.inter_dim))
            topk_weights, topk_ids = route(randn((key.token, key.num_routed), device, gen, torch.float32), key.topk)
            out.append((hidden, w1, w2, topk_weights, topk_ids, expert_map_of(key, device)))
        return out

    def set_bytes(self, key: MoeKey) -> int:
        e = key.dtype.itemsize
        return key.expert * expert_bytes(key) + 2 * key.token * key.model_dim * e

    def reference(self, key: MoeKey, inputs):
        from ..kernels.fused_moe import fused_moe_ref

        hidden, w1, w2, topk_weights, topk_ids, expert_map = inputs
        return fused_moe_ref(hidden, w1, w2, topk_weights, topk_ids, act_name(key.act_type), expert_map,
                             key.shared_expert)  # fmt: skip

    def output_shape(self, key: MoeKey):
        return (key.token, key.model_dim)

    def out_dtype(self, key: MoeKey) -> torch.dtype:
        return key.dtype

    def check_variants(self, key: MoeKey, inputs):
        # What the op passes on: a hidden state sliced out of a wider buffer, int32 ids with
        # bf16/fp16 weights (routers differ), and weights stored (E, H, 2I) instead of (E, 2I, H).
        hidden, w1, w2, topk_weights, topk_ids, expert_map = inputs
        wide = torch.full((key.token, key.model_dim + 8), float("nan"), dtype=hidden.dtype, device=hidden.device)
        wide[:, 4 : 4 + key.model_dim] = hidden
        shape = self.output_shape(key)
        ids32, w16 = topk_ids.to(torch.int32), topk_weights.to(key.dtype)
        w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
        return [
            ("hidden strided", (wide[:, 4 : 4 + key.model_dim], w1, w2, topk_weights, topk_ids, expert_map), shape),
            ("int32 ids, 16-bit weights", (hidden, w1, w2, w16, ids32, expert_map), shape),
            ("weights stored (E, K, N)", (hidden, w1t, w2t, topk_weights, topk_ids, expert_map), shape),
        ]

    # ---- stages (tuner/stages.py) ---------------------------------------------------------------
    def stage_names(self, kernel_name: str) -> tuple[str, str]:
        return split_name(kernel_name)

    def stage_inputs(self, key: MoeKey, stage: int, sets):
        """Stage 1 takes the family's sets; stage 2 takes (h, *set), h the stage-1 reference rounded to
        the key's dtype, in slot order (rows of slots with no local expert are zero, never read)."""
        if stage == 1:
            return list(sets)
        return [(self.stage_reference(key, 1, inp).to(key.dtype), *inp) for inp in sets]

    def stage_reference(self, key: MoeKey, stage: int, inputs):
        from ..kernels.fused_moe import stage1_ref, stage2_ref

        if stage == 1:
            hidden, w1, _, topk_weights, topk_ids, expert_map = inputs
            h = stage1_ref(hidden, w1, topk_weights, topk_ids, act_name(key.act_type), expert_map, key.shared_expert,
                           key.inter_dim, key.doweight_stage1)  # fmt: skip
            return torch.where(_live_slots(key, topk_ids, expert_map), h, 0.0)
        h, _, _, w2, topk_weights, topk_ids, expert_map = inputs
        return stage2_ref(h, w2, topk_weights, topk_ids, expert_map, key.shared_expert, key.doweight_stage1)

    def stage_output_shape(self, key: MoeKey, stage: int) -> tuple[int, int]:
        if stage == 1:
            return (key.slots, key.inter_dim)
        return self.output_shape(key)

    def stage_result(self, key: MoeKey, stage: int, out, inputs):
        """Stage 1's StageOut in slot order, rows of slots with no local expert zeroed (no kernel writes
        them); stage 2's output as is."""
        if stage == 1:
            _, _, _, _, topk_ids, expert_map = inputs
            return torch.where(_live_slots(key, topk_ids, expert_map), out.slot_order(), 0.0)
        return out

    def bytes(self, key: MoeKey) -> int:
        """Weights of the experts expected to be hit under uniform routing, plus activations in and out."""
        e = key.dtype.itemsize
        return round(expected_experts_hit(key) * expert_bytes(key)) + 2 * key.token * key.model_dim * e

    def flops(self, key: MoeKey) -> int:
        slots = key.token * (key.topk * key.local_routed / key.num_routed + key.shared_expert)
        gated = 2 if key.use_g1u1 else 1
        return round(2 * slots * key.model_dim * key.inter_dim * (gated + 1))


class StageOut(NamedTuple):
    """Stage 1's intermediate rows: slot s's row is h[s] (rows None) or h[rows[s]] (sorted by expert)."""

    h: torch.Tensor
    rows: torch.Tensor | None = None

    def slot_order(self) -> torch.Tensor:
        return self.h if self.rows is None else self.h[self.rows]


def _live_slots(key: MoeKey, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """(T * TK, 1) bool: the slot has a local expert."""
    from ..kernels.fused_moe import local_expert_ids

    ids = local_expert_ids(topk_ids, key.num_routed, expert_map, key.shared_expert, key.local_routed)
    return (ids >= 0).reshape(-1, 1)


def route(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits (T, G): fp32 weights renormalized over the top k, int64 ids."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, topk, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def expert_map_of(key: MoeKey, device, rank: int = 0) -> torch.Tensor | None:
    """(global_expert,) int32: local id of each router id on EP rank `rank`, -1 for other ranks' experts."""
    if not key.global_expert:
        return None
    m = torch.full((key.global_expert,), -1, dtype=torch.int32, device=device)
    lo = rank * key.local_routed
    m[lo : lo + key.local_routed] = torch.arange(key.local_routed, dtype=torch.int32, device=device)
    return m


def expert_bytes(key: MoeKey) -> int:
    gated = 2 if key.use_g1u1 else 1
    return (gated + 1) * key.inter_dim * key.model_dim * key.q_dtype_w.itemsize


def expected_experts_hit(key: MoeKey) -> float:
    """Local experts expected to receive at least one token when each token picks topk of num_routed
    uniformly (random router logits), plus the shared ones."""
    miss = (1.0 - key.topk / key.num_routed) ** key.token
    return key.local_routed * (1.0 - miss) + (key.shared_expert if key.token else 0)


def bytes_hit(key: MoeKey, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> int:
    """Bytes of the experts these ids actually hit (host sync: for benchmarks), plus activations."""
    ids = topk_ids.reshape(-1).long()
    local = expert_map.long()[ids] if expert_map is not None else ids
    hit = int(torch.unique(local[local >= 0]).numel()) + key.shared_expert
    return hit * expert_bytes(key) + 2 * key.token * key.model_dim * key.dtype.itemsize


__all__ = ["ACT_TYPES", "FAMILY", "MoeKey", "StageOut", "act_name", "act_type_of", "bytes_hit", "expected_experts_hit",
           "expert_map_of", "join_name", "route", "split_name"]  # fmt: skip


FAMILY = FusedMoe()
