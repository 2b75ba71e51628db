"""What a unit of profiled time is: GEMM, attention, elementwise/norm, memory copy or other.

A kernel (or, on the CPU, an op's self time) is categorized by what launched it: the chain of
profiler frames around its launch, innermost first (aten::addmm inside aten::linear inside
gemmtune.gemm ...). Attention anywhere in the chain wins (SDPA's math path runs bmm and softmax);
otherwise the innermost frame with a known meaning decides. Only a kernel without a known launch
site (CUDA-graph replays, Triton kernels launched from Python, inductor's generated kernels) falls
back to its name: the names inductor, cuBLAS/CUTLASS, flash-attn and gemmtune give their kernels.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..ops.registry import gemm_custom_ops

CATEGORIES = ("gemm", "attention", "elementwise", "memory", "other", "idle")
LABELS = {
    "gemm": "GEMM",
    "attention": "attention",
    "elementwise": "elementwise / norm",
    "memory": "memory copies",
    "other": "other",
}
IDLE_LABEL = {
    "cuda": "idle (launch gaps, host)",  # GPU idle inside the profiled steps
    "cpu": "host (outside ops)",  # Python and framework time between ops
}


def label(category: str, mode: str) -> str:
    return IDLE_LABEL[mode] if category == "idle" else LABELS[category]


@dataclass(frozen=True)
class Frame:
    """One CPU-side profiler range: an op (aten::mm, gemmtune::rmsnorm) or a user annotation."""

    name: str
    shapes: tuple = ()
    dtypes: tuple = ()


# ---- op names -----------------------------------------------------------------------------------
# torch's GEMMs and gemmtune's GEMM custom ops, as the op modules declare them (ops/registry.py)
GEMM_OPS = frozenset(
    f"aten::{n}"
    for n in (
        "mm", "addmm", "linear", "matmul", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot",
        "_scaled_mm", "_int_mm", "_addmm_activation", "_grouped_mm", "_scaled_grouped_mm",
    )
) | gemm_custom_ops()  # fmt: skip
GEMM_ANNOTATION = "gemmtune.gemm"  # profiling.gemms wraps eager gemmtune.gemm calls in this range
MEMORY_OPS = frozenset(
    f"aten::{n}"
    for n in (
        "copy_", "clone", "contiguous", "cat", "stack", "index_copy_", "index_copy", "index_put_",
        "index_put", "_index_put_impl_", "fill_", "zero_", "zeros", "zeros_like", "ones", "full", "repeat",
        "repeat_interleave", "slice_scatter", "select_scatter", "narrow_copy", "embedding", "index_select",
        "gather", "scatter_", "masked_scatter_", "constant_pad_nd", "pad",
    )
)  # fmt: skip
CAST_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::type_as"})  # dtype conversions: elementwise
_ELEMENTWISE = re.compile(
    r"^(add|sub|rsub|mul|div|neg|pow|rsqrt|sqrt|exp|exp2|log|log1p|tanh|sigmoid|silu|gelu|relu|softplus|"
    r"softmax|_softmax|log_softmax|_log_softmax|mean|sum|var|std|var_mean|norm|linalg_vector_norm|rms_norm|"
    r"_fused_rms_norm|layer_norm|native_layer_norm|group_norm|where|masked_fill|clamp|clamp_min|clamp_max|"
    r"abs|cos|sin|reciprocal|erf|maximum|minimum|max|min|amax|amin|argmax|argmin|cumsum|eq|ne|lt|gt|le|ge|"
    r"logical_\w+|bitwise_\w+|triu|tril|arange|lerp|addcmul|addcdiv|sign|round|floor|ceil|square|"
    r"any|all|isnan|isinf|nan_to_num|dropout|native_dropout|_softmax_backward_data|threshold_backward|"
    r"silu_backward|gelu_backward|mish|hardtanh|leaky_relu|elu|glu|diff)_?$"
)  # fmt: skip
# Ops that only make views or read metadata: no kernel, only dispatcher time (host time on the CPU
# unless a categorized op around them owns it).
METADATA_OPS = frozenset(
    f"aten::{n}"
    for n in (
        "view", "reshape", "_reshape_alias", "as_strided", "transpose", "t", "permute", "expand", "expand_as",
        "slice", "select", "narrow", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "alias",
        "unflatten", "flatten", "detach", "lift_fresh", "_unsafe_view", "unbind", "movedim", "empty",
        "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "item", "_local_scalar_dense",
        "is_nonzero", "view_as", "numpy_T", "set_", "result_type", "_has_compatible_shallow_copy_type",
    )
)  # fmt: skip
# gemmtune's fused elementwise ops (custom ops under torch.compile)
GEMMTUNE_ELEMENTWISE_OPS = frozenset(
    {"gemmtune::rmsnorm", "gemmtune::add_rmsnorm", "gemmtune::act_mul", "gemmtune::rope"}
)
_ATTENTION_OP = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flash_attn|"
                           r"flex_attention|fmha|paged_attention|aiter::.*attn|mha_(fwd|bwd|varlen)", re.I)  # fmt: skip


def _is_batched_product(f: Frame) -> bool:
    """torch.matmul of two [batch, heads, L, D] activations (q @ k^T, p @ v): eager attention."""
    s = f.shapes
    return f.name == "aten::matmul" and len(s) >= 2 and len(s[0]) >= 4 and len(s[1]) >= 4


def frame_category(f: Frame, parent: Frame | None = None) -> str | None:
    """The category a frame's name gives its work, or None when the name says nothing."""
    n = f.name
    if _ATTENTION_OP.search(n) or _is_batched_product(f):
        return "attention"
    if n in GEMM_OPS or n.startswith(GEMM_ANNOTATION):
        return "gemm"
    if n in GEMMTUNE_ELEMENTWISE_OPS or n in CAST_OPS:
        return "elementwise"
    if n == "aten::copy_" and parent is not None and parent.name in CAST_OPS:
        return "elementwise"
    if n in MEMORY_OPS:
        return "memory"
    if n.startswith("aten::") and _ELEMENTWISE.match(n[6:]):
        return "elementwise"
    return None


