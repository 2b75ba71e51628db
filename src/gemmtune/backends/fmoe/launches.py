"""The Triton launches of the fmoe triton backend, described instead of run: for a key and a Triton stage
config (or the grouped_mm pair's Triton glue), each launch as Triton specializes it, which is what
decides the binary it loads (its compile signature):
  - the kernel, its constexprs and launch options (the config's blocks, split, warps and stages; the
    slot count's power of two and the grid over slots or experts of a direct launch; gating, activation,
    routing weights, expert map; the sort's bins and chunks, the act*mul and combine block sizes);
  - each pointer argument's dtype, and whether 16 bytes divide its address (every tensor the family's
    inputs and the launchers allocate is, so only the strided hidden state's is not);
  - each int argument as Triton specializes it: == 1, or its type (i32/i64) and whether 16 divides it.
Two launches with one description load one binary; the precompile (precompile.py) dedupes and picks
stand-in keys by it. It mirrors the launchers as stages.py calls them on the family's inputs, as made
(form "") or in one of the other call forms the tuner's full check calls a solution with (FORMS: the
family's check_variants), through kernels/fused_moe.py moe_gemm, moe_down_by_token and combine,
kernels/moe_route.py expert_sort, kernels/activations.py act_mul (a device's PDL launch option is the same
for every key and left out; which launches take it where the device runs PDL is told);
tests/test_moe_precompile.py records the real launches to hold it to them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...families.fmoe import MoeKey, act_name
from ...kernels import fused_moe as kmoe
from ...kernels import moe_route
from ...kernels.activations import ACTIVATIONS as ACT_MUL_ACTS
from .stages import PDL_MAX_SLOTS

# The call forms of the full check (families/fmoe.py check_variants, by its labels), as item names spell
# them: the hidden state a view of a wider buffer (4 elements in: its address off 16 bytes in 16-bit),
# the router's ids int32 with routing weights in the key's dtype, the expert weights stored (E, K, N).
FORMS = {"strided": "hidden strided", "ids32": "int32 ids, 16-bit weights", "ekn": "weights stored (E, K, N)"}


class Launch(NamedTuple):
    kernel: str
    pointers: tuple[str, ...]  # each pointer argument's dtype
    ints: tuple[str, ...]  # each int argument's specialization (spec)
    constexprs: tuple  # (name, value) pairs, the launch options last


def spec(v: int) -> str:
    """An int argument as Triton (3.x) specializes it: "1", else its type and "D" when 16 divides it."""
    if v == 1:
        return "1"
    kind = "i32" if -(2**31) <= v < 2**31 else "u64" if 2**63 <= v < 2**64 else "i64"
    return kind + ("D" if v % 16 == 0 else "")


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Call(NamedTuple):
    """What one call on the family's inputs (families/fmoe.py make_inputs), in call form `form` (FORMS),
    passes to the launchers."""

    T: int
    H: int
    I: int  # noqa: E741 - the intermediate size, as the module docs name it
    E: int
    topk: int
    tk: int  # routing columns: topk + shared experts
    S: int  # slots
    routed: int  # the router ids' range
    local: int  # local routed experts
    has_map: bool
    dt: str
    ids: str  # the router ids' dtype (torch.topk's int64)
    map: str  # the expert map's dtype (the ids stand in without one)
    weights: str  # the routing weights' dtype (fp32)
    hidden: str  # the hidden state's pointer (dtype, unaligned when strided)
    stride_t: int  # the hidden state's row stride
    ekn: bool  # the expert weights stored (E, K, N)

    @classmethod
    def of(cls, key: MoeKey, form: str = "") -> _Call:
        if form and form not in FORMS:
            raise ValueError(f"unknown call form {form!r} (known: {', '.join(FORMS)})")
        tk = key.topk + key.shared_expert
        has_map = bool(key.global_expert)
        dt = _dt(key.dtype)
        ids = "int32" if form == "ids32" else "int64"
        hidden, stride_t = dt, key.model_dim
        if form == "strided":  # wide[:, 4 : 4 + H] of a (T, H + 8) buffer
            stride_t = key.model_dim + 8
            hidden = dt if 4 * key.dtype.itemsize % 16 == 0 else f"{dt} unaligned"
        return cls(key.token, key.model_dim, key.inter_dim, key.expert, key.topk, tk, key.token * tk, key.num_routed,
                   key.local_routed, has_map, dt, ids, "int32" if has_map else ids,
                   dt if form == "ids32" else "float32", hidden, stride_t, form == "ekn")  # fmt: skip


def gemm_launch(key: MoeKey, cfg: kmoe.MoeGemmConfig, form: str = "") -> Launch:
    """moe_gemm's launch for stage cfg.stage of `key` (stage 1 into finished rows, stage 2 into partials)."""
    c = _Call.of(key, form)
    S, H, I = c.S, c.H, c.I  # noqa: E741
    sk = cfg.split_k
    a_ptr = c.dt
    if cfg.stage == 1:
        g = 2 if key.use_g1u1 else 1
        n, k, gated, act, weighted = I, H, bool(key.use_g1u1), kmoe.ACTS[act_name(key.act_type)], key.doweight_stage1
        a, a_ptr = (c.stride_t, 0, 1), c.hidden  # hidden (T, H): every routing column reads its token's row
        b = (g * I * H, g * I, 1) if c.ekn else (g * I * H, 1, H)  # w1 (E, gI, H) read as (E, H, gI)
        out, c_str = c.dt, (S * I, I, 1)  # the rows (S, I) as (1, S, I)
        fixup = sk > 1
        part, p_str, lock = ("float32", (S * g * I, g * I), "int32") if fixup else (out, c_str[:2], out)
    else:
        n, k, gated, act, weighted, fixup = H, I, False, 0, False, False
        a = (c.tk * I, I, 1)  # the rows (S, I) in slot order
        b = (H * I, H, 1) if c.ekn else (H * I, 1, I)  # w2 (E, H, I) read as (E, I, H)
        out, c_str = ("float32" if sk > 1 else c.dt), (S * H, H, 1)
        part, p_str, lock = out, c_str[:2], out
    w, w_str = (c.weights, (c.topk, 1)) if weighted else (out, (0, 0))
    strides = tuple(spec(v) for v in (*a, *b, *c_str, *w_str, *p_str))
    common = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k), ("SPLIT_K", sk),
              ("FIXUP", fixup), ("GATED", gated), ("ACT", act), ("MUL_WEIGHT", weighted),
              ("PREC", "ieee" if key.dtype == torch.float32 else "tf32"), ("num_warps", cfg.warps),
              ("num_stages", cfg.stages))  # fmt: skip
    pointers = (a_ptr, c.dt, out, w, part, lock)
    if cfg.direct:
        # n_slots is not specialized (the kernel's do_not_specialize): its type only
        ints = ("i32", *(spec(v) for v in (n, k, c.tk, c.topk, c.routed, c.local, c.topk, 1)))
        grid = (("SLOTS", max(16, _p2(S))), ("HAS_MAP", c.has_map), ("BY_SLOT", S < c.E))
        flat = (("FLAT_IDS", c.tk == c.topk),)  # every call form's ids are contiguous: flat without shared experts
        return Launch("_moe_gemm_direct", (*pointers, c.ids, c.map), ints + strides, grid + common + flat)
    ints = tuple(spec(v) for v in (S, n, k, c.tk, c.topk))
    return Launch("_moe_gemm_sorted", (*pointers, "int32", "int32"), ints + strides, common)


