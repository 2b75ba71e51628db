"""Prefill attention through torch's flex_attention: softcapping, causal / sliding-window / padding masks, GQA.

SDPA has no logit softcapping (Gemma-2's `attn_logit_softcapping`), so without flash-attn a softcapped
model used to drop to the eager tier (matmul + softmax). flex_attention computes the same function in
one fused Triton kernel: `score_mod` applies `softcap * tanh(score / softcap)` to the scaled scores,
and a BlockMask carries the mask:
  - no mask from transformers (plain causal, or full attention): a causal (and sliding-window) mask_mod,
    its BlockMask built once per (q_len, kv_len, window, device) and cached;
  - transformers' boolean [B|1, 1, L, S] mask (padding, static caches, sliding windows): a mask_mod that
    reads it, its BlockMask cached per mask object for the layers of one forward.
Eager calls go through one `torch.compile(flex_attention)` (flex is only fused when compiled). Inside a
graph that is being compiled, flex is not called (see attention()): the caller's tier runs the call, and
mask-free softcapped prefill there takes gemmtune's Triton kernel (ops/attention.py, one custom op).
Calls with fewer than FLEX_MIN_Q query tokens (decode) are not taken: the caller's tier runs them, with
no BlockMask built per step, so CUDA-graph capture of decode is unaffected. A prefill met for the first
time during a CUDA-graph capture is not taken either (compiling inside a capture would break it).
"""

from __future__ import annotations

import logging

import torch

from .. import device as _device

log = logging.getLogger("gemmtune")

# Decode-sized calls (up to 16 query tokens: decode, speculative steps) keep the caller's path: the
# grouped eager matmul is the measured decode path (a 4-layer Gemma-2-9B CUDA-graph decode step spends
# 0.036-0.069 ms in it on an H100, benchmarks/results/h100/bench_model_default_dispatch/gemma-2-9b.md); flex's
# decode kernel has not been measured against it.
FLEX_MIN_Q = 17
# Devices where flex_attention runs as a fused (Triton) kernel. On the CPU it is a C++ template that
# needs a compiler at run time, or an unfused reference without compile: the eager tier is as good.
FUSED_DEVICES = ("cuda",)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two up to 256: what every flex release tiles
# Kernel tiles: none forced. For head dim 256 in bf16/fp16, torch's H100 (sm90) default is 64 x 32
# tiles, 3 stages, 4 warps (the same entry in torch 2.13 and the earlier releases looked at): Q 32 KB +
# 3 stages x (K + V) 32 KB = 128 KB of the 227 KB of shared memory per block, so it fits. Options set
# here go to every flex call; a kernel that fails to build falls back to the eager tier, logged once.
KERNEL_OPTIONS: dict | None = None

try:  # torch >= 2.5 has flex_attention with enable_gqa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _MISSING = None
except ImportError:  # pragma: no cover - old torch
    create_block_mask = flex_attention = None
    _MISSING = f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs >= 2.5)"


def unavailable_reason(device) -> str | None:
    """None when flex_attention runs fused on `device`, else why not (for optimize()'s report)."""
    if _MISSING:
        return _MISSING
    kind = torch.device(device).type
    if kind not in FUSED_DEVICES:
        return f"flex_attention is fused only on CUDA here (model on {kind})"
    if not _device.triton_installed():
        return "triton is not installed (flex_attention compiles to Triton)"
    return None


# ---- score and mask functions (one object per value, so compiled code is reused) ----------------
_SCORE_MODS: dict = {}
_CAUSAL_MODS: dict = {}


def _baked(name: str, params: str, expr: str, value) -> object:
    """A mod function with `value` written into its code, not captured in a closure: torch.compile
    treats a closure's int/float as an input, and once two values of one closure were seen it makes
    it symbolic; torch 2.11 then failed to lower flex ("unbacked_bindings", H100). A constant in the
    code object is guarded by the function's identity instead: one compiled kernel per value."""
    src = f"def {name}({params}):\n    return {expr}\n"
    ns: dict = {"torch": torch}
    exec(compile(src, f"<gemmtune.flex {name} {value!r}>", "exec"), ns)  # noqa: S102 - our own fixed text
    return ns[name]


def score_mod(softcap: float | None):
    """score -> softcap * tanh(score / softcap), the eager formula on the scaled scores; None for none."""
    if softcap is None:
        return None
    if softcap not in _SCORE_MODS:
        cap = float(softcap)
        expr = f"torch.tanh(score / {cap!r}) * {cap!r}"
        _SCORE_MODS[softcap] = _baked("capped", "score, b, h, q_idx, kv_idx", expr, cap)
    return _SCORE_MODS[softcap]


