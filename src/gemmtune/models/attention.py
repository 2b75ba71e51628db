"""Attention routing through transformers' AttentionInterface and AttentionMaskInterface.

Five tiers, each registered under its own name (neutral names: transformers treats names containing
"flash"/"sdpa" specially in places):
  tier 1 "flash": flash-attn's flash_attn_func (aiter's on ROCm) when installed, for fp16/bf16 CUDA
                  tensors with no materialized mask; anything else drops to tier 2 for that call.
  "triton":       gemmtune's Triton flash-attention kernel (ops/attention.py: softcap, causal, sliding
                  window, GQA, transformers' boolean mask; one custom op under torch.compile) for
                  prefill-sized (>= KERNEL_MIN_Q query tokens) fp16/bf16 calls on NVIDIA CUDA, eager
                  and compiled (KERNEL_MASKED: masked softcapped calls too). Softcapped calls it does
                  not take run as the flex tier runs them, others as tier 2. auto picks it for
                  softcapped models (Gemma-2) when flash-attn cannot take them.
  "flex":         torch's flex_attention (models/flex.py) for prefill-sized calls (>= flex.FLEX_MIN_Q
                  query tokens) on CUDA in eager code: softcap, causal / sliding-window / padding masks,
                  GQA in one compiled kernel; shorter calls run as tier 2 does. Under torch.compile flex
                  is not called: mask-free softcapped prefill takes the Triton kernel, the rest as tier 2.
  tier 2 "sdpa":  torch's scaled_dot_product_attention. GQA without repeat_kv: `enable_gqa` where
                  torch picks a fused kernel with it (no mask); decode (<= 16 query tokens) with
                  transformers' boolean mask (static cache, padding), or one token without one, runs
                  gemmtune's split-KV decode kernel in eager code on NVIDIA CUDA (DECODE_KERNEL), else
                  the measured-fastest SDPA strategy (MASKED_DECODE).
                  softcap, which SDPA cannot compute, goes to the Triton kernel (prefill; masked too
                  with KERNEL_MASKED, else flex in eager code), else (and output_attentions) to tier 3.
                  Masked prefill without softcap: the Triton kernel (MASKED_PREFILL, the default) or
                  SDPA with the mask.
  tier 3 "eager": matmul-softmax-matmul in the model's dtype with fp32 softmax, grouped by KV head
                  (no repeat_kv), with softcap and attention weights.
All use transformers' `sdpa_mask` (a boolean 4-D mask, or None for a plain causal / full pattern), so a
call can drop to a lower tier with the mask it was given; the triton tier's also returns None under
torch.compile where sdpa_mask does so eagerly (transformers materializes it while tracing: triton_mask).
GEMMTUNE_ATTENTION=flash|triton|flex|sdpa|eager forces a tier (it wins over optimize(attention=...)).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .. import device as _device
from .. import settings
from ..kernels import attention_softcap as kattn
from ..kernels import decode_attention as kdecode
from ..kernels._common import ArrivalCounters
from ..ops import attention as attn_ops
from . import flex

TIERS = settings.ATTENTION.parse.modes  # flash, triton, flex, sdpa, eager
ENV = settings.ATTENTION.name
NAMES = {
    "flash": "gemmtune_tier1", "triton": "gemmtune_tier_triton", "flex": "gemmtune_tier_flex",
    "sdpa": "gemmtune_tier2", "eager": "gemmtune_tier3",
}  # fmt: skip
# The Triton kernel takes prefill-sized calls only: decode (up to 16 query tokens) keeps the measured
# eager / SDPA decode paths, and no kernel is compiled for it during a decode capture.
KERNEL_MIN_Q = flex.FLEX_MIN_Q
KERNEL_DEVICES = ("cuda",)  # NVIDIA: its tanh is PTX, its tiles measured on an H100
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# Softcapped prefill with transformers' boolean mask (padding; and under torch.compile, where transformers
# materializes even the plain causal mask, every prefill) runs the kernel with the mask: a first pass finds
# the key blocks it hides, so a causal mask costs about what the mask-free causal kernel does (H100,
# Gemma-2 1x2048: 113.2 vs 98.1 us). Masked calls of models without softcap: MASKED_PREFILL.
KERNEL_MASKED = True
# Prefill of models without softcap that carry transformers' boolean mask (padding; under torch.compile,
# where transformers materializes even the plain causal mask, every prefill): "triton" (the default) runs
# gemmtune's kernel with the mask (bf16 / fp16 on NVIDIA CUDA, head dims MASKED_PREFILL_MIN_D..256,
# >= KERNEL_MIN_Q queries, no dropout, no attention weights); "sdpa" keeps SDPA-with-mask, which cannot
# use the flash kernel. Measured on an H100 at Llama-3-8B shapes (1x2048, causal mask): 103.5 us vs
# SDPA-with-mask 288.1 us (benchmarks/results/h100/softcap_attention/bench_attention_softcap.md).
# GEMMTUNE_MASKED_PREFILL=triton|sdpa picks; set_masked_prefill for benchmarks.
MASKED_PREFILL_MODES = settings.MASKED_PREFILL.parse.modes  # sdpa, triton
MASKED_PREFILL_MIN_D = 64
PACK_MAX_Q = 16  # fold query heads into rows up to this many query tokens (decode, speculation)
# GQA decode against a materialized mask (static cache, padding), L <= PACK_MAX_Q query tokens:
#   "gqa": enable_gqa with the mask (no copy; torch picks the backend);
#   "fold": the query heads of a KV group become rows of one [B, Hkv, n_rep*L, D] query (no copy);
#   "fold_efficient": the same, forced onto the memory-efficient kernel; "repeat": repeat_kv copies.
# On an H100 with torch 2.11, one CUDA-graph decode step of a 4-layer Llama-3-8B took 1.213 / 1.296 /
# 1.393 / 1.350 ms at batch 1 and 1.286 / 1.385 / 1.431 / 2.057 ms at batch 8 in that order
# (benchmarks/results/h100/e2e_llama_decode/llama-3-8b_default_dispatch.md). Older torch may run
# enable_gqa-with-mask on the math kernel, so it folds; GEMMTUNE_SDPA_DECODE overrides.
MASKED_DECODE_MODES = settings.SDPA_DECODE.parse.modes  # gqa, fold, fold_efficient, repeat
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_HAS_ENABLE_GQA = _TORCH >= (2, 5)


def _default_masked_decode() -> str:
    mode = settings.SDPA_DECODE.get()
    if mode:
        return mode
    return "gqa" if _TORCH >= (2, 11) and not _device.is_rocm() else "fold"


MASKED_DECODE = _default_masked_decode()
# Decode (<= kernels/decode_attention.MAX_Q query tokens) with transformers' boolean mask, or one token
# without one, in eager code on NVIDIA CUDA: "triton" (the default) runs gemmtune's split-KV decode kernel,
# one launch where SDPA with the mask makes four or five; "sdpa" keeps MASKED_DECODE's paths. On an H100
# (4-layer CUDA-graph decode step, ctx 1024, A/B in one session): Llama-3-8B b=1 1.190 -> 1.185 ms, b=8
# 1.256 -> 1.250 ms; Qwen3-30B-A3B b=1 0.618 -> 0.616 ms, b=8 1.242 -> 1.230 ms
# (benchmarks/results/h100/bench_model_default_dispatch/README.md).
# GEMMTUNE_DECODE_ATTENTION=triton|sdpa picks. The kernel's arrival counters live per attention module
# (one call of a module at a time, as the layers of a forward run).
DECODE_KERNEL_MODES = settings.DECODE_ATTENTION.parse.modes  # sdpa, triton
DECODE_KERNEL = settings.DECODE_ATTENTION.get()
DECODE_VENDORS = (_device.NVIDIA,)  # measured there; ROCm keeps SDPA
_decode_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


MASKED_PREFILL = settings.MASKED_PREFILL.get()

_flash_cache: list = []


def flash_backend():
    """(name, flash_attn_func) for flash-attn or aiter, else None (looked up once)."""
    if not _flash_cache:
        found = None
        try:
            from flash_attn import flash_attn_func

            found = ("flash_attn", flash_attn_func)
        except Exception:  # noqa: BLE001 - a broken install is the same as none
            try:
                from aiter import flash_attn_func

                found = ("aiter", flash_attn_func)
            except Exception:  # noqa: BLE001
                found = None
        _flash_cache.append(found)
    return _flash_cache[0]


def kernel_unavailable_reason(device) -> str | None:
    """None when gemmtune's Triton attention kernel runs on `device`, else why not (for the report)."""
    if not _device.triton_installed():
        return "triton is not installed"
    kind = torch.device(device).type
    if kind not in KERNEL_DEVICES:
        return f"gemmtune's Triton attention runs on NVIDIA CUDA only (model on {kind})"
    if kind == "cuda" and _device.is_rocm():
        return "gemmtune's Triton attention is not measured on ROCm"
    return None