def by_token_launch(key: MoeKey, cfg: kmoe.MoeGemmConfig, form: str = "") -> Launch:
    """moe_down_by_token's launch: stage 2 and the combine in one (a `by_token` stage-2 config)."""
    c = _Call.of(key, form)
    H, I = c.H, c.I  # noqa: E741
    split = kmoe.by_token_splits(cfg.split_k, c.tk)
    weighted = not key.doweight_stage1
    w, w_str = (c.weights, (c.topk, 1)) if weighted else (c.dt, (0, 0))
    b = (H * I, H, 1) if c.ekn else (H * I, 1, I)  # w2 (E, H, I) read as (E, I, H)
    part, lock = ("float32", "int32") if split > 1 else (c.dt, c.dt)
    pointers = (c.dt, c.dt, w, c.dt, part, lock, c.ids, c.map)
    # n_tokens is not specialized (the kernel's do_not_specialize): its type only
    ints = ("i32", *(spec(v) for v in (H, I, c.tk, c.topk, c.routed, c.local, c.topk, 1, c.tk * I, I, 1, *b, *w_str,
                                       H)))  # fmt: skip
    consts = (("TK_P2", max(2, _p2(c.tk))), ("HAS_MAP", c.has_map), ("BLOCK_M", cfg.block_m),
              ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k), ("MUL_WEIGHT", weighted),
              ("PREC", "ieee" if key.dtype == torch.float32 else "tf32"), ("SPLIT", split),
              ("num_warps", cfg.warps), ("num_stages", cfg.stages),
              # whether the launch is a PDL one where the device runs PDL (a direct moe_gemm's SLOTS tells it)
              ("pdl_slots", c.S <= PDL_MAX_SLOTS))  # fmt: skip
    return Launch("_moe_down_by_token", pointers, ints, consts)


