"""GEMMs with a fused epilogue: y = act(alpha * x @ w^T + beta * C + bias), dispatched per key of the
epilogue family (families/epilogue.py) to its tuned solution, default the unfused torch path.

`gemm_epilogue` is the general op; aiter's names are thin spellings of it:
- gemm_bias(input, weight, bias, transpose_weight=True): weight [N, K] (nn.Linear) or, with
  transpose_weight=False, [K, N];
- gemm_gelu(input, weight, bias=None, approximate="none") / gemm_relu(input, weight, bias=None):
  weight [N, K]; approximate="tanh" is the GELU of gelu_new / gelu_pytorch_tanh;
- cutlass_gemm(a, b, alpha=1.0, beta=0.0, c=None): alpha * a @ b + beta * c with b [K, N].

C broadcasts over the output (..., N) as the full shape, a row (N,), a column (..., 1) or a scalar;
beta == 0 ignores C (as torch.addmm does, NaN in C included). alpha and beta are Python numbers: the key
records only whether they apply, so one tuned row answers every value. Hot path: signature tuple -> one
dict lookup -> call; validation on a miss. Under torch.compile the call goes through the custom op
`torch.ops.gemmtune.gemm_epilogue` (fake impl; autograd by recomputing the unfused composition).
"""

from __future__ import annotations

import math

import torch

from ..backends.epilogue.pytorch import UNFUSED, TorchEpilogueBackend
from ..checks import FLOAT_DTYPES, check_bool, check_choice, check_dtype, check_number, check_tensor
from ..dispatch import get_dispatcher
from ..families.epilogue import ACTS, EpilogueKey, apply_act, expand_c
from .hot_path import OpCache, custom_op, public_op, spelling_of

FAMILY = "epilogue"
_FLOATS = FLOAT_DTYPES
_W_LAYOUTS = ("nk", "kn")
_dispatcher = get_dispatcher()
_grad_enabled = torch.is_grad_enabled


def _d(t) -> str:
    if t is None:
        return "None"
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _error(msg: str, x, w, bias, c) -> ValueError:
    return ValueError(f"gemmtune.gemm_epilogue: {msg} (x {_d(x)}, w {_d(w)}, bias {_d(bias)}, c {_d(c)})")


def c_kind(c_shape, out_shape) -> str | None:
    """How C broadcasts over the output: full, row (N,), col (..., 1), scalar; None when it does not."""
    n = len(out_shape)
    if len(c_shape) > n:
        return None
    padded = (1,) * (n - len(c_shape)) + tuple(c_shape)
    if any(cd not in (1, od) for cd, od in zip(padded, out_shape)):
        return None
    lead_full = all(cd == od for cd, od in zip(padded[:-1], out_shape[:-1]))
    lead_one = all(cd == 1 for cd in padded[:-1])
    last_full = padded[-1] == out_shape[-1]
    if last_full and lead_full:
        return "full"
    if last_full and lead_one:
        return "row"
    if padded[-1] == 1 and lead_full:
        return "col"
    if padded[-1] == 1 and lead_one:
        return "scalar"
    return None


def validate(x, w, bias, c, act, alpha, beta, out_dtype, w_layout) -> None:
    """Raise naming the shapes / dtypes / devices for anything gemm_epilogue cannot compute."""
    op = "gemm_epilogue"
    check_tensor(op, "x", x)
    check_tensor(op, "w", w)
    check_tensor(op, "bias", bias, optional=True)
    check_tensor(op, "c", c, optional=True)
    check_choice(op, "act", act, ACTS)
    check_number(op, "alpha", alpha)  # a Python number: a tensor would need a host sync per call
    check_number(op, "beta", beta)
    check_choice(op, "w_layout", w_layout, _W_LAYOUTS)
    check_dtype(op, "out_dtype", out_dtype, optional=True)  # which ones: below, with the shapes
    lay = "[N, K]" if w_layout == "nk" else "[K, N]"
    if w.layout != torch.strided or x.layout != torch.strided:
        raise _error(
            "x and w must be dense (strided) tensors; sparse weights go to gemmtune.sparse_gemm", x, w, bias, c
        )
    if w.dim() != 2:
        raise _error(f"w must be 2-D {lay}, got {w.dim()}-D", x, w, bias, c)
    if x.dim() < 1:
        raise _error("x must have at least 1 dimension [..., K]", x, w, bias, c)
    N, K = (w.shape[0], w.shape[1]) if w_layout == "nk" else (w.shape[1], w.shape[0])
    if x.shape[-1] != K:
        raise _error(f"x[..., K={x.shape[-1]}] does not match w {lay} with K={K}", x, w, bias, c)
    if x.dtype != w.dtype:
        raise _error(f"dtype mismatch: x is {x.dtype}, w is {w.dtype}", x, w, bias, c)
    if x.dtype not in _FLOATS:
        raise _error(f"unsupported dtype {x.dtype} (float16/bfloat16/float32)", x, w, bias, c)
    if x.device != w.device:
        raise _error(f"device mismatch: x on {x.device}, w on {w.device}", x, w, bias, c)
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise _error(f"unsupported out_dtype {out_dtype} (float16/bfloat16/float32)", x, w, bias, c)
    odt = out_dtype or x.dtype
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N:
            raise _error(f"bias must be 1-D of length N={N}", x, w, bias, c)
        if bias.device != x.device:
            raise _error(f"device mismatch: bias on {bias.device}, x on {x.device}", x, w, bias, c)
        if bias.dtype not in (x.dtype, odt):
            raise _error(f"bias dtype {bias.dtype} must be x's ({x.dtype}) or the out dtype ({odt})", x, w, bias, c)
    if c is None:
        if beta != 0:
            raise _error(f"beta={beta} needs a C to scale (c is None)", x, w, bias, c)
        return
    out_shape = (*x.shape[:-1], N)
    if c_kind(c.shape, out_shape) is None:
        raise _error(
            f"C of shape {tuple(c.shape)} is not a supported broadcast over the output {out_shape}: give "
            f"the full shape, a row ({N},), a column (..., 1) or a scalar",
            x, w, bias, c,
        )  # fmt: skip
    if c.device != x.device:
        raise _error(f"device mismatch: c on {c.device}, x on {x.device}", x, w, bias, c)
    if c.dtype not in (x.dtype, odt):
        raise _error(f"c dtype {c.dtype} must be x's ({x.dtype}) or the out dtype ({odt})", x, w, bias, c)


