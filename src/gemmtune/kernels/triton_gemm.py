"""Triton GEMM family: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation.

One kernel body covers every config the `triton` backend offers:
- tiles BLOCK_M/N/K with grouped (GROUP_M) tile order for L2 reuse of the weight;
- split-K, either with a second reduce kernel (mode 'r': partials in fp32, then one pass that adds them,
  the bias and casts) or fixed up in the same launch (mode 'f': each split stores its partial and bumps a
  per-tile counter; the last one to arrive adds all partials in a fixed order, runs the epilogue and
  resets the counter). Both are deterministic;
- a persistent grid (one program per SM walking the tiles); `_pf` flattens its tile and K loops into one
  that Triton pipelines across tiles (the next tile's loads overlap this tile's epilogue);
- TMA tensor descriptors on Hopper (out-of-bounds rows and columns are zero-filled by the copy engine);
- programmatic dependent launch (`_pdl1`: start while the previous kernel finishes, wait before reading
  x; `_pdl2`: also pull the first weight tile into L2 before waiting; see kernels/skinny.py).
The epilogue applies, in fp32 registers before the one store: alpha scaling, beta * C (C may broadcast
through zero strides), the bias and an activation (relu, gelu erf, gelu tanh), then the output dtype;
its constexprs default to off, so the plain GEMM compiles as before. 8-bit operands (int8 with an int32
accumulator, or fp8 e4m3) take their fp32 scales first in that epilogue (kernels/a8w8_tg.py).
`triton_gemm_ref` / `triton_epilogue_ref` are the plain-PyTorch references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ..device import facts
from ._common import HAS_PDL, gdc_launch_dependents, gdc_wait  # noqa: F401 - gdc_* used in the kernel
from .gemm_ref import epilogue_ref, gemm_ref
from .launch import Plans, bind, tensor_signature
from .tile_config import GemmTileConfig

try:  # host-side TMA descriptors (Triton >= 3.4); absent on older releases
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None


triton_gemm_ref = gemm_ref  # the plain-PyTorch reference this kernel is checked against
FLATTEN_SMEM = 32 * 1024


def triton_epilogue_ref(x, w, bias, c, alpha: float, beta: float, act: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The fused-epilogue reference: act(alpha * x @ w^T + beta * c + bias) in fp32, one rounding."""
    return epilogue_ref(x, w, bias, c, alpha, beta, act).to(out_dtype)


@dataclass(frozen=True)
class TGConfig(GemmTileConfig):
    """One explicit kernel config; `name` is the stable id stored in tables."""

    PREFIX: ClassVar[str] = "tg"
    TAIL_PATTERN: ClassVar[str] = r"(_pf?)?(_tma)?(?:_pdl(\d))?"

    persistent: bool = False
    tma: bool = False
    pdl: int = 0  # 0 plain launch, 1 programmatic dependent launch, 2 that plus a weight-tile prefetch
    flatten: bool = False  # persistent only (`_pf`): the tile loop and the K loop pipelined as one

    def name_tail(self) -> str:
        pdl = f"_pdl{self.pdl}" if self.pdl else ""
        persistent = ("_pf" if self.flatten else "_p") if self.persistent else ""
        return persistent + ("_tma" if self.tma else "") + pdl

    @classmethod
    def tail_fields(cls, groups: tuple) -> tuple:
        persistent, tma, pdl = groups
        return bool(persistent), bool(tma), int(pdl or 0), persistent == "_pf"

    def smem_bytes(self, elem_bytes: int) -> int:
        # Flattened, Triton 3.9 also keeps a 32 KiB epilogue buffer beside the stages (sm_90 builds).
        return super().smem_bytes(elem_bytes) + (FLATTEN_SMEM if self.flatten else 0)

    def validate_own(self) -> None:
        if self.persistent and self.split_k > 1:
            raise ValueError(f"{self.name}: the persistent variant does not split K")
        if self.flatten and not self.persistent:
            raise ValueError(f"{self.name}: only the persistent variant flattens its loops")
        if self.pdl not in (0, 1, 2) or (self.pdl == 2 and self.tma):
            raise ValueError(f"{self.name}: pdl must be 0, 1 or 2 (2 only without TMA)")