def resolve_tier(requested: str | None, softcap: float | None = None, device=None) -> tuple[str | None, str]:
    """(tier or None to leave attention alone, note for the report) for a model whose attention has
    logit softcapping `softcap` (None: none) and whose weights are on `device`."""
    env = settings.ATTENTION.get()
    if env:
        requested, note = env, f"forced by {ENV}={env}"
    else:
        note = ""
    if requested is None or requested == "off":
        return None, "attention left as is (attention=None)"
    if device is None:
        device = _device.default_device()
    cuda = torch.device(device).type == "cuda"
    fb = flash_backend()
    no_flex = flex.unavailable_reason(device)
    no_kernel = kernel_unavailable_reason(device)
    if requested == "auto":
        if fb is not None and cuda and (softcap is None or fb[0] == "flash_attn"):
            tier, note = "flash", note or "auto"
        elif softcap is None:
            return "sdpa", note or "auto"
        else:
            why = "flash-attn not installed" if fb is None else "model not on CUDA"
            why = f"{fb[0]} has no softcap" if fb is not None and cuda else why
            if no_kernel is None:
                tier, note = "triton", f"auto: softcap {softcap}, {why}"
            elif no_flex is None:
                tier, note = "flex", f"auto: softcap {softcap}, {why}; no Triton tier: {no_kernel}"
            else:
                return "eager", f"auto: softcap {softcap}, {why}; no Triton or flex tier: {no_flex}"
    else:
        if requested not in TIERS:
            raise ValueError(f"attention={requested!r}: expected 'auto', None or one of {', '.join(TIERS)}")
        if requested == "flash" and fb is None:
            raise ValueError("attention tier 'flash' needs flash-attn (CUDA) or aiter (ROCm); neither is installed")
        if requested == "flex" and no_flex is not None:
            raise ValueError(f"attention tier 'flex' is not available: {no_flex}")
        if requested == "triton" and no_kernel is not None:
            raise ValueError(f"attention tier 'triton' is not available: {no_kernel}")
        tier, note = requested, note or "requested"
    if MASKED_PREFILL == "triton" and no_kernel is None and tier != "eager":
        note += "; masked prefill without softcap runs the Triton kernel (GEMMTUNE_MASKED_PREFILL=triton)"
    if softcap is not None and tier in ("flash", "sdpa"):
        # flash falls to sdpa for masks (and aiter has no softcap); sdpa hands softcap calls on
        note += f"; softcap {softcap}: calls SDPA cannot run go to {_softcap_route(no_kernel, no_flex)}"
    elif tier in ("triton", "flex"):
        note += _other_calls(tier, softcap, no_kernel, no_flex)
    return tier, note