def combine_launch(key: MoeKey, splits: int, c_dtype: str, rows: bool, form: str = "") -> Launch:
    """combine's launch: `splits` partials of c_dtype, in slot order or (rows) sorted by expert."""
    c = _Call.of(key, form)
    weighted = not key.doweight_stage1
    w, w_str = (c.weights, (c.topk, 1)) if weighted else (c.dt, (0, 0))
    pointers = (c_dtype, w, c.ids, c.map, "int64" if rows else c.ids, c.dt)
    ints = tuple(spec(v) for v in (c.H, c.tk, c.topk, c.routed, c.local, c.topk, 1, *w_str, c.S * c.H, c.H, c.H))
    consts = (("SPLITS", splits), ("TK_P2", max(2, _p2(c.tk))), ("HAS_MAP", c.has_map), ("MUL_WEIGHT", weighted),
              ("HAS_ROWS", rows), ("BLOCK_N", min(1024, max(64, _p2(c.H)))), ("num_warps", 4))  # fmt: skip
    return Launch("_combine", pointers, ints, consts)


def stage_launches(key: MoeKey, cfg: kmoe.MoeGemmConfig, form: str = "") -> tuple[Launch, ...]:
    """A Triton stage alone, or in a pair (the same launches): stage 1's GEMM; stage 2's GEMM and the
    combine of its partials, or the one by-token launch."""
    if cfg.stage == 1:
        return (gemm_launch(key, cfg, form),)
    if cfg.by_token:
        return (by_token_launch(key, cfg, form),)
    c_dtype = "float32" if cfg.split_k > 1 else _dt(key.dtype)
    return gemm_launch(key, cfg, form), combine_launch(key, cfg.split_k, c_dtype, False, form)


def glue_launches(key: MoeKey, form: str = "") -> tuple[Launch, ...]:
    """The Triton glue around torch._grouped_mm (both stages grouped_mm, triton_glue): the sort by expert,
    act*mul of the gated activations it computes, the combine of the sorted rows."""
    c = _Call.of(key, form)
    out: list[Launch] = []
    if c.S:
        p = moe_route.sort_plan(c.S, c.E)
        ints = tuple(spec(v) for v in (c.S, c.tk, c.topk, c.routed, c.local, c.E, c.topk, 1))
        consts = tuple((n, p[n]) for n in ("BINS", "CHUNK", "HIST", "SUB", "num_warps"))
        out.append(Launch("_expert_sort_kernel", (c.ids, c.map, "int64", "int32"), ints,
                          (("HAS_MAP", c.has_map), *consts)))  # fmt: skip
    act = act_name(key.act_type)
    if key.use_g1u1 and act in ACT_MUL_ACTS and c.S and c.I:
        block = min(1024, _p2(c.I))
        out.append(Launch("_act_mul_kernel", (c.dt, c.dt), (spec(c.I), spec(2 * c.I)),
                          (("ACT", ACT_MUL_ACTS.index(act)), ("BLOCK", block),
                           ("num_warps", 4 if block >= 512 else 1))))  # fmt: skip
    out.append(combine_launch(key, 1, c.dt, True, form))
    return tuple(out)