def key_of(x, w, bias, c, act, alpha, beta, out_dtype, w_layout) -> EpilogueKey:
    N, K = (w.shape[0], w.shape[1]) if w_layout == "nk" else (w.shape[1], w.shape[0])
    M = x.numel() // K if K else math.prod(x.shape[:-1])
    use_c = c is not None and beta != 0
    kind = c_kind(c.shape, (*x.shape[:-1], N)) if use_c else "none"
    return EpilogueKey(M, N, K, bias is not None, x.dtype, out_dtype or x.dtype, act, alpha != 1, use_c, kind,
                       w_layout)  # fmt: skip


def composite(x, w, bias, c, act: str, alpha: float, beta: float, out_dtype, w_layout: str) -> torch.Tensor:
    """The unfused composition in plain torch ops (differentiable): the grad path and the backward."""
    wv = w if w_layout == "nk" else w.t()
    y = torch.matmul(x, wv.t())
    if alpha != 1:
        y = y * alpha
    if c is not None and beta != 0:
        y = y + beta * c.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = apply_act(y, act)
    return y.to(out_dtype) if out_dtype is not None else y


def _bind_views(run, key: EpilogueKey, out_shape: tuple, bias_dtype: torch.dtype | None):
    """The cached call: views in, the runner's (M, N) result viewed as the output shape."""
    M, N, K, kind, use_c, transpose = key.M, key.N, key.K, key.c, key.beta, key.w_layout == "kn"
    cast_bias = bias_dtype is not None and bias_dtype != key.dtype

    def call(x, w, bias, c, alpha, beta):
        y = run(
            x.reshape(M, K),
            w.t() if transpose else w,
            bias.to(x.dtype) if cast_bias else bias,  # a bias in the out dtype is read in x's, as gemm's
            expand_c(c, kind, M, N) if use_c else None,
            float(alpha),
            float(beta) if use_c else 0.0,
        )
        return y.reshape(out_shape)

    return call


def _meta(t):
    return None if t is None else (t.shape, t.dtype, t.device)


def _signature(x, w, bias, act, alpha, beta, c, out_dtype, w_layout) -> tuple:
    # alpha and beta count only as whether they apply (and their type, so a str is validated): the cached
    # call takes their values.
    return (
        x.shape, w.shape, x.dtype, w.dtype, x.device, w.device, _meta(bias), _meta(c), act, alpha != 1, beta != 0,
        alpha.__class__, beta.__class__, out_dtype, w_layout,
        _grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)
                             or (c is not None and c.requires_grad)),
    )  # fmt: skip


def _validate(x, w, bias, act, alpha, beta, c, out_dtype, w_layout) -> None:
    validate(x, w, bias, c, act, alpha, beta, out_dtype, w_layout)