def _softcap_route(no_kernel: str | None, no_flex: str | None) -> str:
    """Where the sdpa tier sends softcapped calls, given what runs here."""
    if no_kernel is None and KERNEL_MASKED:
        return "the Triton kernel for prefill (with or without a mask), the eager tier otherwise"
    if no_kernel is None and no_flex is None:
        return "the Triton kernel for mask-free prefill, flex_attention for masked prefill, the eager tier otherwise"
    if no_kernel is None:
        return "the Triton kernel for mask-free prefill, the eager tier otherwise"
    if no_flex is None:
        return "flex_attention for prefill, the eager tier otherwise"
    return "the eager tier"


def _other_calls(tier: str, softcap: float | None, no_kernel: str | None, no_flex: str | None) -> str:
    """The report's note on the calls the triton / flex tier does not take itself."""
    rest = "eager" if softcap is not None else "sdpa"
    min_q = KERNEL_MIN_Q if tier == "triton" else flex.FLEX_MIN_Q
    short = f"calls of < {min_q} query tokens (decode) run the {rest} tier"
    if tier == "triton":
        if softcap is not None and KERNEL_MASKED:
            masked = "the Triton kernel with the mask"
        elif softcap is not None and no_flex is None:
            masked = "flex_attention"
        elif softcap is None and MASKED_PREFILL == "triton":
            masked = "the Triton kernel with the mask (MASKED_PREFILL)"
        else:
            masked = f"the {rest} tier"
        return f"; masked prefill runs {masked}, {short}"
    compiled = ""
    if softcap is not None and no_kernel is None:
        compiled = "; under torch.compile, mask-free prefill runs the Triton kernel"
    return f"; {short}{compiled}"


