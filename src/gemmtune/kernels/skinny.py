"""Small-M ("skinny", decode-time) GEMM kernels: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 16.
With 8-bit x and w (both fp8 e4m3 or both int8: kernels/skinny_a8w8.py) the same kernel applies the
scales in the epilogue, y = (x @ w^T) * x_scale[m] * w_scale[n] (+ bias); the int8 tensor-core dot
accumulates int32 (exact) and converts to fp32 after the K loop; split-K partials stay unscaled.
With fp8 block scales (kernels/skinny_blockscale.py: x_scale per 1x128 group, w_scale per 128x128
block, any strides) the scales vary along K, so they cannot wait for the epilogue: each BLOCK_K step
(BLOCK_K divides 128, BLOCK_N <= 128, so a step lies in one K group and a tile in one N block) scales
its partial product by x_scale[m, g] * w_scale[n // 128, g] before adding it to the fp32 accumulator;
split-K partials are then already scaled and the reductions only sum them.

At M <= 16 the time is the time to stream w from HBM once, so the kernels are built around that
stream: split-K so that (N / BLOCK_N) * SPLIT_K programs fill every SM, full-width (16-byte)
K-contiguous weight loads with an evict-first hint (w is read once; x stays in cache), fp32
accumulation, and bias + output cast fused into the epilogue.

One kernel (`USE_DOT` picks the inner product; the rest is shared) computes the partial products:
- `dot`: tensor cores with the operands swapped, acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile^T, so the
  weight tile is the MMA's large dimension and the few token rows its small one (BLOCK_M >= 16).
- `gemv`: CUDA cores for M <= 4, an elementwise multiply into a [BLOCK_M, BLOCK_N, BLOCK_K] fp32
  accumulator that is summed over K once, after the loop.

Split-K partial sums are combined in a fixed order (s = 0 .. SPLIT_K - 1), so results are
deterministic and a CUDA-graph replay matches eager bit for bit. Reductions (`REDUCE`):
- NONE: SPLIT_K == 1, the program stores y directly.
- FIXUP: every program writes its fp32 partial tile, then bumps a per-tile arrival counter; the
  last program to arrive sums the partials, adds the bias, casts, stores y and re-arms the counter
  to 0. Nobody waits on anybody (no spin lock, so no deadlock whatever the scheduling), one launch,
  and the counter is back at 0 after every launch, so graph replays see the same state.
- KERNEL: programs write partials and a second small kernel sums + bias + cast (two launches).
- ATOMIC: fp32 atomic_add into a zeroed fp32 buffer (needs a memset, and for a non-fp32 output a
  cast; not deterministic). Kept for measurement only; the backend does not offer it.

Programmatic dependent launch (`pdl` > 0, CUDA sm90+): the kernel is launched with launch_pdl, lets
the next kernel launch at once, touches its first pdl - 1 weight tiles (into L2) while the previous
kernel finishes, and waits for that kernel (gdc_wait) before it reads x or writes anything. The
weight does not depend on the previous kernel, so its first bytes arrive during the previous
kernel's tail instead of after this kernel's launch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import HAS_PDL, gdc_launch_dependents, gdc_wait  # noqa: F401 - gdc_* used in kernels
from .gemm_ref import gemm_ref
from .launch import Plans, cached_launch, tensor_signature

REDUCE_NONE, REDUCE_FIXUP, REDUCE_KERNEL, REDUCE_ATOMIC = 0, 1, 2, 3
_REDUCE_SUFFIX = {REDUCE_FIXUP: "fx", REDUCE_KERNEL: "rk", REDUCE_ATOMIC: "at"}
_SUFFIX_REDUCE = {v: k for k, v in _REDUCE_SUFFIX.items()}
KINDS = ("dot", "gemv")
_PLANS = Plans()  # the kernels' launches, per signature
GEMV_MAX_ROWS = 4  # the gemv accumulator holds BLOCK_M * BLOCK_N * BLOCK_K fp32 values in registers
DOT_MAX_BLOCK_M = 64
_SUPPORTED_IN = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _overlap_prologue(w_ptr, rows, stride_wn, k0, K, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Programmatic dependent launch (PDL > 0): let the next kernel start launching, pull this
    program's first PDL - 1 weight tiles into L2 while the previous kernel (which may be writing x)
    finishes, then wait for it. The prefetch touches one element per 32-byte sector and discards it:
    w is re-read after the wait, so a w that the previous kernel wrote is still read right (L2 is
    coherent; values held in registers would not be)."""
    if PDL > 0:
        gdc_launch_dependents()
        if PDL > 1:
            STEP: tl.constexpr = 256 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per sector
            offs_s = tl.arange(0, BLOCK_K // STEP) * STEP
            for i in tl.static_range(PDL - 1):
                ks = k0 + i * BLOCK_K + offs_s
                tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :], mask=ks[None, :] < K, volatile=True)
        gdc_wait()


