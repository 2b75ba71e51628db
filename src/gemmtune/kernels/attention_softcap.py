"""Flash-attention forward with logit softcapping (Gemma-2), causal / sliding-window masks and GQA.

out[b, i, h] = softmax_j(s_ij) @ v[b, h // n_rep],  s_ij = cap * tanh(q_i . k_j * scale / cap)
(s_ij = q_i . k_j * scale without a softcap), over the keys j a query may see:
  - causal: query i sits at absolute position pos_i = i + (S - L), aligned to the end of the S keys
    (prefill L == S, chunked prefill L < S); it sees keys j <= pos_i;
  - sliding window W (causal only): also j > pos_i - W, transformers' convention (sliding_window_overlay);
  - mask: a boolean [B|1, 1, L, >=S] mask (transformers'), ANDed with the above. Two small kernels read
    it once (no host sync): _mask_blocks classifies each (BLOCK_M rows, BLOCK_N keys) tile as hidden,
    whole or partial and packs each row's bits of a key block into an int64; _mask_ranges turns the
    classes into each row block's visible blocks and its first run of whole blocks. A row that sees no
    key (padding) gives 0.
Inputs are transformers' [B, H, L|S, D] views with any strides; the output is [B, L, Hq, D] contiguous,
the layout its attention functions return. One program per (batch, query head, BLOCK_M query rows):
an online softmax with fp32 row max / sum / accumulator over the visible KV blocks only, in two loops:
the run of blocks every row sees whole (no mask, no bounds: the same code with or without a mask), then
the edge blocks on both sides of it (the window's and the diagonal's edges, the mask's partial blocks),
which apply the pattern and the mask's bits as a select on the fp32 scores. So a causal mask costs about
what the mask-free causal kernel does: the two mask kernels read L x S bytes once.

The softcap's tanh is PTX's tanh.approx.f32 on NVIDIA (one MUFU op: with D=256 the exp units are as busy
as the tensor cores; its error, ~5e-4 relative, is below the bf16 rounding of the scores in the eager
formula), else 1 - 2 / (exp(2x) + 1) (saturates to +-1, no overflow).

`softcap_attention_ref` is the same function in plain PyTorch with fp32 math.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from ..device import NVIDIA, triton_installed, vendor
from ._common import HAS_TRITON, tl, triton
from ._common import empty_out as _empty

log = logging.getLogger("gemmtune")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_MASK_BLOCK_N = 64
# Software-pipeline stages of the loop over the edge key blocks (two per row tile in causal prefill). Not
# pipelining it: ptxas for sm_90 (Triton 3.9) spills 24 B instead of 60 B at D=256 without a mask, 36 B
# instead of 40 B with one, and the mask bits need no shared memory. The benchmark times both.
EDGE_STAGES = 1
LOG2E = 1.4426950408889634


class Config(NamedTuple):
    """Launch config: query rows and keys per tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"


def parse_config(text: str) -> Config:
    """'128x64w8s2' -> Config(128, 64, 8, 2) (the str() form)."""
    try:
        mn, rest = text.strip().split("w")
        warps, stages = rest.split("s")
        m, n = mn.split("x")
        return Config(int(m), int(n), int(warps), int(stages))
    except ValueError:
        raise ValueError(f"attention config {text!r}: expected BMxBNwWARPSsSTAGES, e.g. 128x64w8s2") from None


# By padded head dim. Hopper shared memory (227 KB per block) holds Q (BLOCK_M x D) and num_stages
# copies of the K and V tiles (BLOCK_N x D each): at D=256 in 16-bit, 128x64 with 2 stages is
# 64 + 2 x 64 = 192 KB. Sweep with benchmarks/bench_attention_softcap.py --sweep before changing one.
CONFIGS = {
    16: Config(128, 64, 4, 3),
    32: Config(128, 64, 4, 3),
    64: Config(128, 64, 4, 3),
    128: Config(128, 64, 8, 3),
    256: Config(128, 64, 8, 2),
}


# Used where a table config does not build on this GPU (too much shared memory: Triton's OutOfResources).
FALLBACK = Config(64, 32, 4, 2)
_failed_configs: dict = {}  # (config, head dim, dtype, device) -> why


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def default_config(head_dim: int, dtype: torch.dtype) -> Config:
    """The table's config for this head dim (16- and 32-bit inputs share it: fp32 is for testing)."""
    return CONFIGS[block_d(head_dim)]