# ---- helpers ------------------------------------------------------------------------------------
def _causal(module, is_causal) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def _repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _group_mask(mask: torch.Tensor, n_kv: int, n_rep: int, q_len: int) -> torch.Tensor:
    """A [b, 1|Hq, L, S] mask laid out for queries folded to [B, Hkv, n_rep * L, D]."""
    if mask.dim() == 2:
        mask = mask[None, None]
    b, h, _, s = mask.shape
    if h == 1:
        if q_len == 1:
            return mask  # [b, 1, 1, S] broadcasts over the folded rows
        return mask[:, :, None].expand(b, 1, n_rep, q_len, s).reshape(b, 1, n_rep * q_len, s)
    return mask.reshape(b, n_kv, n_rep * q_len, s)


def _efficient_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def set_masked_decode(mode: str) -> None:
    """Pick the masked-decode strategy (see MASKED_DECODE_MODES); for benchmarks and tuning."""
    global MASKED_DECODE
    if mode not in MASKED_DECODE_MODES:
        raise ValueError(f"masked decode mode {mode!r}: expected one of {', '.join(MASKED_DECODE_MODES)}")
    MASKED_DECODE = mode
    settings.api_called("set_masked_decode")


def set_decode_kernel(mode: str) -> None:
    """Pick the decode path (see DECODE_KERNEL_MODES); for benchmarks."""
    global DECODE_KERNEL
    if mode not in DECODE_KERNEL_MODES:
        raise ValueError(f"decode attention mode {mode!r}: expected one of {', '.join(DECODE_KERNEL_MODES)}")
    DECODE_KERNEL = mode
    settings.api_called("set_decode_kernel")


def set_masked_prefill(mode: str) -> None:
    """Pick what runs masked prefill of models without softcap (see MASKED_PREFILL_MODES)."""
    global MASKED_PREFILL
    if mode not in MASKED_PREFILL_MODES:
        raise ValueError(f"masked prefill mode {mode!r}: expected one of {', '.join(MASKED_PREFILL_MODES)}")
    MASKED_PREFILL = mode
    settings.api_called("set_masked_prefill")


def _crop(key, value, q_len):
    # Mask-free causal with keys past the queries only happens on an empty static cache (the tail is
    # unwritten): transformers' sdpa path crops the same way so the upper-left causal mask is right.
    if key.shape[2] > q_len:
        return key[:, :, :q_len], value[:, :, :q_len]
    return key, value