@triton.jit
def _apply_scales(acc, xs_ptr, ws_ptr, m, n, m_ok, n_ok, SCALES: tl.constexpr):
    """8-bit operands (SCALES > 0): acc * x_scale[m] * w_scale[n]. SCALES is a bit set: 1 scaled,
    2 one x scale per row (else one for all), 4 one w scale per column (else one for all)."""
    if SCALES & 2:
        acc = acc * tl.load(xs_ptr + m, mask=m_ok, other=0.0)
    else:
        acc = acc * tl.load(xs_ptr)
    if SCALES & 4:
        acc = acc * tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    else:
        acc = acc * tl.load(ws_ptr)
    return acc


@triton.jit
def _group_scales(xs_ptr, ws_ptr, offs_m, M, n_block, g, stride_xsm, stride_xsk, stride_wsn, stride_wsk):
    """Block scales of K group g for a tile in one 128-row N block: x_scale[m, g] * w_scale[n_block, g]
    per row m ([BLOCK_M] fp32; 0 past M, where x is 0 too)."""
    xs = tl.load(xs_ptr + offs_m * stride_xsm + g * stride_xsk, mask=offs_m < M, other=0.0)
    return xs * tl.load(ws_ptr + n_block * stride_wsn + g * stride_wsk)


@triton.jit
def _epilogue(acc, b_ptr, xs_ptr, ws_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr,
              SCALES: tl.constexpr):  # fmt: skip
    """acc is [BLOCK_N, BLOCK_M] fp32: scale (8-bit operands), add the bias, cast to y's dtype, store
    the valid part."""
    n_ok = offs_n < N
    if SCALES:
        acc = _apply_scales(acc, xs_ptr, ws_ptr, offs_m[None, :], offs_n[:, None], (offs_m < M)[None, :],
                            n_ok[:, None], SCALES)  # fmt: skip
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc + b[:, None]
    mask = n_ok[:, None] & (offs_m[None, :] < M)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_splits(
    acc,
    b_ptr,
    xs_ptr,
    ws_ptr,
    y_ptr,
    p_ptr,
    c_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    REDUCE: tl.constexpr,
    SCALES: tl.constexpr,
):
    """Everything after the K loop: store y, or hand the partial to the chosen split-K reduction.
    Partials are unscaled fp32; 8-bit scales are applied once, to the sum (ATOMIC: to each partial)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if REDUCE == 0:
        _epilogue(acc, b_ptr, xs_ptr, ws_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, SCALES)
    elif REDUCE == 3:
        if SCALES:
            acc = _apply_scales(acc, xs_ptr, ws_ptr, offs_m[None, :], offs_n[:, None], (offs_m < M)[None, :],
                                (offs_n < N)[:, None], SCALES)  # fmt: skip
        if HAS_BIAS:
            if pid_k == 0:
                acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        tl.atomic_add(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc, mask=mask, sem="relaxed")
    else:
        # Partials are [SPLIT_K, M, N] fp32. Write-through so the last arriver (maybe another SM) sees them.
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        p_offs = offs_m[None, :] * N + offs_n[:, None]
        tl.store(p_ptr + pid_k * M * N + p_offs, acc, mask=mask, cache_modifier=".wt")
        if REDUCE == 1:
            split_k = tl.num_programs(1)
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.debug_barrier()  # all of this program's partial stores precede its arrival
            arrived = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for s in range(0, split_k):  # fixed order: deterministic result
                    total += tl.load(p_ptr + s * M * N + p_offs, mask=mask, other=0.0, volatile=True)
                tl.atomic_xchg(c_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-arm for the next launch
                _epilogue(total, b_ptr, xs_ptr, ws_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, SCALES)


# The scale strides follow M (M-major x_scale) or a weight's padding: no recompile per M or layout.
@triton.jit(do_not_specialize=["M", "iters_per_split", "stride_xsm", "stride_xsk", "stride_wsn", "stride_wsk"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    p_ptr,
    c_ptr,
    xs_ptr,
    ws_ptr,
    M,
    N,
    K,
    iters_per_split,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_ym,
    stride_xsm,
    stride_xsk,
    stride_wsn,
    stride_wsk,
    HAS_BIAS: tl.constexpr,
    REDUCE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PDL: tl.constexpr = 0,
    SCALES: tl.constexpr = 0,  # 8-bit operands: see _apply_scales
    ACC_INT: tl.constexpr = False,  # int8 operands: the tensor-core dot accumulates int32 (exact)
    BLOCK_SCALES: tl.constexpr = False,  # fp8 block scales, applied per BLOCK_K step (module doc)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * iters_per_split * BLOCK_K
    k_end = tl.minimum(k0 + iters_per_split * BLOCK_K, K)
    # The ragged last N tile re-reads valid rows instead of masking: loads stay unmasked and wide.
    rows = offs_n % N
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k0 + offs_k)[None, :]
    if USE_DOT:  # x tile [BLOCK_K, BLOCK_M]: the MMA's small operand
        x_k = offs_k[:, None]
        x_ok = offs_m[None, :] < M
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + x_k) * stride_xk
        if ACC_INT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # x tile [BLOCK_M, BLOCK_K]; sum over K only once, after the loop (no cross-thread work in it)
        x_k = offs_k[None, :]
        x_ok = offs_m[:, None] < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + x_k) * stride_xk
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    _overlap_prologue(w_ptr, rows, stride_wn, k0, K, BLOCK_K, PDL)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=x_ok, other=0.0, eviction_policy="evict_last")
        else:
            w = tl.load(w_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=x_ok & ((k + x_k) < K), other=0.0, eviction_policy="evict_last")
        if BLOCK_SCALES:
            s = _group_scales(xs_ptr, ws_ptr, offs_m, M, pid_n * BLOCK_N // 128, k // 128, stride_xsm, stride_xsk,
                              stride_wsn, stride_wsk)  # fmt: skip
            if USE_DOT:
                acc += tl.dot(w, x, input_precision=DOT_PREC, out_dtype=tl.float32) * s[None, :]
            else:  # the scale folds into the x row: no extra multiply per weight element
                acc += (x.to(tl.float32) * s[:, None])[:, None, :] * w.to(tl.float32)[None, :, :]
        elif USE_DOT:
            # Triton 3.6 asserts acc.dtype == out_dtype (fp32 unless given): int8 must say int32.
            acc = tl.dot(w, x, acc, input_precision=DOT_PREC, out_dtype=acc.dtype)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    if not USE_DOT:
        acc = tl.trans(tl.sum(acc, axis=2))  # [BLOCK_N, BLOCK_M], the layout the epilogue takes
    elif ACC_INT:
        acc = acc.to(tl.float32)
    _reduce_splits(acc, b_ptr, xs_ptr, ws_ptr, y_ptr, p_ptr, c_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, REDUCE,
                   SCALES)  # fmt: skip


@triton.jit
def _splitk_reduce_kernel(p_ptr, b_ptr, xs_ptr, ws_ptr, y_ptr, M, N, split_k, stride_ym, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, SCALES: tl.constexpr = 0):  # fmt: skip
    """y = sum_s partials[s] (* scales) (+ bias), cast; partials are [split_k, M, N] fp32, summed in order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    ok = offs < mn
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(p_ptr + s * mn + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if SCALES:
        acc = _apply_scales(acc, xs_ptr, ws_ptr, m, n, ok, ok, SCALES)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


_REDUCE_BLOCK = 1024

_NAME_RE = re.compile(r"^skinny_(dot|gemv)_bn(\d+)_bk(\d+)_sk(\d+)_w(\d+)_s(\d+)(?:_(fx|rk|at))?(?:_pdl(\d))?$")
MAX_PDL = 8


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class SkinnyConfig:
    """One kernel configuration; its `name` is the stable solution id (skinny_dot_bn64_bk256_sk2_w4_s3_fx)."""

    kind: str = "dot"
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    reduce: int = REDUCE_NONE
    pdl: int = 0  # 0: plain launch; n > 0: programmatic dependent launch, n - 1 weight tiles prefetched

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"skinny kernel kind {self.kind!r} not in {KINDS}")
        if not (_pow2(self.block_n) and _pow2(self.block_k) and _pow2(self.num_warps)):
            raise ValueError(f"skinny block_n/block_k/num_warps must be powers of two: {self}")
        if self.uses_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"skinny dot tiles need block_n, block_k >= 16: {self}")
        if not 1 <= self.split_k <= 64 or not 1 <= self.num_stages <= 8 or self.num_warps > 16:
            raise ValueError(f"skinny split_k/num_stages/num_warps out of range: {self}")
        if (self.split_k == 1) != (self.reduce == REDUCE_NONE):
            raise ValueError(f"skinny split_k={self.split_k} needs a reduction iff split_k > 1: {self}")
        if not 0 <= self.pdl <= MAX_PDL:
            raise ValueError(f"skinny pdl must be 0..{MAX_PDL}: {self}")

    @property
    def uses_dot(self) -> bool:
        return self.kind == "dot"

    @property
    def name(self) -> str:
        base = f"skinny_{self.kind}_bn{self.block_n}_bk{self.block_k}_sk{self.split_k}"
        base += f"_w{self.num_warps}_s{self.num_stages}"
        base += f"_{_REDUCE_SUFFIX[self.reduce]}" if self.reduce else ""
        return base + (f"_pdl{self.pdl}" if self.pdl else "")

    @classmethod
    def parse(cls, name: str) -> SkinnyConfig | None:
        """The config a name spells; None for a name that is not a valid skinny config."""
        m = _NAME_RE.match(name.strip())
        if not m:
            return None
        kind, bn, bk, sk, w, s, red, pdl = m.groups()
        try:
            return cls(
                kind, int(bn), int(bk), int(sk), int(w), int(s), _SUFFIX_REDUCE[red] if red else 0, int(pdl or 0)
            )
        except ValueError:
            return None

    def block_m(self, m: int) -> int:
        """Rows per program for an M-row call (the kernel tiles larger M over a third grid axis)."""
        if not self.uses_dot:
            return min(GEMV_MAX_ROWS, triton.next_power_of_2(max(m, 1)))
        return min(DOT_MAX_BLOCK_M, max(16, triton.next_power_of_2(max(m, 1))))

    def effective_split(self, k: int) -> tuple[int, int]:
        """(splits that get work, BLOCK_K iterations per split) for a K-long reduction."""
        iters = triton.cdiv(k, self.block_k)
        per = triton.cdiv(iters, self.split_k)
        return triton.cdiv(iters, per) if iters else 1, max(per, 1)