def _bind(x, w, bias, act, alpha, beta, c, out_dtype, w_layout):
    if _signature(x, w, bias, act, alpha, beta, c, out_dtype, w_layout)[-1]:  # gradients: torch's own ops

        def call(x, w, bias, c, alpha, beta):
            return composite(x, w, bias, c, act, alpha, beta, out_dtype, w_layout)

        return call
    key = key_of(x, w, bias, c, act, alpha, beta, out_dtype, w_layout)
    if 0 in (key.M, key.N, key.K):  # nothing to tune: the plain path handles empty sizes
        run = TorchEpilogueBackend().make_runner(UNFUSED, key, x.device)
    else:
        run = _dispatcher.runner_for(key, x.device, family=FAMILY)
    return _bind_views(run, key, (*x.shape[:-1], key.N), None if bias is None else bias.dtype)


def _fake(x, w, bias, c, act, alpha, beta, out_dtype, w_layout):
    validate(x, w, bias, c, act, alpha, beta, out_dtype, w_layout)
    N = w.shape[0] if w_layout == "nk" else w.shape[1]
    return x.new_empty((*x.shape[:-1], N), dtype=out_dtype or x.dtype)


def _setup_context(ctx, inputs, output):
    x, w, bias, c, act, alpha, beta, out_dtype, w_layout = inputs
    ctx.save_for_backward(x, w, bias, c)
    ctx.args = (act, alpha, beta, out_dtype, w_layout)


def _backward(ctx, grad):
    # Recompute the unfused composition and differentiate it: the pre-activation is not kept.
    saved = ctx.saved_tensors
    act, alpha, beta, out_dtype, w_layout = ctx.args
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(t.dtype.is_floating_point) for t in saved]
        y = composite(*leaves, act, alpha, beta, out_dtype, w_layout)
        want = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(y, want, grad, allow_unused=True))
    out = [None if t is None else next(grads) for t in leaves]
    return (*out, None, None, None, None, None)


_cache = OpCache("gemm_epilogue", family=FAMILY, validate=_validate, bind=_bind)
_is_compiling = torch.compiler.is_compiling


@public_op(_cache)
def gemm_epilogue(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str = "none",
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    w_layout: str = "nk",
) -> torch.Tensor:
    """y[..., N] = act(alpha * x[..., K] @ W + beta * c + bias) with W = w^T for w [N, K] (w_layout
    "nk", nn.Linear) or W = w for w [K, N] ("kn"); act one of none, relu, gelu, gelu_tanh. Runs the
    tuned solution for this key, else the unfused torch path; the same result within the dtype's
    tolerance."""
    if _is_compiling():
        return torch.ops.gemmtune.gemm_epilogue(x, w, bias, c, act, alpha, beta, out_dtype, w_layout)
    try:
        call = _cache.get(sig := _signature(x, w, bias, act, alpha, beta, c, out_dtype, w_layout))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _cache.reject(x, w, bias, act, alpha, beta, c, out_dtype, w_layout)
        raise
    if call is None:
        call = _cache.miss(sig, x, w, bias, act, alpha, beta, c, out_dtype, w_layout)
    return call(x, w, bias, c, alpha, beta)


@custom_op(_cache, fake=_fake, autograd=(_backward, _setup_context))
def _gemm_epilogue_op(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor | None,
    act: str,
    alpha: float,
    beta: float,
    out_dtype: torch.dtype | None,
    w_layout: str,
) -> torch.Tensor:
    return gemm_epilogue(x, w, bias, act=act, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype, w_layout=w_layout)


# ---- aiter's spellings --------------------------------------------------------------------------
_APPROXIMATE = ("none", "tanh")  # F.gelu's


@spelling_of(gemm_epilogue, aiter_names=("gemm_bias",))
def gemm_bias(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transpose_weight: bool = True):
    """input @ weight^T + bias with weight [N, K] (transpose_weight=True, nn.Linear), or input @ weight
    + bias with weight [K, N] (transpose_weight=False)."""
    check_bool("gemm_bias", "transpose_weight", transpose_weight)
    return gemm_epilogue(input, weight, bias, w_layout="nk" if transpose_weight else "kn")


@spelling_of(gemm_epilogue, aiter_names=("gemm_gelu",))
def gemm_gelu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"):
    """gelu(input @ weight^T + bias), weight [N, K]; approximate "none" (erf) or "tanh" as F.gelu."""
    check_choice("gemm_gelu", "approximate", approximate, _APPROXIMATE)
    return gemm_epilogue(input, weight, bias, act="gelu" if approximate == "none" else "gelu_tanh")


@spelling_of(gemm_epilogue, aiter_names=("gemm_relu",))
def gemm_relu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """relu(input @ weight^T + bias), weight [N, K]."""
    return gemm_epilogue(input, weight, bias, act="relu")


@spelling_of(gemm_epilogue, aiter_names=("cutlass_gemm",))
def cutlass_gemm(
    a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None
):
    """alpha * a @ b + beta * c with a [..., K], b [K, N] (c broadcast over the output as torch.addmm)."""
    return gemm_epilogue(a, b, None, alpha=alpha, beta=beta, c=c, w_layout="kn")
