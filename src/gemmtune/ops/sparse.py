"""`gemmtune.sparse_gemm(input, weight, sparsity_pattern, bias=None)`: y[..., N] = input[..., K] @ W^T
(+ bias) for a sparse weight W [N, K] (nn.Linear layout), dispatched per key of the sparse family
(families/sparse.py: shape, pattern, density bucket, block, dtype, bias) to its tuned solution, default
the weight's own format (backends/sparse/pytorch.py).

sparsity_pattern names the weight's storage, which must match it:
- 'csr' / 'coo' / 'bsr' (aiter's 'block'): torch.sparse_csr / sparse_coo / sparse_bsr tensors
  (w.to_sparse_csr(), w.to_sparse(), w.to_sparse_bsr((R, C)));
- '2:4': a SparseSemiStructuredTensor (NVIDIA GPUs; `prune_2_4(w)` makes one from a dense weight).
The output may be a transposed view (torch.sparse computes W @ x^T).

`prune_2_4(weight)` keeps the 2 largest-magnitude values of every 4 along K and reports the relative
error this introduced, ||W - W_2:4|| / ||W||.
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_choice, check_tensor
from ..dispatch import get_dispatcher
from ..families.sparse import ALIASES, LAYOUTS, PATTERNS, SparseKey, density_bucket
from ..quant.semi_structured import describe, is_semi_structured, prune_2_4, semi_structured_reason
from .hot_path import OpCache, custom_op, public_helper, public_op

__all__ = ["normalize_pattern", "prune_2_4", "semi_structured_reason", "sparse_gemm", "validate"]

FAMILY = "sparse"
_FLOATS = FLOAT_DTYPES
_dispatcher = get_dispatcher()


# ---- the op -------------------------------------------------------------------------------------
def _error(msg: str, x, w, bias) -> ValueError:
    return ValueError(f"gemmtune.sparse_gemm: {msg} (input {describe(x)}, weight {describe(w)}, bias {describe(bias)})")


_HOW = {
    "csr": "weight.to_sparse_csr()",
    "coo": "weight.to_sparse()",
    "bsr": "weight.to_sparse_bsr((R, C))",
    "2:4": "gemmtune.prune_2_4(weight)",
}


def normalize_pattern(pattern) -> str:
    p = ALIASES.get(pattern, pattern) if isinstance(pattern, str) else pattern
    if p not in PATTERNS:
        check_choice("sparse_gemm", "sparsity_pattern", pattern, (*PATTERNS, *ALIASES))  # raises naming them
    return p


def validate(x, w, bias, pattern: str) -> None:
    check_tensor("sparse_gemm", "input", x)
    check_tensor("sparse_gemm", "weight", w)
    check_tensor("sparse_gemm", "bias", bias, optional=True)
    if pattern == "2:4":
        if not is_semi_structured(w):
            raise _error(f"sparsity_pattern '2:4' needs a SparseSemiStructuredTensor ({_HOW['2:4']})", x, w, bias)
    elif is_semi_structured(w) or w.layout != LAYOUTS[pattern]:
        raise _error(f"sparsity_pattern {pattern!r} needs a {LAYOUTS[pattern]} weight ({_HOW[pattern]})", x, w, bias)
    elif w.dense_dim() != 0:
        raise _error("hybrid sparse weights (dense dimensions per element) are not supported", x, w, bias)
    if w.dim() != 2:
        raise _error(f"weight must be 2-D [N, K], got {w.dim()}-D", x, w, bias)
    if x.layout != torch.strided or x.dim() < 1:
        raise _error("input must be a dense tensor [..., K]", x, w, bias)
    if x.shape[-1] != w.shape[1]:
        raise _error(f"input[..., K={x.shape[-1]}] does not match weight [N, K={w.shape[1]}]", x, w, bias)
    if x.dtype != w.dtype or x.dtype not in _FLOATS:
        raise _error(
            f"dtypes must match and be float16/bfloat16/float32: input {x.dtype}, weight {w.dtype}", x, w, bias
        )
    if x.device != w.device:
        raise _error(f"device mismatch: input on {x.device}, weight on {w.device}", x, w, bias)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != w.shape[0]:
            raise _error(f"bias must be a 1-D tensor of length N={w.shape[0]}", x, w, bias)
        if bias.dtype != x.dtype or bias.device != x.device:
            raise _error("bias must have the input's dtype and device", x, w, bias)


def _wmeta(w, pattern: str) -> tuple:
    """What of the weight the key depends on, all host-side metadata (no device sync); None for a
    weight that does not match the pattern (the miss then says so)."""
    if pattern == "2:4" or is_semi_structured(w):
        return (type(w),)
    if w.layout != LAYOUTS[pattern]:
        return None
    if pattern == "bsr":
        return (w.layout, w._nnz(), tuple(w.values().shape[-2:]))
    return (w.layout, w._nnz())


def key_of(x, w, bias, pattern: str) -> SparseKey:
    N, K = w.shape
    M = x.numel() // K if K else 0
    block = ""
    if pattern == "2:4":
        density = 0.5
    elif pattern == "bsr":
        r, c = w.values().shape[-2:]
        block = f"{r}x{c}"
        density = w._nnz() * r * c / max(N * K, 1)
    else:
        density = w._nnz() / max(N * K, 1)
    return SparseKey(M, N, K, pattern, density_bucket(density), block, bias is not None, x.dtype)


def _pattern(sparsity_pattern) -> str:
    pattern = ALIASES.get(sparsity_pattern, sparsity_pattern)
    return pattern if pattern in PATTERNS else normalize_pattern(sparsity_pattern)  # raises naming the choices


def _signature(input, weight, sparsity_pattern, bias) -> tuple:
    pattern = _pattern(sparsity_pattern)
    return (input.shape, input.dtype, input.device, weight.shape, weight.dtype, weight.device, pattern,
            _wmeta(weight, pattern), None if bias is None else (bias.shape, bias.dtype, bias.device))  # fmt: skip


def _validate(input, weight, sparsity_pattern, bias) -> None:
    validate(input, weight, bias, normalize_pattern(sparsity_pattern))


def _bind(input, weight, sparsity_pattern, bias):
    key = key_of(input, weight, bias, normalize_pattern(sparsity_pattern))
    out_shape = (*input.shape[:-1], key.N)
    if 0 in (key.M, key.N, key.K):  # nothing to multiply: bias (or zeros) broadcast

        def call(x, w, bias):
            y = x.new_zeros(out_shape)
            return y + bias if bias is not None else y

        return call
    run = _dispatcher.runner_for(key, input.device, family=FAMILY)
    M, K = key.M, key.K

    def call(x, w, bias):
        return run(x.reshape(M, K), w, bias).reshape(out_shape)

    return call


def _fake(input, weight, sparsity_pattern, bias):
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


_cache = OpCache("sparse_gemm", family=FAMILY, validate=_validate, bind=_bind)
_is_compiling = torch.compiler.is_compiling


@public_op(_cache, aiter_names=("sparse_gemm",))
def sparse_gemm(input: torch.Tensor, weight: torch.Tensor, sparsity_pattern: str,
                bias: torch.Tensor | None = None):  # fmt: skip
    """y[..., N] = input[..., K] @ weight^T (+ bias) with weight a sparse [N, K] tensor stored as
    `sparsity_pattern` says ('csr', 'coo', 'block'/'bsr', '2:4'). Runs the tuned solution for this
    (shape, pattern, density, block), else the weight's own format."""
    if _is_compiling():
        return torch.ops.gemmtune.sparse_gemm(input, weight, sparsity_pattern, bias)
    try:
        call = _cache.get(sig := _signature(input, weight, sparsity_pattern, bias))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _cache.reject(input, weight, sparsity_pattern, bias)
        raise
    if call is None:
        call = _cache.miss(sig, input, weight, sparsity_pattern, bias)
    return call(input, weight, bias)


@custom_op(_cache, fake=_fake)
def _sparse_gemm_op(input: torch.Tensor, weight: torch.Tensor, sparsity_pattern: str,
                    bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    # A fresh plain tensor, not the transposed view torch.sparse may give.
    return sparse_gemm(input, weight, sparsity_pattern, bias).contiguous()


public_helper(family=FAMILY)(prune_2_4)