# ---- reference ----------------------------------------------------------------------------------
def visible(q_len: int, kv_len: int, causal: bool, window: int | None, device=None) -> torch.Tensor | None:
    """[L, S] bool: which keys each query sees (None: all)."""
    if not causal:
        return None
    pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    ok = j <= pos
    if window:
        ok = ok & (j > pos - window)
    return ok


def softcap_attention_ref(q, k, v, *, scaling=None, softcap=None, causal=True, window=None, mask=None) -> torch.Tensor:
    """The kernel's function in fp32 math: [B, Hq, L, D] x [B, Hkv, S, D] -> [B, L, Hq, D] in q's dtype
    (a query row that sees no key gives 0, as the kernel does)."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    n_rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(n_rep, 1), v.float().repeat_interleave(n_rep, 1)
    s = q.float() @ kf.transpose(-1, -2) * scaling
    if softcap is not None and softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    ok = visible(q.shape[2], k.shape[2], causal, window, q.device)
    if mask is not None:
        m = mask[..., : k.shape[2]]
        ok = m if ok is None else ok & m
    if ok is None:
        return (torch.softmax(s, -1) @ vf).transpose(1, 2).contiguous().to(q.dtype)
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no visible key: 0
    return (p @ vf).transpose(1, 2).contiguous().to(q.dtype)


# ---- kernel -------------------------------------------------------------------------------------
if HAS_TRITON:
    from triton.runtime.errors import OutOfResources as _OutOfResources

    @triton.jit
    def _tanh(x, FAST: tl.constexpr):
        if FAST:
            return tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _kv_block(
        acc, l_i, m_i, q, k_base, v_base, bits_ptrs, start_n, pos, offs_m, offs_n, offs_d,
        stride_kn, stride_kd, stride_vn, stride_vd, L, S, window, score_scale, cap_out,
        MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
        SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_D: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One BLOCK_N key block of the online softmax. MASKED: keys past S, the causal / window pattern
        and the boolean mask (one int64 of bits per row: _mask_blocks) become -inf scores, a select on the
        fp32 scores after the first product; else every row sees every key and only K and V are read."""
        # Scores are kept in log2 units (exp2 below): score_scale / cap_out carry the log2(e) factor.
        dmask = offs_d < D
        cols = start_n + offs_n
        k_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            kv_in = cols < S
            k = tl.load(k_ptrs, mask=kv_in[None, :] & dmask[:, None], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=dmask[:, None], other=0.0)
        qk = tl.dot(q, k, input_precision=PRECISION)
        if SOFTCAP:
            s = _tanh(qk * score_scale, FAST_TANH) * cap_out
        else:
            s = qk * score_scale
        if MASKED:
            ok = kv_in[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= pos[:, None])
            if WINDOW:
                ok = ok & (cols[None, :] > pos[:, None] - window)
            if HAS_MASK:
                # the mask as a [BLOCK_M, BLOCK_N] byte tile made ptxas spill ~1.3 KB at D=256
                w = tl.load(bits_ptrs + start_n // BLOCK_N, mask=offs_m < L, other=0)
                ok = ok & (((w[:, None] >> offs_n[None, :].to(tl.int64)) & 1) != 0)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASKED:  # a row with no visible key yet: subtract 0, so exp2(-inf) = 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_in[:, None] & dmask[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _softcap_attn_fwd(
        Q, K, V, Out, Bits,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, spb, spm, R, srb,
        Hq, n_rep, L, S, window, score_scale, cap_out,
        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
        FAST_TANH: tl.constexpr, EVEN_D: tl.constexpr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, EDGE_STAGES: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        start_m = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) row blocks first
        b = (bh // Hq).to(tl.int64)
        h = bh % Hq
        hk = (h // n_rep).to(tl.int64)
        h = h.to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :] * sqd
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < L) & (offs_d[None, :] < D), other=0.0)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        bits_ptrs = Bits + b * spb + offs_m.to(tl.int64) * spm  # this tile's rows of packed mask bits
        r_base = R + b * srb + start_m * 4
        off = S - L
        pos = offs_m + off
        first = start_m * BLOCK_M + off  # position of the tile's first and last query rows
        last = tl.minimum(start_m * BLOCK_M + BLOCK_M, L) - 1 + off
        # [lo, hi): the keys some row of the tile sees; [full_lo, full_hi): blocks every row sees whole.
        lo = 0
        hi = S
        full_lo = 0
        full_hi = (S // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi = tl.minimum(S, last + 1)
            full_hi = (tl.minimum(S, first + 1) // BLOCK_N) * BLOCK_N
        if WINDOW:
            lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.maximum(lo, tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N)
        if HAS_MASK:  # the mask's own ranges (_mask_blocks, _mask_ranges), intersected
            lo = tl.maximum(lo, tl.load(r_base))
            hi = tl.minimum(hi, tl.load(r_base + 1))
            full_lo = tl.maximum(full_lo, tl.load(r_base + 2))
            full_hi = tl.minimum(full_hi, tl.load(r_base + 3))
        mid_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
        mid_hi = tl.maximum(full_hi, mid_lo)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # The online softmax does not depend on the order of the blocks: first the run every row sees
        # whole (the mask-free loop: no mask, no bounds), then the edge blocks on either side of it in
        # one masked loop (two masked loops made ptxas serialize the wgmmas and spill).
        for start_n in range(mid_lo, mid_hi, BLOCK_N):
            acc, l_i, m_i = _kv_block(
                acc, l_i, m_i, q, k_base, v_base, bits_ptrs, start_n, pos, offs_m, offs_n, offs_d, skn, skd, svn,
                svd, L, S, window, score_scale, cap_out, MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW,
                HAS_MASK=HAS_MASK, SOFTCAP=SOFTCAP, FAST_TANH=FAST_TANH, EVEN_D=EVEN_D, D=D, BLOCK_N=BLOCK_N,
                PRECISION=PRECISION,
            )  # fmt: skip
        n_before = tl.cdiv(mid_lo - lo, BLOCK_N)
        n_edge = n_before + tl.cdiv(hi - mid_hi, BLOCK_N)
        for i in tl.range(0, n_edge, num_stages=EDGE_STAGES):
            start_n = tl.where(i < n_before, lo + i * BLOCK_N, mid_hi + (i - n_before) * BLOCK_N)
            acc, l_i, m_i = _kv_block(
                acc, l_i, m_i, q, k_base, v_base, bits_ptrs, start_n, pos, offs_m, offs_n, offs_d, skn, skd, svn,
                svd, L, S, window, score_scale, cap_out, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW,
                HAS_MASK=HAS_MASK, SOFTCAP=SOFTCAP, FAST_TANH=FAST_TANH, EVEN_D=EVEN_D, D=D, BLOCK_N=BLOCK_N,
                PRECISION=PRECISION,
            )  # fmt: skip
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key (padding, past L): 0
        out = acc / l_i[:, None]
        o_ptrs = Out + ((b * L + offs_m[:, None]) * Hq + h) * D + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_d[None, :] < D))

    @triton.jit
    def _mask_blocks(M, Bits, C, smb, smm, smn, L, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """For the mask tile of (batch b, query rows block m, keys block n): C[b, m, n] = 0 (no row sees a
        key), 2 (every row below L sees every key, all below S) or 1; Bits[b, row, n] = the tile's row as
        an int64, bit j for key n * BLOCK_N + j (what the attention kernel reads in edge blocks)."""
        b = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1)
        n = tl.program_id(2)
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_in = rows < L
        inside = row_in[:, None] & (cols[None, :] < S)
        ptrs = M + b * smb + rows[:, None].to(tl.int64) * smm + cols[None, :] * smn
        t = tl.load(ptrs, mask=inside, other=0) != 0  # keys past S: not visible
        seen = tl.max(tl.max(t.to(tl.int32), 1), 0)
        full = tl.min(tl.min((t | ~row_in[:, None]).to(tl.int32), 1), 0)  # rows past L do not count
        n_blocks = tl.num_programs(2)
        tl.store(C + (b * tl.num_programs(1) + m) * n_blocks + n, tl.where(full > 0, 2, seen).to(tl.int8))
        word = tl.sum(t.to(tl.int64) << tl.arange(0, BLOCK_N).to(tl.int64)[None, :], 1)  # distinct bits: OR
        tl.store(Bits + (b * L + rows) * n_blocks + n, word, mask=row_in)

    @triton.jit
    def _mask_ranges(C, R, n_blocks, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
        """R[b, m] = (lo, hi, full_lo, full_hi) in keys from the classes C[b, m, :] (_mask_blocks): the
        blocks [lo, hi) hold every key some row of block m sees, [full_lo, full_hi) is the first run of
        blocks that every row sees whole."""
        bm = tl.program_id(0).to(tl.int64)
        big = n_blocks + 1
        lo = big
        hi = 0
        run_lo = big
        run_hi = big
        for c in range(0, n_blocks, CHUNK):
            idx = c + tl.arange(0, CHUNK)
            inside = idx < n_blocks
            cls = tl.load(C + bm * n_blocks + idx, mask=inside, other=0)
            lo = tl.minimum(lo, tl.min(tl.where(cls > 0, idx, big), 0))
            hi = tl.maximum(hi, tl.max(tl.where(cls > 0, idx + 1, 0), 0))
            run_lo = tl.minimum(run_lo, tl.min(tl.where(cls == 2, idx, big), 0))
            # the first block after the run's start that is not whole (chunks come in order)
            run_hi = tl.minimum(run_hi, tl.min(tl.where(inside & (cls != 2) & (idx > run_lo), idx, big), 0))
        lo = tl.where(hi == 0, 0, lo)
        no_run = run_lo == big
        run_hi = tl.where(no_run, 0, tl.minimum(run_hi, n_blocks))
        run_lo = tl.where(no_run, 0, run_lo)
        r = R + bm * 4
        tl.store(r, lo * BLOCK_N)
        tl.store(r + 1, hi * BLOCK_N)
        tl.store(r + 2, run_lo * BLOCK_N)
        tl.store(r + 3, run_hi * BLOCK_N)


# ---- launcher -----------------------------------------------------------------------------------
def _d(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def validate(q, k, v, softcap, causal: bool, window, mask=None) -> None:
    """Raise naming the shapes / dtypes / devices for anything the kernel does not compute."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"softcap_attention: {name} must be a tensor, got {type(t).__name__}")
    where = f"(query {_d(q)}, key {_d(k)}, value {_d(v)})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"softcap_attention: query, key and value must be 4-D [B, H, L|S, D] {where}")
    if k.shape != v.shape:
        raise ValueError(f"softcap_attention: key and value shapes differ {where}")
    B, Hq, L, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"softcap_attention: key/value must be [B={B}, Hkv, S, D={D}] {where}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"softcap_attention: {Hq} query heads are not a multiple of {k.shape[1]} KV heads {where}")
    if not 0 < D <= MAX_HEAD_DIM:
        raise ValueError(f"softcap_attention: head dim {D} is outside 1..{MAX_HEAD_DIM} {where}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"softcap_attention: query, key and value must share one of float16/bfloat16/float32 {where}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"softcap_attention: tensors on several devices {where}")
    if causal and L > k.shape[2]:
        raise ValueError(f"softcap_attention: causal with more queries ({L}) than keys ({k.shape[2]}) {where}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"softcap_attention: a sliding window ({window}) needs causal=True and window >= 1")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"softcap_attention: mask must be a boolean [B|1, 1, L, >=S] tensor, got {_d(mask)}")
        if mask.shape[0] not in (1, B) or mask.shape[1] != 1 or mask.shape[2] != L or mask.shape[3] < k.shape[2]:
            want = f"[B|1, 1, L={L}, >={k.shape[2]}]"
            raise ValueError(f"softcap_attention: mask {tuple(mask.shape)} is not {want} {where}")
        if mask.device != q.device:
            raise ValueError(f"softcap_attention: mask on {mask.device}, query on {q.device}")
    if softcap is not None and not math.isfinite(softcap):
        raise ValueError(f"softcap_attention: softcap {softcap} is not finite")


def _fast_tanh(t: torch.Tensor) -> bool:
    return vendor(t.device) == NVIDIA


def softcap_attention(q, k, v, *, scaling=None, softcap=None, causal=True, window=None, mask=None, config=None):
    """The Triton kernel: [B, Hq, L, D] x [B, Hkv, S, D] -> [B, L, Hq, D] (contiguous, q's dtype).

    softcap None or <= 0: off; window None: off; mask: a boolean [B|1, 1, L, >=S] mask ANDed with the
    causal / window pattern; config: a Config (default: CONFIGS by head dim).
    Captures in CUDA graphs (no host sync; the output is the only allocation)."""
    if softcap is not None and softcap <= 0:
        softcap = None
    validate(q, k, v, softcap, causal, window, mask)
    if not triton_installed():
        raise RuntimeError("softcap_attention: triton is not installed")
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    cfg = config or default_config(D, q.dtype)
    out = _empty((B, L, Hq, D), q)
    if out.numel() == 0:
        return out
    scaling = D**-0.5 if scaling is None else float(scaling)
    if softcap is None:
        score_scale, cap_out = scaling * LOG2E, 1.0
    else:
        score_scale, cap_out = scaling / softcap, softcap * LOG2E
    if S == 0:  # no keys: softmax over nothing; the reference gives NaN, so does this
        return out.fill_(float("nan"))
    if config is None and (cfg, D, q.dtype, q.device) in _failed_configs:
        cfg = FALLBACK
    if mask is not None and cfg.block_n > MAX_MASK_BLOCK_N:
        cfg = cfg._replace(block_n=MAX_MASK_BLOCK_N)  # the mask's bits of a key block fit one int64
    scalars = (Hq, Hq // Hkv, L, S, int(window or 0), score_scale, cap_out)
    consts = {
        "CAUSAL": bool(causal), "WINDOW": window is not None, "HAS_MASK": mask is not None,
        "SOFTCAP": softcap is not None, "FAST_TANH": _fast_tanh(q), "D": D, "BLOCK_D": block_d(D),
        "EVEN_D": D == block_d(D),
        "PRECISION": "ieee" if q.dtype == torch.float32 else None,  # fp32 (tests): no TF32
        "EDGE_STAGES": EDGE_STAGES,
    }  # fmt: skip
    try:
        _launch(cfg, q, k, v, out, mask, scalars, consts)
    except _OutOfResources as exc:
        if config is not None or cfg == FALLBACK:
            raise
        _failed_configs[(cfg, D, q.dtype, q.device)] = str(exc)
        log.warning("gemmtune: attention config %s does not build here (%s); %s runs instead", cfg, exc, FALLBACK)
        _launch(FALLBACK, q, k, v, out, mask, scalars, consts)
    return out


def _launch(cfg: Config, q, k, v, out, mask, scalars, consts) -> None:
    B, Hq, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    n_m = triton.cdiv(L, cfg.block_m)
    if mask is None:
        bits, sp, ranges, srb = q, (0, 0), q, 0  # never read
    else:  # three small launches, no host sync: block classes and row bits, then each row block's ranges
        mb, n_n = mask.shape[0], triton.cdiv(S, cfg.block_n)
        classes = torch.empty((mb, n_m, n_n), device=q.device, dtype=torch.int8)
        bits = torch.empty((mb, L, n_n), device=q.device, dtype=torch.int64)
        ranges = torch.empty((mb, n_m, 4), device=q.device, dtype=torch.int32)
        m8 = mask.view(torch.uint8)  # byte loads that vectorize (Triton reads torch.bool as i1)
        sm = (m8.stride(0) if mb > 1 else 0, m8.stride(2), m8.stride(3))
        _mask_blocks[(mb, n_m, n_n)](m8, bits, classes, *sm, L, S, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        _mask_ranges[(mb * n_m,)](classes, ranges, n_n, BLOCK_N=cfg.block_n, CHUNK=256)
        sp = (L * n_n if mb > 1 else 0, n_n)
        srb = n_m * 4 if mb > 1 else 0
    args = (q, k, v, out, bits, *q.stride(), *k.stride(), *v.stride(), *sp, ranges, srb, *scalars)
    _softcap_attn_fwd[(B * Hq, n_m)](*args, **consts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