def chain_category(chain: Sequence[Frame]) -> str | None:
    """Category of work launched inside `chain` (innermost frame first); None if no frame tells."""
    for f in chain:
        if _ATTENTION_OP.search(f.name) or _is_batched_product(f):
            return "attention"
    for i, f in enumerate(chain):
        cat = frame_category(f, chain[i + 1] if i + 1 < len(chain) else None)
        if cat is not None:
            return cat
    return None


# ---- kernel names -------------------------------------------------------------------------------
GEMMTUNE_KERNELS = {
    "_skinny_kernel": "gemm",
    "_splitk_reduce_kernel": "gemm",
    "_tg_kernel": "gemm",
    "_tg_reduce": "gemm",
    "_rmsnorm_kernel": "elementwise",
    "_act_mul_kernel": "elementwise",
    "_rmsnorm_quant_kernel": "elementwise",
    "_act_mul_quant_token_kernel": "elementwise",
    "_act_mul_quant_group_kernel": "elementwise",
    "_rope_kernel": "elementwise",
    "_qk_norm_rope_kernel": "elementwise",
}
_INDUCTOR = re.compile(r"^triton_(poi|red|per|tem|for|mm|bmm)_(fused_)?(.*?)(_\d+)?$")
_COPY_PARTS = re.compile(r"^((clone|cat|copy|index_copy|index_put|slice_scatter|select_scatter|stack|"
                         r"constant_pad_nd|embedding|index|gather|scatter|zeros|full|fill)_?)+$")  # fmt: skip
_NAME_RULES = (
    ("memory", re.compile(r"^(Memcpy|Memset|memcpy|memset)|CatArrayBatchedCopy|index_copy|copy_kernel|fill_kernel|"
                          r"FillFunctor|indexSelect|index_elementwise_kernel|scatter_gather", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|flex_|softmax_warp_backward", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|matmul|splitk|sm90_|sm80_|sm100_|ampere_|hopper_|"
                        r"_mm_|wgmma|Kernel2|dot_kernel", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce_kernel|norm|softmax|unrolled|act_and_mul|rope|"
                               r"rotary|silu|gelu|activation|cast|where|pointwise", re.I)),
)  # fmt: skip


def kernel_name_category(name: str) -> str | None:
    """Category from a kernel's name alone (the fallback); None when the name is not recognized."""
    if name in GEMMTUNE_KERNELS:
        return GEMMTUNE_KERNELS[name]
    m = _INDUCTOR.match(name)
    if m:
        kind, body = m.group(1), m.group(3)
        if kind in ("tem", "mm", "bmm"):  # inductor's Triton templates: GEMMs and flex attention
            return "attention" if "attention" in body else "gemm"
        if "attention" in body or "sdpa" in body:
            return "attention"
        return "memory" if _COPY_PARTS.match(body) else "elementwise"
    for cat, rx in _NAME_RULES:
        if rx.search(name):
            return cat
    return None