def causal_mask_mod(window: int | None):
    """Causal, and within `window` keys back (transformers' sliding window: kv > q - window)."""
    if window not in _CAUSAL_MODS:
        if window is None:

            def mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
        else:
            window = int(window)
            mod = _baked("windowed", "b, h, q_idx, kv_idx", f"(q_idx >= kv_idx) & (q_idx - kv_idx < {window})", window)
        _CAUSAL_MODS[window] = mod
    return _CAUSAL_MODS[window]


def tensor_mask_mod(mask: torch.Tensor):
    """Reads a boolean [B, 1, L, S] mask (True = attend)."""

    def mod(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx, kv_idx]

    return mod


# ---- block masks --------------------------------------------------------------------------------
_CAUSAL_BLOCKS: dict = {}  # (q_len, kv_len, window, device) -> BlockMask
_TENSOR_BLOCKS: dict = {}  # id(mask) -> (the mask, its version, shape, BlockMask)
_TENSOR_BLOCKS_MAX = 4  # masks of one forward (Gemma-2: a full and a sliding one); each holds B*L*S bytes


def causal_block_mask(q_len: int, kv_len: int, window: int | None, device):
    """The causal (sliding-window) BlockMask: cached in eager code; a graph being compiled builds its
    own (reading a cache mutated outside would make its guards depend on that cache)."""
    if window is not None and window >= kv_len:
        window = None  # no key is that far back: the plain causal mask, one cache entry for both
    if torch.compiler.is_compiling():
        return create_block_mask(causal_mask_mod(window), None, None, q_len, kv_len, device=device)
    key = (q_len, kv_len, window, torch.device(device))
    bm = _CAUSAL_BLOCKS.get(key)
    if bm is None:
        bm = _CAUSAL_BLOCKS[key] = create_block_mask(causal_mask_mod(window), None, None, q_len, kv_len, device=device)
    return bm


def tensor_block_mask(mask: torch.Tensor, batch: int, kv_len: int):
    """BlockMask of transformers' boolean mask (cropped to kv_len keys, broadcast to the batch); in eager
    code reused by the layers that get the same mask object in one forward."""
    # A dense copy: flex's compiled kernels read the captured mask with plain strides.
    m = mask[..., :kv_len].expand(batch, 1, mask.shape[2], kv_len).contiguous()
    if torch.compiler.is_compiling():
        return create_block_mask(tensor_mask_mod(m), batch, None, m.shape[2], kv_len, device=m.device)
    entry = _TENSOR_BLOCKS.get(id(mask))
    shape = tuple(m.shape)
    if entry is not None and entry[0] is mask and entry[1] == mask._version and entry[2] == shape:
        return entry[3]
    bm = create_block_mask(tensor_mask_mod(m), batch, None, m.shape[2], kv_len, device=m.device)
    if len(_TENSOR_BLOCKS) >= _TENSOR_BLOCKS_MAX:
        _TENSOR_BLOCKS.clear()
    _TENSOR_BLOCKS[id(mask)] = (mask, mask._version, shape, bm)  # the entry keeps the mask (and its id) alive
    return bm


def _block_mask(mask, causal: bool, batch: int, q_len: int, kv_len: int, window, device):
    if mask is not None:
        return tensor_block_mask(mask, batch, kv_len)
    return causal_block_mask(q_len, kv_len, window, device) if causal else None


_PLAIN: dict = {}  # id(mask) -> (the mask, its version, L, S, window, verdict)


def is_plain_causal(mask: torch.Tensor, q_len: int, kv_len: int, window: int | None) -> bool:
    """Is transformers' boolean mask just causal (and windowed) for queries at positions 0..L-1, every
    batch row alike (no padding)? One device sync per mask object, shared by the layers of a forward."""
    if q_len > kv_len:
        return False
    entry = _PLAIN.get(id(mask))
    sig = (q_len, kv_len, window)
    if entry is not None and entry[0] is mask and entry[1] == mask._version and entry[2] == sig:
        return entry[3]
    q_idx = torch.arange(q_len, device=mask.device)[:, None]
    kv_idx = torch.arange(kv_len, device=mask.device)[None, :]
    want = q_idx >= kv_idx
    if window is not None:
        want = want & (q_idx - kv_idx < window)
    verdict = bool((mask[:, 0, :, :kv_len] == want).all())
    if len(_PLAIN) >= _TENSOR_BLOCKS_MAX:  # one forward's masks (Gemma-2 alternates two) at a time
        _PLAIN.clear()
    _PLAIN[id(mask)] = (mask, mask._version, sig, verdict)  # the entry keeps its mask (and id) alive
    return verdict


