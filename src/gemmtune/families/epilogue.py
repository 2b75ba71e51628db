"""epilogue: y[M, N] = act(alpha * x[M, K] @ w[N, K]^T + beta * C + bias), 16-bit (or fp32) inputs.

The ops gemm_bias / gemm_gelu / gemm_relu / cutlass_gemm (ops/epilogue.py) all land here. The key says
which epilogue runs, never the values of alpha and beta (one tuned row answers every value):
- `act`: none, relu, gelu (erf) or gelu_tanh;
- `alpha`: True when the product is scaled (alpha != 1);
- `beta`: True when beta * C is added (beta != 0 and a C is given);
- `c`: how C broadcasts over the (M, N) output: none, full (M, N), row (N,), col (M, 1), scalar;
- `w_layout`: how the weight is stored, "nk" (nn.Linear) or "kn" (A @ B, cutlass_gemm's b).

GELU kernels: the reference (and the unfused path, and the Triton epilogue) compute each act exactly;
cuBLASLt's GELU epilogues and torch's `_addmm_activation` on GPUs compute the tanh approximation only.
For `act="gelu"` (erf) keys with a 16-bit output those tanh kernels are offered anyway, under names
that say so (`addmm_activation_tanh`, blaslt `..._tanh`), and the tuner's check against the fp32 erf
reference decides. The two GELUs differ by < 5e-4 absolute (largest near |x| = 2.7; a bf16 output of
magnitude >= 0.25 rounds by more); over random data the tanh result's relative error vs the erf
reference is 1.7e-3 in bf16 (rounding alone: 1.7e-3; the check's limit 1e-2) and 2.8e-4 in fp16 (2.1e-4;
limit 2e-3). An fp32 output would show the 1.8e-4 difference itself (limit 1e-4): never offered there
(`tanh_for_erf`).

Runners are called as runner(x [M, K], w [N, K] view, bias [N] | None, c [M, N] view | None, alpha,
beta) with C expanded to (M, N) (zero strides where it broadcasts) and alpha / beta Python floats; they
return y [M, N] in the key's out dtype. Tables: aiter's 18 bf16 columns, then act, alpha, beta, c,
w_layout (aiter reads its tables by column name and ignores the rest).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import FLOAT_DTYPES
from ..kernels.gemm_ref import ACTS, apply_act, epilogue_ref
from ..keys import dtype_name, parse_bool
from .base import Column, Family, bool_col, dtype_col, generator, int_col, inv_sqrt, randn

C_KINDS = ("none", "full", "row", "col", "scalar")
W_LAYOUTS = ("nk", "kn")
# The values make_inputs uses when the key scales / adds C (any value works: the key has no value).
ALPHA_VALUE = 0.75
BETA_VALUE = 0.5


class EpilogueKey(NamedTuple):
    M: int
    N: int
    K: int
    bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    outdtype: torch.dtype = torch.bfloat16
    act: str = "none"
    alpha: bool = False
    beta: bool = False
    c: str = "none"
    w_layout: str = "nk"

    def describe(self) -> str:
        parts = [f"M={self.M} N={self.N} K={self.K}"]
        if self.bias:
            parts.append("+bias")
        if self.alpha:
            parts.append("alpha")
        if self.beta:
            parts.append(f"beta*C[{self.c}]")
        if self.act != "none":
            parts.append(self.act)
        if self.w_layout != "nk":
            parts.append(f"w[{self.w_layout}]")
        return " ".join(parts) + f" {dtype_name(self.dtype)}->{dtype_name(self.outdtype)}"


def _choice(options: tuple[str, ...]):
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return v

    return parse


def _false_only(text: str) -> bool:
    if parse_bool(text):
        raise ValueError("the epilogue family has no scaled / pre-shuffled variant: must be False")
    return False


def tanh_for_erf(key) -> bool:
    """May a tanh-GELU kernel stand in for the erf GELU of `key`? Only for a 16-bit output, where the
    difference is far below the output's rounding (module docstring); the tuner's check decides."""
    return key.act == "gelu" and key.outdtype in (torch.bfloat16, torch.float16)


def expand_c(c: torch.Tensor, kind: str, M: int, N: int) -> torch.Tensor:
    """C of broadcast `kind` as an (M, N) view with zero strides where it broadcasts."""
    if kind == "full":
        return c.reshape(M, N)
    if kind == "row":
        return c.reshape(1, N).expand(M, N)
    if kind == "col":
        return c.reshape(M, 1).expand(M, N)
    return c.reshape(1, 1).expand(M, N)


class Epilogue(Family):
    name = "epilogue"
    description = "16-bit GEMM with a fused epilogue: bias, act, alpha, beta*C (gemm_bias, gemm_gelu, ...)"
    ops = ("gemm_bias", "gemm_gelu", "gemm_relu", "cutlass_gemm", "gemm_epilogue")
    env_var = "GEMMTUNE_CONFIG_EPILOGUE"
    aiter_tables = ()
    key_type = EpilogueKey
    key_columns = (
        int_col("M"), int_col("N"), int_col("K"), bool_col("bias"), dtype_col("dtype"),
        dtype_col("outdtype"), Column("act", "act", _choice(ACTS), str, "none"),
        bool_col("alpha"), bool_col("beta"), Column("c", "c", _choice(C_KINDS), str, "none"),
        Column("w_layout", "w_layout", _choice(W_LAYOUTS), str, "nk"),
    )  # fmt: skip
    tuned_columns = (
        "gfx", "cu_num", "M", "N", "K", "bias", "dtype", "outdtype", "scaleAB", "bpreshuffle",
        "libtype", "solidx", "splitK", "us", "kernelName", "err_ratio", "tflops", "bw",
        "act", "alpha", "beta", "c", "w_layout",
    )  # fmt: skip
    untuned_columns = ("M", "N", "K", "bias", "dtype", "outdtype", "act", "alpha", "beta", "c", "w_layout")
    computed_dtypes = {"dtype": FLOAT_DTYPES, "outdtype": FLOAT_DTYPES}
    signature = frozenset({"M", "N", "K", "act"})
    excludes = frozenset({"B", "q_dtype_w", "kernelId", "token", "pattern"})
    name_hints = ("epilogue",)

    def parse_key(self, raw, parse_column):
        vals = self.parse_columns(parse_column, skip=frozenset({"c"}))
        beta = vals["beta"]

        def c_kind(text: str) -> str:
            kind = _choice(C_KINDS)(text)
            if (kind != "none") != beta:
                raise ValueError(f"beta={beta} needs c {'!= none' if beta else '== none'}")
            return kind

        vals["c"] = parse_column("c", c_kind, None if beta else "none")
        # aiter's columns must read False here: an epilogue row is never a scaled / pre-shuffled GEMM.
        for col in ("scaleAB", "bpreshuffle"):
            parse_column(col, _false_only, False)
        return EpilogueKey(**vals)

    def key_record(self, key: EpilogueKey) -> dict[str, str]:
        return {**super().key_record(key), "scaleAB": "False", "bpreshuffle": "False"}

    def make_inputs(self, key: EpilogueKey, device, sets, seed):
        gen = generator(device, seed)
        out = []
        for _ in range(sets):
            x = randn((key.M, key.K), device, gen, key.dtype)
            w = randn((key.N, key.K), device, gen, key.dtype, inv_sqrt(key.K))
            if key.w_layout == "kn":  # stored [K, N], handed over as its [N, K] transpose
                w = w.t().contiguous().t()
            b = randn((key.N,), device, gen, key.dtype) if key.bias else None
            c = None
            if key.beta:
                shape = {"full": (key.M, key.N), "row": (key.N,), "col": (key.M, 1), "scalar": (1,)}[key.c]
                c = expand_c(randn(shape, device, gen, key.outdtype), key.c, key.M, key.N)
            alpha = ALPHA_VALUE if key.alpha else 1.0
            beta = BETA_VALUE if key.beta else 0.0
            out.append((x, w, b, c, alpha, beta))
        return out

    def set_bytes(self, key: EpilogueKey) -> int:
        return (key.N + key.M) * key.K * key.dtype.itemsize + self._c_bytes(key)

    def reference(self, key: EpilogueKey, inputs):
        x, w, b, c, alpha, beta = inputs
        return epilogue_ref(x, w, b, c, alpha, beta, key.act)

    def output_shape(self, key: EpilogueKey):
        return (key.M, key.N)

    def check_variants(self, key: EpilogueKey, inputs):
        # The op hands runners x as a 2-D view of whatever the caller passed (rows may be padded), and
        # w in either storage order (gemm_bias(transpose_weight=False), cutlass_gemm's [K, N] b).
        x, w, b, c, alpha, beta = inputs
        wide = torch.full((key.M, key.K + 8), float("nan"), dtype=x.dtype, device=x.device)
        wide[:, : key.K] = x
        other = w.contiguous() if key.w_layout == "kn" else w.t().contiguous().t()
        shape = (key.M, key.N)
        return [
            ("x [M, K] with padded rows", (wide[:, : key.K], w, b, c, alpha, beta), shape),
            ("w in the other storage order", (x, other, b, c, alpha, beta), shape),
            ("other alpha / beta values", (x, w, b, c, -1.5 if key.alpha else 1.0, 2.0 if key.beta else 0.0), shape),
        ]

    def _c_bytes(self, key: EpilogueKey) -> int:
        elems = {"none": 0, "full": key.M * key.N, "row": key.N, "col": key.M, "scalar": 1}[key.c]
        return elems * key.outdtype.itemsize

    def bytes(self, key: EpilogueKey) -> int:
        e = key.dtype.itemsize
        return ((key.M * key.K + key.N * key.K) * e + key.M * key.N * key.outdtype.itemsize
                + (key.N * e if key.bias else 0) + self._c_bytes(key))  # fmt: skip

    def flops(self, key: EpilogueKey) -> int:
        return 2 * key.M * key.N * key.K


FAMILY = Epilogue()

__all__ = ["ACTS", "ALPHA_VALUE", "BETA_VALUE", "C_KINDS", "FAMILY", "W_LAYOUTS", "EpilogueKey", "apply_act",
           "epilogue_ref", "expand_c", "tanh_for_erf"]  # fmt: skip
