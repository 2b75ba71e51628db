"""The `torch` backends of the quantized families (families/quantized.py): a8w8 and a8w8_blockscale, each
also serving its *_bpreshuffle twin (same kernels: on NVIDIA the pre-shuffled layout is the plain
K-major [N, K] weight cuBLASLt reads, see quant/shuffle.py). Every solution here runs torch only.

- a8w8: `scaled_mm` (torch._scaled_mm, cuBLASLt fp8: tensorwise, or rowwise = per-token x
  per-channel), `int_mm` (torch._int_mm, cuBLAS int8 -> int32, then scales in one fused torch
  expression), `dequant` (q * scale in fp32 or bf16, then a float matmul: any device, any shape).
- a8w8_blockscale: `scaled_mm_blockwise` (torch._scaled_mm with 1x128 / 128x128 scales, where the
  probe of this torch and GPU finds it right: lib/scaled_mm_blockwise.py) and `dequant`.
- `native` (aiter's torch spelling, solidx 0): torch's own pick for the key (`torch_choice`: the
  first of the lists above that runs it). What an untuned key runs is the family's policy
  (quantized/policy.py), which may be a Triton kernel under its own libtype.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F

from ...device import capability, is_gpu
from ...quant import formats
from ...quant.quantize import dequantize_1x128, dequantize_128x128
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib import scaled_mm_blockwise as blockwise
from ..lib.quant_support import OUT_DTYPES, tensor_core_fp8


def _sol(name: str) -> Solution:
    return Solution("torch", name, 0 if name == "native" else stable_solidx(name), 0)


NATIVE = _sol("native")
SCALED_MM = _sol("scaled_mm")
INT_MM = _sol("int_mm")
DEQUANT = _sol("dequant")
SCALED_MM_BLOCKWISE = _sol("scaled_mm_blockwise")
_OLD_NAMES = {"scaled_mm_block": SCALED_MM_BLOCKWISE}  # the name before the probe worked (never tuned)


# ---- a8w8 -------------------------------------------------------------------------------------------
def scaled_mm_ok(key, device: torch.device) -> bool:
    """torch._scaled_mm (cuBLASLt fp8) computes `key` here."""
    if not (is_gpu(device) and hasattr(torch, "_scaled_mm") and tensor_core_fp8(key.q_dtype_w)):
        return False
    if key.K % 16 or key.N % 16 or capability(device) < (8, 9):
        return False
    # Rowwise scaling (per-token x per-channel) writes bf16 only.
    return key.scale == "per_tensor" or key.outdtype == torch.bfloat16


def int_mm_ok(key, device: torch.device) -> bool:
    """torch._int_mm (cuBLAS int8 GEMM: M > 16, K and N multiples of 8) computes `key` here."""
    return (is_gpu(device) and hasattr(torch, "_int_mm") and key.q_dtype_w == torch.int8 and key.M > 16
            and key.K % 8 == 0 and key.N % 8 == 0)  # fmt: skip


def _scaled_mm_runner(key) -> Runner:
    out = key.outdtype
    if key.scale == "per_tensor" and (not key.bias or out != torch.float32):

        def tensorwise(xq, wq, xs, ws, bias):
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=out)

        return tensorwise

    def scaled(xq, wq, xs, ws, bias):
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out)
        return y if bias is None else y.add_(bias)

    return scaled


def _int_mm_runner(key) -> Runner:
    out = key.outdtype

    def run(xq, wq, xs, ws, bias):
        y = torch._int_mm(xq, wq.t()).float().mul_(xs).mul_(ws)
        if bias is not None:
            y.add_(bias)
        return y.to(out)

    return run


def _dequant_runner(key, device) -> Runner:
    # On a GPU the dequantized operands go through a bf16 matmul (the fp32 one is 30x slower there);
    # the fp32-out key and the CPU keep fp32.
    mid = torch.bfloat16 if is_gpu(device) and key.outdtype != torch.float32 else torch.float32
    out = key.outdtype

    def run(xq, wq, xs, ws, bias):
        x = (xq.to(torch.float32) * xs).to(mid)
        w = (wq.to(torch.float32) * ws.reshape(-1, 1)).to(mid)
        return F.linear(x, w, None if bias is None else bias.to(mid)).to(out)

    return run


class _TorchPicks(Backend):
    """torch's own 8-bit paths for a key, best first; `native` (and the default) runs the first that applies."""

    name = "torch"

    @abstractmethod
    def usable(self, key, device) -> list[Solution]:
        """This key's torch paths that run here, best first (the last always runs: dequantize)."""

    def torch_choice(self, key, device: torch.device) -> Solution:
        return self.usable(key, device)[0]

    def candidates(self, key, device: torch.device) -> list[Solution]:
        return self.usable(key, device)

    def default_solution(self, key, device: torch.device) -> Solution:
        return self.torch_choice(key, device)


