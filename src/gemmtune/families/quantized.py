"""The quantized GEMM families' tables: a8w8 (int8 / fp8, per-tensor or per-token x per-channel
scales), a8w8 with pre-shuffled weights, fp8 block-scale (1x128 activation groups x 128x128 weight
blocks, with and without pre-shuffle), batched a8w8 and MXFP4 a4w4 block-scale.

Each loads aiter's table of its name unchanged. Their keys: aiter's columns, then gemmtune's own
(scale kind, bias, out dtype, libtype) with aiter's implied values as defaults, so aiter rows read
as what aiter tuned them for. A family whose op this build cannot run keeps its rows and says so.

The runnable ones (ops/quantized.py) hand runners one tuple:
- a8w8 / a8w8_bpreshuffle: (xq [M, K], wq [N, K], x_scale, w_scale, bias [N] | None) with the scales
  fp32, per_tensor [1] x [1] or per_token [M, 1] x [1, N]; bias in the out dtype.
- a8w8_blockscale(_bpreshuffle): (xq [M, K], wq [N, K], x_scale [M, K/128], w_scale [ceil(N/128),
  K/128]), K % 128 == 0; timing inputs in the model path's scale layouts (quant/layouts.py).
The reference dequantizes (q * scale in fp32) and multiplies in fp32, so a runner's error against
it is its accumulation and output rounding only. The roofline takes 8-bit tensor cores at twice the
bf16 matmul rate.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import torch

from ..checks import FLOAT_DTYPES
from ..kernels.gemm_ref import fp32_matmul
from ..keys import dtype_name
from ..quant import formats, layouts, quantize
from .base import Column, Family, Roles, bool_col, dtype_col, generator, int_col, inv_sqrt, randn

FP8 = formats.FP8


def _scale_kind(text: str) -> str:
    t = text.strip().lower().replace("-", "_")
    if t not in ("per_tensor", "per_token"):
        raise ValueError("expected per_tensor or per_token")
    return t


class QuantKey(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = torch.int8
    scale: str = "per_token"  # per_tensor | per_token (x [M,1] scales x w [1,N] scales)
    bias: bool = False
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        b = "+bias" if self.bias else ""
        return (f"M={self.M} N={self.N} K={self.K}{b} {dtype_name(self.q_dtype_w)} {self.scale} "
                f"->{dtype_name(self.outdtype)}")  # fmt: skip


class BlockKey(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = FP8 or torch.int8
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        q = dtype_name(self.q_dtype_w)
        return f"M={self.M} N={self.N} K={self.K} {q} 1x128/128x128 ->{dtype_name(self.outdtype)}"


class BatchedQuantKey(NamedTuple):
    B: int
    M: int
    N: int
    K: int
    q_dtype_w: torch.dtype = torch.int8
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return f"B={self.B} M={self.M} N={self.N} K={self.K} {dtype_name(self.q_dtype_w)} ->{dtype_name(self.outdtype)}"


class FP4Key(NamedTuple):
    M: int
    N: int
    K: int
    outdtype: torch.dtype = torch.bfloat16

    def describe(self) -> str:
        return f"M={self.M} N={self.N} K={self.K} mxfp4 ->{dtype_name(self.outdtype)}"


class BatchedMxKey(NamedTuple):
    b: int
    m: int
    n: int
    k: int

    def describe(self) -> str:
        return f"b={self.b} m={self.m} n={self.n} k={self.k} fp8 e8m0 mxscale ->bf16"


_QROLES = Roles(libtype="libtype", solidx="kernelId", err_ratio="err_ratio")
_MNK = (int_col("M"), int_col("N"), int_col("K"))
_OUT = dtype_col("outdtype", default=torch.bfloat16)
_TAIL = ("kernelId", "splitK", "us", "kernelName", "tflops", "bw", "errRatio")


class _QuantFamily(Family):
    roles = _QROLES
    implied_libtype = "ck"
    tensor_core_speedup = 2.0  # fp8 / int8 tensor cores run at twice the bf16 rate (H100, MI300)

    def describe(self, key) -> str:
        return f"{self.name} {key.describe()}"

    def output_shape(self, key):
        return (key.M, key.N)

    def flops(self, key) -> int:
        return 2 * key.M * key.N * key.K

    def roof_us(self, key, read_bw: float, matmul_flops: float) -> float:
        return max(self.flops(key) / (matmul_flops * self.tensor_core_speedup), self.bytes(key) / read_bw) * 1e6

    def error_threshold(self, key) -> float:
        # Against the dequantized fp32 reference only accumulation order and the output cast differ.
        return {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-3}.get(key.outdtype, 1e-2)

    def _operands(self, key, device, gen):
        """Random fp32 activations x [M, K] and weights w [N, K] (unit-variance output)."""
        x = randn((key.M, key.K), device, gen, torch.float32)
        w = randn((key.N, key.K), device, gen, torch.float32, inv_sqrt(key.K))
        return x, w


class _ScaledQuantFamily(_QuantFamily, abc.ABC):
    """A runnable family: 8-bit x [M, K] and w [N, K], their fp32 scales and an output [M, N]."""

    computed_dtypes = {"q_dtype_w": formats.QUANT_DTYPES, "outdtype": FLOAT_DTYPES}

    def make_inputs(self, key, device, sets, seed):
        gen = generator(device, seed)
        return [self._quantized_set(key, device, gen, *self._operands(key, device, gen)) for _ in range(sets)]

    @abc.abstractmethod
    def _quantized_set(self, key, device, gen, x, w) -> tuple:
        """One input tuple from fp32 x and w (anything more it needs is drawn from `gen` after them)."""

    def set_bytes(self, key) -> int:
        return (key.M + key.N) * key.K * key.q_dtype_w.itemsize

    def bytes(self, key) -> int:
        return self.set_bytes(key) + key.M * key.N * key.outdtype.itemsize + self._side_bytes(key)

    @abc.abstractmethod
    def _side_bytes(self, key) -> int:
        """Bytes of the scales (and bias) read besides the operands."""


class A8W8(_ScaledQuantFamily):
    name = "a8w8"
    description = "int8/fp8 GEMM with per-tensor or per-token x per-channel scales (gemm_a8w8, int8_gemm)"
    ops = ("gemm_a8w8", "int8_gemm")
    env_var = "GEMMTUNE_CONFIG_A8W8"
    aiter_tables = ("a8w8_tuned_gemm.csv",)
    key_type = QuantKey
    key_columns = (*_MNK, dtype_col("q_dtype_w", default=torch.int8), Column("scale", "scale", _scale_kind,
                   str, "per_token"), bool_col("bias"), _OUT)  # fmt: skip
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "q_dtype_w", *_TAIL, "libtype", "scale", "bias", "outdtype")
    untuned_columns = ("M", "N", "K", "q_dtype_w", "scale", "bias", "outdtype")
    signature = frozenset({"M", "N", "K", "q_dtype_w"})
    excludes = frozenset({"B", "token"})
    name_hints = ("a8w8_tuned", "a8w8_untuned", "a8w8", "int8")
    kernel_hints = ("a8w8_rowwise",)

    def _quantized_set(self, key: QuantKey, device, gen, x, w) -> tuple:
        if key.scale == "per_tensor":
            (xq, xs), (wq, ws) = (quantize.quantize_per_tensor(t, key.q_dtype_w) for t in (x, w))
        else:
            xq, xs = quantize.quantize_per_token(x, key.q_dtype_w)
            wq, ws = quantize.quantize_per_channel(w, key.q_dtype_w)
        b = randn((key.N,), device, gen, key.outdtype) if key.bias else None
        return xq, wq, xs, ws, b

    def reference(self, key: QuantKey, inputs):
        xq, wq, xs, ws, b = inputs
        y = fp32_matmul(quantize.dequantize(xq, xs.reshape(-1, 1)), quantize.dequantize(wq, ws.reshape(-1, 1)).t())
        return y + b.float() if b is not None else y

    def check_variants(self, key: QuantKey, inputs):
        # Runners get xq as the op's 2-D view of x [..., K]: rows need not be packed (a slice of a wider
        # buffer keeps unit stride along K only).
        xq, wq, xs, ws, b = inputs
        wide = torch.zeros((key.M, key.K + 16), dtype=xq.dtype, device=xq.device)
        wide[:, : key.K] = xq
        return [("xq rows strided", (wide[:, : key.K], wq, xs, ws, b), (key.M, key.N))]

    def _side_bytes(self, key: QuantKey) -> int:
        scales = 8 if key.scale == "per_tensor" else 4 * (key.M + key.N)
        return scales + (key.N * key.outdtype.itemsize if key.bias else 0)


class A8W8BPreshuffle(A8W8):
    name = "a8w8_bpreshuffle"
    description = "a8w8 with the weight pre-shuffled for the kernel (gemm_a8w8_bpreshuffle)"
    ops = ("gemm_a8w8_bpreshuffle",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BPRESHUFFLE"
    aiter_tables = ("a8w8_bpreshuffle_tuned_gemm.csv",)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "q_dtype_w", "libtype", *_TAIL, "scale", "bias", "outdtype")
    name_hints = ("a8w8_bpreshuffle", "bpreshuffle")
    kernel_hints = ("BpreShuffle",)


class Blockscale(_ScaledQuantFamily):
    name = "a8w8_blockscale"
    description = "fp8 GEMM with 1x128 activation and 128x128 weight block scales (gemm_a8w8_blockscale)"
    ops = ("gemm_a8w8_blockscale",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BLOCKSCALE"
    aiter_tables = ("a8w8_blockscale_tuned_gemm.csv",)
    key_type = BlockKey
    key_columns = (*_MNK, dtype_col("q_dtype_w", default=FP8 or torch.int8), _OUT)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", "libtype", *_TAIL, "q_dtype_w", "outdtype")
    untuned_columns = ("M", "N", "K", "q_dtype_w", "outdtype")
    signature = frozenset({"M", "N", "K"})
    excludes = frozenset({"B", "token", "bias", "solidx", "scale"})
    name_hints = ("a8w8_blockscale_tuned", "a8w8_blockscale_untuned", "blockscale")
    kernel_hints = ("a8w8_blockscale", "fp8gemm_bf16_blockscale")

    def make_inputs(self, key: BlockKey, device, sets, seed):
        if key.K % formats.BLOCK:
            raise ValueError(f"{self.name}: K={key.K} is not a multiple of {formats.BLOCK} (block scales)")
        return super().make_inputs(key, device, sets, seed)

    def _quantized_set(self, key: BlockKey, device, gen, x, w) -> tuple:
        # The layouts optimize(quantize="fp8-block") hands the op (quant/layouts.py): M-major activation
        # scales from the dynamic quantizer, weight-scale rows padded to 4 once per weight.
        xq, xs = quantize.quantize_1x128(x, key.q_dtype_w)
        wq, ws = quantize.quantize_128x128(w, key.q_dtype_w)
        return xq, wq, layouts.m_major(xs), layouts.k_padded(ws)

    def reference(self, key: BlockKey, inputs):
        xq, wq, xs, ws = inputs
        return fp32_matmul(quantize.dequantize_1x128(xq, xs), quantize.dequantize_128x128(wq, ws).t())

    def check_variants(self, key: BlockKey, inputs):
        # The plain row-major grids (as quantize_1x128 / quantize_128x128 and checkpoints give them):
        # runners must take those too.
        xq, wq, xs, ws = inputs
        return [("row-major x_scale, packed w_scale", (xq, wq, xs.contiguous(), ws.contiguous()), (key.M, key.N))]

    def _side_bytes(self, key: BlockKey) -> int:
        kb = -(-key.K // formats.BLOCK)
        nb = -(-key.N // formats.BLOCK)
        return 4 * kb * (key.M + nb)


class BlockscaleBPreshuffle(Blockscale):
    name = "a8w8_blockscale_bpreshuffle"
    description = "fp8 block-scale GEMM with the weight pre-shuffled (gemm_a8w8_blockscale_bpreshuffle)"
    ops = ("gemm_a8w8_blockscale_bpreshuffle",)
    env_var = "GEMMTUNE_CONFIG_A8W8_BLOCKSCALE_BPRESHUFFLE"
    aiter_tables = ("a8w8_blockscale_bpreshuffle_tuned_gemm.csv",)
    name_hints = ("a8w8_blockscale_bpreshuffle", "blockscale_bpreshuffle")
    kernel_hints = ("blockscale_BpreShuffle", "blockscale_bpreshuffle")


class BatchedA8W8(_ScaledQuantFamily):
    """Runners take (xq [B, M, K], wq [B, N, K], x_scale [B, M, 1], w_scale [B, 1, N]), scales fp32."""

    name = "batched_a8w8"
    description = "batched int8 / fp8 GEMM with per-token x per-channel scales (batched_gemm_a8w8)"
    ops = ("batched_gemm_a8w8",)
    env_var = "GEMMTUNE_CONFIG_BATCHED_A8W8"
    aiter_tables = ("a8w8_tuned_batched_gemm.csv",)
    key_type = BatchedQuantKey
    key_columns = (int_col("B"), *_MNK, dtype_col("q_dtype_w", default=torch.int8), _OUT)
    tuned_columns = ("gfx", "cu_num", "B", "M", "N", "K", *_TAIL, "libtype", "q_dtype_w", "outdtype")
    untuned_columns = ("B", "M", "N", "K", "q_dtype_w", "outdtype")
    signature = frozenset({"B", "M", "N", "K"})
    excludes = frozenset({"token", "transA", "transB"})
    name_hints = ("a8w8_tuned_batched", "a8w8_untuned_batched", "a8w8_batched", "batched_a8w8")
    kernel_hints = ("a8w8_batched",)

    def output_shape(self, key: BatchedQuantKey):
        return (key.B, key.M, key.N)

    def flops(self, key: BatchedQuantKey) -> int:
        return 2 * key.B * key.M * key.N * key.K

    def _operands(self, key: BatchedQuantKey, device, gen):
        x = randn((key.B * key.M, key.K), device, gen, torch.float32)
        w = randn((key.B * key.N, key.K), device, gen, torch.float32, inv_sqrt(key.K))
        return x, w

    def _quantized_set(self, key: BatchedQuantKey, device, gen, x, w) -> tuple:
        # Per-token and per-channel scales are per row, so quantizing the stacked batches is per batch.
        xq, xs = quantize.quantize_per_token(x, key.q_dtype_w)
        wq, ws = quantize.quantize_per_channel(w, key.q_dtype_w)
        b, m, n, k = key.B, key.M, key.N, key.K
        return xq.reshape(b, m, k), wq.reshape(b, n, k), xs.reshape(b, m, 1), ws.reshape(b, 1, n)

    def reference(self, key: BatchedQuantKey, inputs):
        xq, wq, xs, ws = inputs
        x = xq.to(torch.float32) * xs.reshape(key.B, key.M, 1)
        w = wq.to(torch.float32) * ws.reshape(key.B, key.N, 1)
        return torch.stack([fp32_matmul(x[i], w[i].t()) for i in range(key.B)])

    def set_bytes(self, key: BatchedQuantKey) -> int:
        return key.B * super().set_bytes(key)

    def bytes(self, key: BatchedQuantKey) -> int:
        return self.set_bytes(key) + key.B * key.M * key.N * key.outdtype.itemsize + self._side_bytes(key)

    def _side_bytes(self, key: BatchedQuantKey) -> int:
        return 4 * key.B * (key.M + key.N)


class A4W4(_QuantFamily):
    name = "a4w4_blockscale"
    description = "MXFP4 GEMM with 1x32 block scales (gemm_a4w4)"
    ops = ("gemm_a4w4",)
    env_var = "GEMMTUNE_CONFIG_A4W4"
    aiter_tables = ("a4w4_blockscale_tuned_gemm.csv",)
    key_type = FP4Key
    key_columns = (*_MNK, _OUT)
    tuned_columns = ("gfx", "cu_num", "M", "N", "K", *_TAIL, "libtype", "outdtype")
    untuned_columns = ("M", "N", "K")
    # aiter's a4w4 shape lists are bare M,N,K (as block-scale's): the file name settles it.
    signature = frozenset({"M", "N", "K"})
    excludes = frozenset({"B", "token", "q_dtype_w", "libtype", "solidx", "bias", "scale", "dtype"})
    name_hints = ("a4w4_blockscale", "a4w4")
    kernel_hints = ("f4gemm", "fp4")
    unrunnable = "MXFP4 needs fp4 tensor cores (gfx950 / sm100); gemmtune has no fp4 GEMM"


class BatchedMxScale(_QuantFamily):
    """aiter's batched fp8 GEMM with e8m0 (MX) block scales; its table spells b,m,n,k in lower case and
    has no cu_num column (a row applies to every CU count of its gfx)."""

    name = "batched_a8w8_mxscale"
    description = "batched fp8 GEMM with e8m0 (MX) block scales (aiter's batched_gemm_a8w8_blockscale_mxscale)"
    ops = ("batched_gemm_a8w8_blockscale_mxscale",)
    env_var = "GEMMTUNE_CONFIG_BATCHED_A8W8_MXSCALE"
    aiter_tables = ("batched_gemm_a8w8_blockscale_mxscale_tuned.csv",)
    key_type = BatchedMxKey
    key_columns = (int_col("b"), int_col("m"), int_col("n"), int_col("k"))
    m_field = "m"
    cu_num_required = False
    tuned_columns = ("gfx", "b", "m", "n", "k", "libtype", *_TAIL)
    untuned_columns = ("b", "m", "n", "k")
    signature = frozenset({"b", "m", "n", "k"})
    name_hints = ("mxscale",)
    unrunnable = "fp8 with e8m0 (MX) block scales needs MX tensor cores (gfx950 / sm100); gemmtune has no MX GEMM"


FAMILIES = (A8W8(), A8W8BPreshuffle(), Blockscale(), BlockscaleBPreshuffle(), BatchedA8W8(), A4W4(), BatchedMxScale())