def check_operands(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming the shapes/dtypes when (x, w, bias) is not a skinny GEMM the kernels run."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"skinny gemm: x {tuple(x.shape)} and w {tuple(w.shape)} need x[..., K], w[N, K]")
    if x.dtype != w.dtype or x.dtype not in _SUPPORTED_IN:
        raise ValueError(f"skinny gemm: x {x.dtype} and w {w.dtype} must be one of fp16/bf16/fp32 and equal")
    if bias is not None and (bias.shape != (w.shape[0],)):
        raise ValueError(f"skinny gemm: bias {tuple(bias.shape)} must be [N={w.shape[0]}]")
    if w.shape[0] * w.shape[1] >= 2**31:
        raise ValueError(f"skinny gemm: w {tuple(w.shape)} too large for 32-bit offsets")


def new_counters(cfg: SkinnyConfig, n: int, max_rows: int, device) -> torch.Tensor | None:
    """Zeroed per-tile arrival counters for the FIXUP reduction (they return to 0 after every launch)."""
    if cfg.reduce != REDUCE_FIXUP:
        return None
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(max(max_rows, 1), cfg.block_m(max_rows))
    return torch.zeros(tiles, dtype=torch.int32, device=device)


class LaunchPlan(NamedTuple):
    """Everything a launch needs that depends only on (config, M, N, K, dtype): computed once per M."""

    grid: tuple[int, int, int]
    split: int
    iters_per_split: int
    reduce: int
    constexprs: dict


SCALE_BLOCKS = 8  # the scale code of fp8 block scales (in the K loop; the epilogue's SCALES stay 0)


def scale_code(scales: tuple[torch.Tensor, torch.Tensor] | None) -> int:
    """The kernel's SCALES bits for 8-bit operands' (x_scale, w_scale): 0 without scales, else 1, plus
    2 for one x scale per row, plus 4 for one w scale per column (a 1-element scale is broadcast)."""
    if scales is None:
        return 0
    xs, ws = scales
    return 1 + 2 * (xs.numel() > 1) + 4 * (ws.numel() > 1)


def make_plan(cfg: SkinnyConfig, m: int, n: int, k: int, dtype: torch.dtype, scales: int = 0) -> LaunchPlan:
    split, per = cfg.effective_split(k)
    reduce = cfg.reduce if split > 1 else REDUCE_NONE
    block_m = cfg.block_m(m)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    consts = dict(
        REDUCE=reduce,
        EVEN_K=k % cfg.block_k == 0,
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.uses_dot,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if scales == SCALE_BLOCKS:
        if cfg.block_n > 128 or 128 % cfg.block_k or k % 128:
            raise ValueError(f"skinny {cfg.name}: block scales need block_n <= 128, block_k | 128, K={k} % 128 == 0")
        consts.update(BLOCK_SCALES=True)
    elif scales:  # 8-bit operands (only then: the float kernels keep their exact launch)
        consts.update(SCALES=scales, ACC_INT=dtype == torch.int8)
    if cfg.pdl:
        if not HAS_PDL:
            raise ValueError(f"skinny {cfg.name}: this Triton has no programmatic dependent launch")
        consts.update(PDL=cfg.pdl, launch_pdl=True)
    return LaunchPlan(grid, split, per, reduce, consts)


def launch(
    cfg: SkinnyConfig,
    x2: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    counters: torch.Tensor | None = None,
    plan: LaunchPlan | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_scales: bool = False,
) -> torch.Tensor:
    """Compute y[M, N] = x2[M, K] @ w[N, K]^T (+ bias) into y (any float dtype) with one config.

    x2 may be strided; w must have unit stride along K (callers make it so). `counters` must come
    from new_counters() with max_rows >= M for the FIXUP reduction. No host sync, no memset (except
    for the measurement-only ATOMIC reduction), so it can be captured in a CUDA graph.
    8-bit x2 and w (both fp8 e4m3 or both int8) take `scales` = (x_scale, w_scale), fp32 and
    contiguous: [M, 1] or 1 element, [1, N] or 1 element; y = (x2 @ w^T) * x_scale * w_scale (+ bias).
    With `block_scales`, `scales` are fp8 block scales instead: x_scale [M, K/128], w_scale
    [ceil(N/128), K/128], any strides. A given `plan` must have been made with scale_code(scales)
    (block scales: SCALE_BLOCKS).
    """
    m, k = x2.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return y
    plan = plan or make_plan(cfg, m, n, k, x2.dtype, SCALE_BLOCKS if block_scales else scale_code(scales))
    scale_strides = (*scales[0].stride(), *scales[1].stride()) if plan.constexprs.get("BLOCK_SCALES") else (0,) * 4
    reduce = plan.reduce
    has_bias = bias is not None
    out = y
    if reduce == REDUCE_ATOMIC:
        out = y if y.dtype == torch.float32 else torch.empty(y.shape, dtype=torch.float32, device=y.device)
        out.zero_()
    p = torch.empty((plan.split, m, n), dtype=torch.float32, device=y.device) if reduce in (1, 2) else out
    if reduce == REDUCE_FIXUP and (counters is None or counters.numel() < plan.grid[0] * plan.grid[2]):
        raise ValueError(f"skinny gemm {cfg.name}: counters for M={m} N={n} missing or too small")
    signature = (cfg, block_scales, *(tensor_signature(t) for t in (x2, w, bias, y, counters, *(scales or ()))))
    cached_launch(
        _PLANS,
        signature,
        _skinny_kernel,
        plan.grid,
        x2,
        w,
        bias if has_bias else out,
        out,
        p,
        counters if counters is not None else p,
        *(scales or (p, p)),
        m,
        n,
        k,
        plan.iters_per_split,
        x2.stride(0),
        x2.stride(1),
        w.stride(0),
        out.stride(0),
        *scale_strides,
        HAS_BIAS=has_bias,
        **plan.constexprs,
    )
    if reduce == REDUCE_KERNEL:
        cached_launch(
            _PLANS,
            ("reduce", signature),
            _splitk_reduce_kernel,
            (triton.cdiv(m * n, _REDUCE_BLOCK),),
            p,
            bias if has_bias else y,
            *(scales or (p, p)),
            y,
            m,
            n,
            plan.split,
            y.stride(0),
            HAS_BIAS=has_bias,
            BLOCK=_REDUCE_BLOCK,
            SCALES=plan.constexprs.get("SCALES", 0),
            num_warps=4,
        )
    elif out is not y:
        y.copy_(out)
    return y


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: SkinnyConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ w[N, K]^T (+ bias) with one skinny config (the simple, checked entry)."""
    check_operands(x, w, bias)
    cfg = cfg or SkinnyConfig()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    counters = new_counters(cfg, w.shape[0], x2.shape[0], x.device)
    launch(cfg, x2, w, bias, y, counters)
    return y.view(*x.shape[:-1], w.shape[0])


skinny_gemm_ref = gemm_ref  # the plain-PyTorch reference this kernel is checked against