class TorchA8W8Backend(_TorchPicks):
    family = "a8w8"

    def usable(self, key, device) -> list[Solution]:
        """cuBLASLt fp8 where it applies, cuBLAS int8, dequantize."""
        sols = []
        if scaled_mm_ok(key, device):
            sols.append(SCALED_MM)
        if int_mm_ok(key, device):
            sols.append(INT_MM)
        return sols + [DEQUANT]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, SCALED_MM, INT_MM, DEQUANT):
            if kernel_name == sol.kernel_name:
                return sol
        return NATIVE if solidx == 0 else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if key.outdtype not in OUT_DTYPES:
            return False
        return solution == NATIVE or solution in self.usable(key, device)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        if solution == NATIVE:
            solution = self.torch_choice(key, device)
        if solution == SCALED_MM:
            return _scaled_mm_runner(key)
        if solution == INT_MM:
            return _int_mm_runner(key)
        return _dequant_runner(key, device)


class TorchA8W8BPreshuffleBackend(TorchA8W8Backend):
    family = "a8w8_bpreshuffle"


# ---- block-scale ------------------------------------------------------------------------------------
def blockwise_ok(key, device: torch.device) -> bool:
    """cuBLASLt's 1x128 x 128x128 block-scaled fp8 GEMM through torch._scaled_mm, where the probe of
    this torch and GPU (lib/scaled_mm_blockwise.py, once per GPU) found it right for this key's shape."""
    if not (is_gpu(device) and key.q_dtype_w == formats.FP8 and formats.FP8 is not None):
        return False
    return blockwise.cuda_support(torch.device(device).index).fits(key.M, key.N, key.K, key.outdtype)


def _blockwise_runner(key, device) -> Runner:
    out = key.outdtype
    pad_k = blockwise.cuda_support(torch.device(device).index).pad_k is not False

    def run(xq, wq, xs, ws):
        return blockwise.scaled_mm_blockwise(xq, wq, xs, ws, out, pad_k)

    return run


def _block_dequant_runner(key, device) -> Runner:
    mid = torch.bfloat16 if is_gpu(device) and key.outdtype != torch.float32 else torch.float32
    out = key.outdtype

    def run(xq, wq, xs, ws):
        return F.linear(dequantize_1x128(xq, xs).to(mid), dequantize_128x128(wq, ws).to(mid)).to(out)

    return run


class TorchBlockscaleBackend(_TorchPicks):
    family = "a8w8_blockscale"

    def usable(self, key, device) -> list[Solution]:
        """The blockwise torch._scaled_mm where it applies, dequantize."""
        return ([SCALED_MM_BLOCKWISE] if blockwise_ok(key, device) else []) + [DEQUANT]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, SCALED_MM_BLOCKWISE, DEQUANT):
            if kernel_name == sol.kernel_name:
                return sol
        return _OLD_NAMES.get(kernel_name, NATIVE if solidx == 0 else None)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if key.outdtype not in OUT_DTYPES or key.K % formats.BLOCK:
            return False
        return solution == NATIVE or solution in self.usable(key, device)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        if solution == NATIVE:
            solution = self.torch_choice(key, device)
        if solution == SCALED_MM_BLOCKWISE:
            return _blockwise_runner(key, device)
        return _block_dequant_runner(key, device)


class TorchBlockscaleBPreshuffleBackend(TorchBlockscaleBackend):
    family = "a8w8_blockscale_bpreshuffle"


BACKENDS = (
    TorchA8W8Backend(),
    TorchA8W8BPreshuffleBackend(),
    TorchBlockscaleBackend(),
    TorchBlockscaleBPreshuffleBackend(),
)