# ---- tier 3 -------------------------------------------------------------------------------------
def eager_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, softcap=None, **kwargs
):
    B, Hq, L, D = query.shape
    Hkv = key.shape[1]
    n_rep = Hq // Hkv
    scaling = D**-0.5 if scaling is None else scaling
    mask = attention_mask
    if mask is None and _causal(module, is_causal) and L > 1:
        key, value = _crop(key, value, L)
        mask = torch.ones(L, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - L)
    S = key.shape[2]
    # Group the query heads of each KV head into rows: one matmul per KV head, no repeat_kv copy.
    qg = query.reshape(B, Hkv, n_rep * L, D)
    w = torch.matmul(qg, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.where(mask, torch.zeros((), dtype=w.dtype, device=w.device), torch.finfo(w.dtype).min)
        mask = mask[..., :S] if mask.shape[-1] > S else mask
        w = w + _group_mask(mask, Hkv, n_rep, L)
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = F.dropout(w, p=dropout, training=module.training)
    out = torch.matmul(w, value).view(B, Hq, L, value.shape[-1])
    return out.transpose(1, 2).contiguous(), w.view(B, Hq, L, S)


# ---- flex ---------------------------------------------------------------------------------------
def _try_flex(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """(out, None) from flex_attention where it takes this call, else None. Training keeps the eager
    tier: flex's backward kernels are not checked here."""
    if kwargs.get("output_attentions") or getattr(module, "training", False):
        return None
    if not flex.takes(query, key, value, attention_mask, dropout):
        return None
    causal = attention_mask is None and _causal(module, is_causal)
    if causal:
        key, value = _crop(key, value, query.shape[2])
    out = flex.attention(
        query, key, value, attention_mask, scaling=scaling, softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"), causal=causal,
    )  # fmt: skip
    return None if out is None else (out.contiguous(), None)


def flex_tier(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    done = _try_flex(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if done is not None:
        return done
    return sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


# ---- triton -------------------------------------------------------------------------------------
def _try_kernel(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """(out, None) from gemmtune's Triton kernel where it takes this call, else None: prefill-sized,
    forward only; no mask (plain causal, the layer's sliding window, or full), or transformers' boolean
    mask on a softcapped layer (under torch.compile every prefill gets one; see KERNEL_MASKED)."""
    if not _kernel_takes(module, query, key, value, dropout, kwargs):
        return None
    L = query.shape[2]
    softcap, window, mask = kwargs.get("softcap"), kwargs.get("sliding_window"), attention_mask
    if mask is not None:
        if not _bool_mask_fits(mask, query, key):
            return None
        if _plain_causal_mask(mask, query, key, window):
            mask = None  # eager code, no padding: the mask-free causal kernel over the first L keys
        elif not KERNEL_MASKED or softcap is None:
            return None
        else:  # the mask alone: it carries causality, the window and the true positions
            out = attn_ops.softcap_attention(query, key, value, scaling, softcap, False, None, mask)
            return out, None
    causal = attention_mask is not None or _causal(module, is_causal)
    if causal:
        key, value = _crop(key, value, L)
        if window is not None and window >= key.shape[2]:
            window = None  # no key is that far back
    else:
        window = None
    out = attn_ops.softcap_attention(query, key, value, scaling, softcap, causal, window)
    return out, None


def _kernel_takes(module, query, key, value, dropout, kwargs) -> bool:
    """Shapes, dtypes, devices and modes the Triton kernel computes: prefill-sized, forward only."""
    if dropout or kwargs.get("output_attentions") or getattr(module, "training", False):
        return False
    if query.device.type not in KERNEL_DEVICES or query.dtype not in KERNEL_DTYPES or not _device.triton_installed():
        return False
    L, D = query.shape[2], query.shape[3]
    if L < KERNEL_MIN_Q or D > kattn.MAX_HEAD_DIM or key.shape[3] != D or value.shape != key.shape:
        return False
    if query.shape[1] % key.shape[1] or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    # the kernel has no backward
    return not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))


def _try_masked_prefill(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """(out, None) from the Triton kernel for a masked prefill call of a model without softcap where
    MASKED_PREFILL says so (the mask alone decides: it carries causality, the window, the positions)."""
    if MASKED_PREFILL != "triton" or attention_mask is None or query.shape[-1] < MASKED_PREFILL_MIN_D:
        return None
    if not _kernel_takes(module, query, key, value, dropout, kwargs):
        return None
    if not _bool_mask_fits(attention_mask, query, key):
        return None
    return attn_ops.softcap_attention(query, key, value, scaling, None, False, None, attention_mask), None


def _try_decode_kernel(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """(out, None) from the decode kernel (kernels/decode_attention.py) for a call of <= its MAX_Q query
    tokens where DECODE_KERNEL says so: transformers' boolean mask, or one token and no mask (it sees
    every key); eager code on NVIDIA CUDA in fp16 / bf16, forward only."""
    if DECODE_KERNEL != "triton" or torch.compiler.is_compiling() or query.shape[2] > kdecode.MAX_Q:
        return None
    if attention_mask is None and query.shape[2] != 1:
        return None
    if dropout or kwargs.get("output_attentions") or getattr(module, "training", False):
        return None
    if _device.vendor(query.device) not in DECODE_VENDORS or query.dtype not in KERNEL_DTYPES:
        return None
    if not _device.triton_installed() or kdecode.takes(query, key, value, attention_mask):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    counters = _decode_counters.get(module)
    if counters is None:
        counters = _decode_counters[module] = ArrivalCounters()
    arrivals = counters.get(query.shape[0] * key.shape[1], query.device)
    return kdecode.decode_attention(query, key, value, attention_mask, scale, arrivals, check=False), None


def _bool_mask_fits(mask, query, key) -> bool:
    """transformers' boolean [B|1, 1, L, >=S] mask (per-head and additive masks are not taken)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return False
    L, S = query.shape[2], key.shape[2]
    return mask.shape[0] in (1, query.shape[0]) and mask.shape[1] == 1 and mask.shape[2] == L and mask.shape[3] >= S


def _plain_causal_mask(mask, query, key, window) -> bool:
    """In eager code: is the mask plain causal (windowed) over the first L keys, no padding? (Prompts
    past Gemma-2's sliding window get one.) One device sync per mask object, shared by the layers."""
    if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    L, S = query.shape[2], key.shape[2]
    return L <= S and flex.is_plain_causal(mask, L, S, window)


def triton_tier(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    done = _try_kernel(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if done is not None:
        return done
    if kwargs.get("softcap") is not None:  # masked prefill through flex (eager code), the rest eager
        return flex_tier(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    return sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


# ---- tier 2 -------------------------------------------------------------------------------------
def sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        # what SDPA cannot compute: softcapped prefill through the Triton kernel (no mask) or flex
        # (masked, eager code) where they run, the rest eager
        args = (module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        done = _try_kernel(*args) or _try_flex(*args)
        if done is not None:
            return done
        return eager_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    done = _try_masked_prefill(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if done is None:
        done = _try_decode_kernel(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if done is not None:
        return done
    B, Hq, L, D = query.shape
    Hkv = key.shape[1]
    n_rep = Hq // Hkv
    mask = attention_mask
    use_causal = mask is None and L > 1 and _causal(module, is_causal)
    if use_causal:
        key, value = _crop(key, value, L)
    # Decode with a materialized mask (static caches, padded batches): see MASKED_DECODE.
    if n_rep > 1 and not use_causal and L <= PACK_MAX_Q and (mask is not None or not _HAS_ENABLE_GQA):
        mode = MASKED_DECODE if mask is not None else "fold"
        if mode == "fold" or mode == "fold_efficient":
            qg = query.reshape(B, Hkv, n_rep * L, D)
            gm = None if mask is None else _group_mask(mask, Hkv, n_rep, L)
            if mode == "fold_efficient" and query.is_cuda:
                with _efficient_only():
                    out = F.scaled_dot_product_attention(qg, key, value, attn_mask=gm, dropout_p=dropout, scale=scaling)
            else:
                out = F.scaled_dot_product_attention(qg, key, value, attn_mask=gm, dropout_p=dropout, scale=scaling)
            out = out.reshape(B, Hq, L, value.shape[-1])  # kernels may return other strides
            return out.transpose(1, 2).contiguous(), None
        if mode == "gqa" and _HAS_ENABLE_GQA:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
            return out.transpose(1, 2).contiguous(), None
        # "repeat": per-head queries against repeated keys (transformers 5.17's choice)
    extra = {}
    if n_rep > 1:
        # CUDA's fused kernels take enable_gqa only without a mask; with one, repeat (as transformers does).
        if _HAS_ENABLE_GQA and (mask is None or not query.is_cuda):
            extra["enable_gqa"] = True
        else:
            key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=use_causal, **extra
    )
    return out.transpose(1, 2).contiguous(), None


# ---- tier 1 -------------------------------------------------------------------------------------
def flash_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, softcap=None, **kwargs
):
    fb = flash_backend()
    if (
        fb is None
        or attention_mask is not None
        or not query.is_cuda
        or query.dtype not in (torch.float16, torch.bfloat16)
        or query.shape[-1] > 256
        or key.shape[-1] != value.shape[-1]
        or kwargs.get("output_attentions")
        or (softcap is not None and fb[0] != "flash_attn")
    ):
        return sdpa_attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap=softcap, **kwargs
        )
    name, fn = fb
    L = query.shape[2]
    causal = L > 1 and _causal(module, is_causal)
    if causal:
        key, value = _crop(key, value, L)
    extra = {"softcap": softcap} if softcap is not None else {}
    # flash_attn takes [B, S, H, D] and does GQA itself; for L == 1 causal=False is the right mask.
    out = fn(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        dropout_p=dropout, softmax_scale=scaling, causal=causal, **extra,
    )  # fmt: skip
    if isinstance(out, tuple):
        out = out[0]
    return out, None


def _compiled_mask_skip(kw: dict) -> bool:
    """While torch.compile traces, transformers (with torch < 2.14) always materializes the causal mask,
    even where it returns None eagerly: skip it in those cases (no padding mask, queries = keys, a
    local window longer than the keys), decided from shapes only, so compiled prefill reaches the kernel."""
    if not torch.compiler.is_compiling() or not kw.get("allow_is_causal_skip", True):
        return False
    if kw.get("attention_mask") is not None or "q_length" not in kw or "kv_length" not in kw:
        return False
    q_len, kv_len, local = kw["q_length"], kw["kv_length"], kw.get("local_size")
    if local is not None and kv_len >= local:
        return False
    return q_len >= KERNEL_MIN_Q and kv_len == q_len


def triton_mask(*args, **kwargs):
    """The triton tier's mask function: transformers' sdpa_mask, None where _compiled_mask_skip says so."""
    from transformers.masking_utils import sdpa_mask

    if not args and _compiled_mask_skip(kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


TIER_FUNCTIONS = {
    "flash": flash_attention, "triton": triton_tier, "flex": flex_tier, "sdpa": sdpa_attention,
    "eager": eager_attention,
}  # fmt: skip
_registered: list[bool] = []


class Registration:
    """Held by an optimized model: unpickling it registers the tiers in the loading process, so a
    torch.load'ed model finds the attention function its config names."""

    def __reduce__(self):
        return registration, ()


def registration() -> Registration:
    """register(), and the token an optimized model keeps."""
    register()
    return Registration()


def register() -> None:
    """Add the tiers (and their mask function) to transformers' global interfaces, once."""
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for tier, fn in TIER_FUNCTIONS.items():
        AttentionInterface.register(NAMES[tier], fn)
        AttentionMaskInterface.register(NAMES[tier], triton_mask if tier == "triton" else sdpa_mask)
    _registered.append(True)