# ---- the call -----------------------------------------------------------------------------------
_compiled_cache: list = []
_warm: set = set()  # call signatures that ran (compiled) outside a capture
_failed: dict = {}  # call signature -> why it fell back


def compiled():
    """flex_attention compiled once (inductor; guards reuse it per shape, dynamic after a second one)."""
    if not _compiled_cache:
        _compiled_cache.append(torch.compile(flex_attention, fullgraph=True))
    return _compiled_cache[0]


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, dropout: float) -> bool:
    """Whether this call is one for flex (prefill-sized, supported shapes and mask); cheap, trace-safe."""
    if _MISSING or query.device.type not in FUSED_DEVICES or not _device.triton_installed():
        return False
    L, D = query.shape[2], query.shape[3]
    if L < FLEX_MIN_Q or dropout or query.dtype not in DTYPES or D not in HEAD_DIMS:
        return False
    if key.shape[3] != D or value.shape[3] != D or query.shape[1] % key.shape[1]:
        return False
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != L:
            return False
        if mask.shape[0] not in (1, query.shape[0]) or mask.shape[3] < key.shape[2]:
            return False
    return True


def attention(query, key, value, mask, *, scaling, softcap, window, causal) -> torch.Tensor | None:
    """softmax(softcap(q k^T * scaling) + mask) v as [B, L, Hq, D], or None where flex does not run it.

    query [B, Hq, L, D], key/value [B, Hkv, S, D]; mask: transformers' boolean [B|1, 1, L, >=S] mask or
    None, then `causal` (keys already cropped to L by the caller) or full attention; window: the
    layer's sliding window, applied when no mask is given. Check `takes()` first.
    """
    if torch.compiler.is_compiling():  # checked first: building a score function is not traceable
        # Inside the user's torch.compile the caller's tier runs: mask-free softcapped prefill the Triton
        # kernel (models/attention.py), masked calls the eager tier, fused by inductor. Measured on the H100
        # (Gemma-2-9B, 4 layers, prefill 2048): flex inlined failed to lower with transformers' mask (a
        # graph intermediate: "convert FlexibleLayout to FixedLayout first"), and flex run eagerly at
        # a graph break made the compiled prefill 9.40 ms against 7.62 ms for the inductor-fused eager tier.
        # Flex inlined for the mask-free (causal) calls did lower once the softcap and window were
        # constants in code, but measured no better: 8.05 vs 8.13 ms (compiled stock, softcap dropped: 7.57).
        return None
    B, L, S = query.shape[0], query.shape[2], key.shape[2]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    kwargs = {"score_mod": score_mod(softcap), "scale": scaling, "enable_gqa": query.shape[1] != key.shape[1]}
    if KERNEL_OPTIONS:
        kwargs["kernel_options"] = KERNEL_OPTIONS
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    if mask is not None and not capturing and is_plain_causal(mask, L, S, window):
        # No padding, queries from position 0: the causal block mask over the first L keys, which
        # compiles where a captured mask tensor did not (torch 2.11 inductor, H100).
        key, value, mask, causal, S = key[:, :, :L], value[:, :, :L], None, True, L
    sig = (tuple(query.shape), tuple(key.shape), query.dtype, query.device, softcap, window, causal, mask is None)
    if sig in _failed:
        return None
    if capturing and (sig not in _warm or mask is not None):
        return None  # nothing is compiled or built inside a capture
    bm = _block_mask(mask, causal, B, L, S, window, query.device)
    if sig in _warm:
        return compiled()(query, key, value, block_mask=bm, **kwargs).transpose(1, 2)
    try:
        out = compiled()(query, key, value, block_mask=bm, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the caller's tier runs
        _failed[sig] = f"{type(exc).__name__}: {exc}"
        log.warning("gemmtune: flex_attention failed for q %s, kv %s (%s); the eager tier runs these calls",
                    tuple(query.shape), tuple(key.shape), _failed[sig])  # fmt: skip
        return None
    _warm.add(sig)
    return out.transpose(1, 2)