def parse_config(name: str) -> TGConfig | None:
    """The config a kernel name spells, or None when it is not one of ours."""
    return TGConfig.parse(name)


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row-tiles share each weight column-tile while it is still in L2.
    in_group = GROUP_M * num_pid_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % size_m
    pid_n = (tile_id % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def split_k_range(k_tiles, split_k, SPLIT_AXIS: tl.constexpr, IS_SPLIT: tl.constexpr):
    """The K tiles [kt0, kt1) this program's split (its grid index along SPLIT_AXIS) covers, possibly
    none (its partial is then zero); all of them when K is not split."""
    kt0 = 0
    kt1 = k_tiles
    if IS_SPLIT:
        per = tl.cdiv(k_tiles, split_k)
        kt0 = tl.program_id(SPLIT_AXIS) * per
        kt1 = tl.minimum(kt0 + per, k_tiles)
    return kt0, kt1


@triton.jit
def sum_partials(tile_part, offs, split_k, BM: tl.constexpr, BN: tl.constexpr, CACHE: tl.constexpr):
    """The split_k fp32 partial blocks of one tile ([split_k, BM, BN], contiguous) added in split
    order, so the sum does not depend on which split finished last: replays are bit-identical."""
    acc = tl.load(tile_part + offs, cache_modifier=CACHE)
    for s in range(1, split_k):
        acc += tl.load(tile_part + s * (BM * BN) + offs, cache_modifier=CACHE)
    return acc


@triton.jit
def store_partial_arrive(acc, tile_part, offs, pid_k, lock, slot, BM: tl.constexpr, BN: tl.constexpr):
    """In-kernel split-K fixup, first half: store this split's partial, then count its arrival at
    lock[slot]; returns how many splits had arrived before (split_k - 1: this one is the last)."""
    tl.store(tile_part + pid_k * (BM * BN) + offs, acc, cache_modifier=".cg")
    # Every thread's partial is stored before one thread publishes the arrival.
    tl.debug_barrier()
    return tl.atomic_add(lock + slot, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _pdl_prologue(w, pid_n, kt0, N, K, swn, swk, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    """Let the next kernel launch; with PDL == 2 pull this program's first weight tile into L2 (one
    element per 32-byte sector, result discarded, so a w the previous kernel wrote is still read
    right after the wait); then wait for the previous kernel, which may be writing x."""
    if PDL > 0:
        gdc_launch_dependents()
        if PDL > 1 and not USE_TMA:
            STEP: tl.constexpr = 256 // w.dtype.element_ty.primitive_bitwidth
            offs_n = (pid_n * BN + tl.arange(0, BN)) % N
            offs_k = kt0 * BK + tl.arange(0, BK // STEP) * STEP
            tl.load(w + offs_n[:, None] * swn + offs_k[None, :] * swk, mask=offs_k[None, :] < K, volatile=True)
        gdc_wait()


@triton.jit
def tile_mainloop(
    x,
    w,
    M,
    N,
    K,
    sxm,
    sxk,
    swn,
    swk,
    pid_m,
    pid_n,
    kt0,
    kt1,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    INPUT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
    ACC_INT: tl.constexpr,
):
    if ACC_INT:  # int8 operands: exact int32 sums, one conversion to fp32 after the loop
        acc = tl.zeros((BM, BN), dtype=tl.int32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        for kt in tl.range(kt0, kt1, num_stages=STAGES):
            a = x.load([pid_m * BM, kt * BK])
            b = w.load([pid_n * BN, kt * BK])
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PREC, out_dtype=acc.dtype)
    else:
        # Rows past M / N wrap onto valid rows (their results are masked at the store), so the
        # main loop needs no M or N mask; only a ragged K needs one.
        offs_m = (pid_m * BM + tl.arange(0, BM)) % M
        offs_n = (pid_n * BN + tl.arange(0, BN)) % N
        offs_k = kt0 * BK + tl.arange(0, BK)
        a_ptrs = x + offs_m[:, None] * sxm + offs_k[None, :] * sxk
        b_ptrs = w + offs_n[None, :] * swn + offs_k[:, None] * swk
        for kt in tl.range(kt0, kt1, num_stages=STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kt * BK
                a = tl.load(a_ptrs, mask=tl.arange(0, BK)[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=tl.arange(0, BK)[:, None] < k_left, other=0.0)
            # Triton 3.6 asserts out_dtype == the acc dtype (its default is fp32 even for int8).
            acc = tl.dot(a, b, acc, input_precision=INPUT_PREC, out_dtype=acc.dtype)
            a_ptrs += BK * sxk
            b_ptrs += BK * swk
    return acc.to(tl.float32)


ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3}


@triton.jit
def tile_epilogue(acc, bias, y, M, N, sym, syn, pid_m, pid_n, BM: tl.constexpr, BN: tl.constexpr,
                  HAS_BIAS: tl.constexpr, c, scm, scn, alpha, beta, HAS_ALPHA: tl.constexpr, HAS_C: tl.constexpr,
                  ACT: tl.constexpr, xs, ws, XS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """y = act(alpha * acc * xs * ws + beta * c + bias), in fp32 registers, one rounding at the store. C's
    strides may be zero (a row, a column or a scalar broadcast over the tile). The 8-bit scales (XS, WS:
    0 none, 1 one for all, 2 per row of x / per column of y) come first, on the whole (split) sum."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if XS == 1:
        acc = acc * tl.load(xs)
    elif XS == 2:
        acc = acc * tl.load(xs + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if WS == 1:
        acc = acc * tl.load(ws)
    elif WS == 2:
        acc = acc * tl.load(ws + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_ALPHA:
        acc = acc * alpha
    if HAS_C:
        cv = tl.load(c + offs_m[:, None] * scm + offs_n[None, :] * scn, mask=mask, other=0.0)
        acc += beta * cv.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACT == 2:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))  # x / sqrt(2)
    elif ACT == 3:  # 0.5 * (1 + tanh(u)) == 1 / (1 + exp(-2u)), u = sqrt(2 / pi) * (x + 0.044715 x^3)
        acc = acc / (1.0 + tl.exp(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)))
    tl.store(y + offs_m[:, None] * sym + offs_n[None, :] * syn, acc.to(y.dtype.element_ty), mask=mask)


# M and the split-K factor are runtime values so one compiled kernel serves every M and split.
@triton.jit(do_not_specialize=["M", "split_k"])
def _tg_kernel(
    x,
    w,
    bias,
    y,
    part,
    lock,
    M,
    N,
    K,
    sxm,
    sxk,
    swn,
    swk,
    sym,
    syn,
    split_k,
    c,
    scm,
    scn,
    alpha,
    beta,
    xs,
    ws,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    FIXUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_SMS: tl.constexpr,
    INPUT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = 0,
    HAS_ALPHA: tl.constexpr = False,
    HAS_C: tl.constexpr = False,
    ACT: tl.constexpr = 0,
    XS: tl.constexpr = 0,
    WS: tl.constexpr = 0,
    ACC_INT: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    if PDL > 0:  # this program's first tile (the persistent grid's too) and its first K tile
        _, first_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        first_kt = tl.program_id(1) * tl.cdiv(k_tiles, split_k) if IS_SPLIT else 0
        _pdl_prologue(w, first_n, first_kt, N, K, swn, swk, BN, BK, USE_TMA, PDL)
    if PERSISTENT:
        # FLATTEN lets the pipeliner fold the K loop into the tile loop, so the next tile's first loads
        # are in flight during this tile's epilogue (off by default: the loop compiles as before).
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = tile_mainloop(
                x, w, M, N, K, sxm, sxk, swn, swk, pid_m, pid_n, 0, k_tiles,
                BM, BN, BK, EVEN_K, USE_TMA, INPUT_PREC, STAGES, ACC_INT,
            )  # fmt: skip
            tile_epilogue(acc, bias, y, M, N, sym, syn, pid_m, pid_n, BM, BN, HAS_BIAS,
                      c, scm, scn, alpha, beta, HAS_ALPHA, HAS_C, ACT, xs, ws, XS, WS)  # fmt: skip
    else:
        tile = tl.program_id(0)
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        kt0, kt1 = split_k_range(k_tiles, split_k, 1, IS_SPLIT)
        acc = tile_mainloop(
            x, w, M, N, K, sxm, sxk, swn, swk, pid_m, pid_n, kt0, kt1,
            BM, BN, BK, EVEN_K, USE_TMA, INPUT_PREC, STAGES, ACC_INT,
        )  # fmt: skip
        if not IS_SPLIT:
            tile_epilogue(acc, bias, y, M, N, sym, syn, pid_m, pid_n, BM, BN, HAS_BIAS,
                      c, scm, scn, alpha, beta, HAS_ALPHA, HAS_C, ACT, xs, ws, XS, WS)  # fmt: skip
        else:
            pid_k = tl.program_id(1)
            # Partials live per tile as [split_k, BM, BN] blocks: contiguous, no M/N masks needed.
            offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            tile_part = part + tile.to(tl.int64) * (split_k * BM * BN)
            if FIXUP:
                arrived = store_partial_arrive(acc, tile_part, offs, pid_k, lock, tile, BM, BN)
                if arrived == split_k - 1:  # the last split adds all partials (its own included)
                    acc = sum_partials(tile_part, offs, split_k, BM, BN, ".cg")
                    tile_epilogue(acc, bias, y, M, N, sym, syn, pid_m, pid_n, BM, BN, HAS_BIAS,
                      c, scm, scn, alpha, beta, HAS_ALPHA, HAS_C, ACT, xs, ws, XS, WS)  # fmt: skip
                    tl.atomic_xchg(lock + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call
            else:
                tl.store(tile_part + pid_k * (BM * BN) + offs, acc)


@triton.jit(do_not_specialize=["M", "split_k"])
def _tg_reduce(
    part,
    bias,
    y,
    M,
    N,
    sym,
    syn,
    split_k,
    c,
    scm,
    scn,
    alpha,
    beta,
    xs,
    ws,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_ALPHA: tl.constexpr = False,
    HAS_C: tl.constexpr = False,
    ACT: tl.constexpr = 0,
    XS: tl.constexpr = 0,
    WS: tl.constexpr = 0,
):
    # One program per output tile: sums its split_k partial blocks, adds bias, casts, stores.
    tile = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tile_part = part + tile.to(tl.int64) * (split_k * BM * BN)
    acc = sum_partials(tile_part, offs, split_k, BM, BN, "")  # a default constexpr str reaches Triton 3.6 as a bare str
    tile_epilogue(acc, bias, y, M, N, sym, syn, pid_m, pid_n, BM, BN, HAS_BIAS,
                      c, scm, scn, alpha, beta, HAS_ALPHA, HAS_C, ACT, xs, ws, XS, WS)  # fmt: skip


_TL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: one per SM on a GPU; under the CPU interpreter a small grid (any
    size is correct there, and every program runs serially)."""
    return facts(device).sms if device.type == "cuda" else 4


ALIGN_TMA = 16  # TMA needs 16-byte aligned bases and row strides


def tma_usable(x: torch.Tensor, w: torch.Tensor, cfg: TGConfig) -> bool:
    """TMA needs 16-byte aligned bases and row strides, and a unit inner stride."""
    if TensorDescriptor is None:
        return False
    for t in (x, w):
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % ALIGN_TMA or t.data_ptr() % ALIGN_TMA:
            return False
    return True


class _Launch:
    """One signature's launches of a TGKernel: the GEMM kernel and, for split-K mode 'r', its reduce
    kernel, with every argument but the tensors fixed (kernels/launch.py's BoundLaunch). A call makes only
    what changes from call to call: the TMA descriptors and the split-K partials buffer. The eager
    per-call host cost of a Triton row is this, not the argument lists."""

    __slots__ = ("name", "gemm", "reduce", "x_block", "w_block", "copy_x", "part_numel", "lock", "has_c")

    def __init__(self, name: str, gemm, reduce, x_block, w_block, copy_x: bool, part_numel: int, lock, has_c: bool):
        self.name, self.gemm, self.reduce, self.has_c = name, gemm, reduce, has_c
        self.x_block, self.w_block = x_block, w_block  # TMA block shapes; None without TMA
        self.copy_x = copy_x  # x's strides cannot feed TMA: each call copies it (the signature fixes them)
        self.part_numel = part_numel
        self.lock = lock

    def __call__(self, x, w, bias, y, c, xs, ws) -> None:
        xa, wa = x, w
        if self.x_block is not None:
            if self.copy_x or x.data_ptr() % ALIGN_TMA:
                x = x.clone(memory_format=torch.contiguous_format)
            if x.data_ptr() % ALIGN_TMA or w.data_ptr() % ALIGN_TMA:
                raise ValueError(f"{self.name}: w at {w.data_ptr():#x} cannot use TMA (needs a 16-byte aligned base)")
            xa = TensorDescriptor.from_tensor(x, self.x_block)
            wa = TensorDescriptor.from_tensor(w, self.w_block)
        part = torch.empty(self.part_numel, dtype=torch.float32, device=y.device) if self.part_numel else y
        b = y if bias is None else bias
        cv = c if self.has_c else y
        xs, ws = (y, y) if xs is None else (xs, ws)
        self.gemm(xa, wa, b, y, part, self.lock if self.lock is not None else y, cv, xs, ws)
        if self.reduce is not None:
            self.reduce(part, b, y, cv, xs, ws)


class TGKernel:
    """A config bound to a problem family (dtypes, bias, device): call it as kernel(x2d, w, bias, y)."""

    def __init__(self, cfg: TGConfig, device: torch.device, lock_tiles: int = 0):
        self.cfg = cfg.validate()
        self.device = device
        self.num_sms = num_sms(device)
        # Per-tile arrival counters for in-kernel split-K fixup; each call leaves them at zero.
        self._lock = (
            torch.zeros(max(lock_tiles, 1), dtype=torch.int32, device=device)
            if cfg.split_k > 1 and cfg.sk_mode == "f"
            else None
        )

        if cfg.pdl and not HAS_PDL:
            raise ValueError(f"{cfg.name}: this Triton has no programmatic dependent launch")
        self._pdl = {"PDL": cfg.pdl, "launch_pdl": True} if cfg.pdl else {}
        self._launches = Plans()  # signature -> _Launch

    def tiles(self, M: int, N: int) -> int:
        return triton.cdiv(M, self.cfg.bm) * triton.cdiv(N, self.cfg.bn)

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        y: torch.Tensor,
        c: torch.Tensor | None = None,
        alpha: float = 1.0,
        beta: float = 0.0,
        act: str = "none",
        xs: torch.Tensor | None = None,
        ws: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = act(alpha * x @ w^T + beta * c + bias); c is an (M, N) view (zero strides broadcast)
        or None. The defaults compile to the plain GEMM + bias kernel. 8-bit x, w (int8 or fp8) take
        their fp32 scales xs ([M, 1] or one element) and ws ([1, N] or one element), both contiguous."""
        if x.shape[0] == 0:
            return y
        signature = (*(tensor_signature(t) for t in (x, w, bias, y, c, xs, ws)), alpha, beta, act)
        launch = self._launches.get(signature)
        if launch is None:
            self._launches.put(signature, self._first(x, w, bias, y, c, alpha, beta, act, xs, ws))
        else:
            launch(x, w, bias, y, c, xs, ws)
        return y

    def _first(self, x, w, bias, y, c, alpha, beta, act, xs, ws) -> _Launch:
        """Launch through JITFunction (compiling when needed) and return the signature's _Launch."""
        cfg = self.cfg
        M, K = x.shape
        N = w.shape[0]
        tiles = self.tiles(M, N)
        has_bias = bias is not None
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        even_k = cfg.tma or K % cfg.bk == 0  # TMA zero-fills a ragged K tail itself
        xa, wa = x, w
        copy_x = False
        if cfg.tma:
            if not tma_usable(x, w, cfg):
                x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
                if not tma_usable(x, w, cfg):
                    raise ValueError(
                        f"{cfg.name}: x {tuple(x.shape)} / w {tuple(w.shape)} cannot use TMA "
                        f"(needs 16-byte aligned rows)"
                    )
                copy_x = x.stride() != xa.stride()
            xa = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
            wa = TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk])
        part = y  # unused placeholder when K is not split
        lock = y
        part_numel = tiles * cfg.split_k * cfg.bm * cfg.bn if cfg.split_k > 1 else 0
        if part_numel:
            part = torch.empty(part_numel, dtype=torch.float32, device=x.device)
            if cfg.sk_mode == "f":
                if self._lock.numel() < tiles:
                    self._lock = torch.zeros(tiles, dtype=torch.int32, device=x.device)
                lock = self._lock
        grid = (min(tiles, self.num_sms),) if cfg.persistent else (tiles, cfg.split_k)
        b = bias if has_bias else y
        has_c = c is not None and beta != 0.0
        epi = {"HAS_ALPHA": alpha != 1.0, "HAS_C": has_c, "ACT": ACT_CODES[act]}  # all off: the plain GEMM
        if xs is not None:  # 8-bit operands: scales in the epilogue (after any split-K sum)
            epi.update(XS=1 if xs.numel() == 1 else 2, WS=1 if ws.numel() == 1 else 2)
        quant = {"ACC_INT": x.dtype == torch.int8} if xs is not None else {}
        if cfg.flatten:
            quant["FLATTEN"] = True
        xs, ws = (xs, ws) if xs is not None else (y, y)
        cv, scm, scn = (c, c.stride(0), c.stride(1)) if has_c else (y, 0, 0)
        gemm = bind(
            _tg_kernel,
            grid,
            xa,
            wa,
            b,
            y,
            part,
            lock,
            M,
            N,
            K,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            y.stride(0),
            y.stride(1),
            cfg.split_k,
            cv,
            scm,
            scn,
            float(alpha),
            float(beta),
            xs,
            ws,
            HAS_BIAS=has_bias,
            BM=cfg.bm,
            BN=cfg.bn,
            BK=cfg.bk,
            GROUP_M=cfg.group_m,
            IS_SPLIT=cfg.split_k > 1,
            FIXUP=cfg.sk_mode == "f",
            EVEN_K=even_k,
            USE_TMA=cfg.tma,
            PERSISTENT=cfg.persistent,
            NUM_SMS=self.num_sms,
            INPUT_PREC=prec,
            STAGES=cfg.stages,
            num_warps=cfg.warps,
            num_stages=cfg.stages,
            **self._pdl,
            **epi,
            **quant,
        )
        reduce = None
        if cfg.split_k > 1 and cfg.sk_mode == "r":
            reduce = bind(
                _tg_reduce,
                (tiles,),
                part,
                b,
                y,
                M,
                N,
                y.stride(0),
                y.stride(1),
                cfg.split_k,
                cv,
                scm,
                scn,
                float(alpha),
                float(beta),
                xs,
                ws,
                HAS_BIAS=has_bias,
                BM=cfg.bm,
                BN=cfg.bn,
                GROUP_M=cfg.group_m,
                num_warps=4,
                **epi,
            )
        blocks = ([cfg.bm, cfg.bk], [cfg.bn, cfg.bk]) if cfg.tma else (None, None)
        fixup_lock = lock if part_numel and cfg.sk_mode == "f" else None
        return _Launch(cfg.name, gemm, reduce, *blocks, copy_x, part_numel, fixup_lock, has_c)


def triton_gemm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: TGConfig, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One-off call (tests, examples); the backend binds a TGKernel once instead."""
    check_operands(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    TGKernel(cfg, x.device)(x2, w, bias, y)
    return y.view(*x.shape[:-1], w.shape[0])


def check_operands(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"triton gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not match (need x[..., K], w[N, K])"
        )
    if x.dtype != w.dtype or x.dtype not in _TL_DTYPES:
        raise ValueError(f"triton gemm: dtypes x {x.dtype}, w {w.dtype} (need equal fp16/bf16/fp32)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"triton gemm: bias {tuple(bias.shape)} does not match N={w.shape[0]}")
