"""Backends of the quantized families (families/quantized.py): a8w8 and a8w8_blockscale, each also
serving its *_bpreshuffle twin (same kernels: on NVIDIA the pre-shuffled layout is the plain K-major
[N, K] weight both cuBLASLt and the Triton kernels read, see quant/shuffle.py).

torch (the default, libtype "torch"):
- a8w8: `scaled_mm` (torch._scaled_mm, cuBLASLt fp8: tensorwise, or rowwise = per-token x
  per-channel), `int_mm` (torch._int_mm, cuBLAS int8 -> int32, then scales in one fused torch
  expression), `dequant` (q * scale in fp32 or bf16, then a float matmul: any device, any shape).
- a8w8_blockscale: `scaled_mm_blockwise` (torch._scaled_mm with 1x128 / 128x128 scales, where the
  probe of this torch and GPU finds it right: backends/blockwise.py) and `dequant`.
`native` (aiter's torch spelling, solidx 0, what an untuned key runs; `native_a8w8_choice` names it):
for a8w8 on a CUDA GPU the 8-bit skinny kernel at M <= 16 (fp8 and int8), cuBLASLt fp8 (scaled_mm)
above, int8 from M = 33 the Triton GEMM kernel's 8-bit config (`a8w8_tg_...`), as measured on an H100
(see `_native_a8w8`); block-scale: scaled_mm_blockwise where it applies; else the Triton kernel's
heuristic config (quant_configs.default_config), else int_mm, else dequant.

triton: kernels/a8w8.py and kernels/blockscale.py configs (kernelName = the config string, solidx its crc);
a8w8 above M = 32 also the Triton GEMM kernel's 8-bit configs (`a8w8_tg_...`, backends/a8w8_tg.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import facts
from ..kernels._common import HAS_TRITON
from ..quant import formats
from ..quant.quantize import dequantize_1x128, dequantize_128x128
from . import blockwise
from .base import Backend, Runner, Solution, stable_solidx

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _sol(name: str, lib: str = "torch", splitk: int = 0) -> Solution:
    return Solution(lib, name, 0 if name == "native" else stable_solidx(name), splitk)


NATIVE = _sol("native")
SCALED_MM = _sol("scaled_mm")
INT_MM = _sol("int_mm")
DEQUANT = _sol("dequant")
SCALED_MM_BLOCKWISE = _sol("scaled_mm_blockwise")
_OLD_NAMES = {"scaled_mm_block": SCALED_MM_BLOCKWISE}  # the name before the probe worked (never tuned)


def _capability(device_type: str, index: int | None) -> tuple[int, int]:
    return facts(torch.device(device_type, index) if index is not None else torch.device(device_type)).capability


def _cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _tensor_core_fp8(dtype: torch.dtype) -> bool:
    """The fp8 flavour this build's GPU GEMMs take (OCP e4m3fn on CUDA, fnuz on ROCm MI300)."""
    return dtype == (formats.FP8_FNUZ if torch.version.hip else formats.FP8) and dtype is not None


# ---- a8w8: torch ------------------------------------------------------------------------------------
def _scaled_mm_ok(key, device) -> bool:
    if not (_cuda(device) and hasattr(torch, "_scaled_mm") and _tensor_core_fp8(key.q_dtype_w)):
        return False
    if key.K % 16 or key.N % 16 or _capability(device.type, device.index) < (8, 9):
        return False
    # Rowwise scaling (per-token x per-channel) writes bf16 only.
    return key.scale == "per_tensor" or key.outdtype == torch.bfloat16


def _int_mm_ok(key, device) -> bool:
    # cuBLAS int8 GEMM: M > 16, K and N multiples of 8.
    return (_cuda(device) and hasattr(torch, "_int_mm") and key.q_dtype_w == torch.int8 and key.M > 16
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
    mid = torch.bfloat16 if _cuda(device) and key.outdtype != torch.float32 else torch.float32
    out = key.outdtype

    def run(xq, wq, xs, ws, bias):
        x = (xq.to(torch.float32) * xs).to(mid)
        w = (wq.to(torch.float32) * ws.reshape(-1, 1)).to(mid)
        return F.linear(x, w, None if bias is None else bias.to(mid)).to(out)

    return run


def _triton_default_config(kind: str, key, device):
    """The Triton 8-bit kernel's heuristic TileConfig for an untuned key (quant_configs.default_config),
    or None where the Triton backend cannot run it."""
    be = TritonBlockscaleBackend() if kind == "blockscale" else TritonA8W8Backend()
    if not (be.is_available(device) and be._key_ok(key, device)):
        return None
    from .quant_configs import default_config

    return default_config(kind, key, torch.device(device))


def _triton_default(kind: str, key, device) -> Runner | None:
    """A runner of _triton_default_config's config, or None."""
    cfg = _triton_default_config(kind, key, device)
    if cfg is None:
        return None
    be = TritonBlockscaleBackend() if kind == "blockscale" else TritonA8W8Backend()
    return be.make_runner(be._solution(cfg), key, device)


SKINNY_MAX_M = 16  # the decode rows an untuned key runs on the 8-bit skinny kernels


def native_a8w8_choice(key, device) -> tuple[str, str]:
    """(libtype, kernel name) of what an untuned a8w8 key runs on `device` (see `_native_a8w8`)."""
    device = torch.device(device)
    nvidia = _cuda(device) and HAS_TRITON and not torch.version.hip
    if nvidia and key.M <= SKINNY_MAX_M:
        from . import skinny_quant

        cfg = skinny_quant.default_config(key, device)
        if cfg is not None:
            return "skinny", skinny_quant.PREFIX + cfg.name
    if _scaled_mm_ok(key, device):
        return "torch", SCALED_MM.kernel_name
    if nvidia and key.q_dtype_w == torch.int8 and TritonA8W8Backend()._key_ok(key, device):
        name = _tg().default_name(key, device)  # None below M = 33
        if name is not None:
            return "triton", name
    if nvidia:
        cfg = _triton_default_config("a8w8", key, device)
        if cfg is not None:
            return "triton", cfg.name
    return "torch", (INT_MM if _int_mm_ok(key, device) else DEQUANT).kernel_name


def _native_a8w8(key, device) -> Runner:
    """What an untuned a8w8 key runs (CUDA; measured on an H100, benchmarks/results/h100/a8w8_vs_bf16/):
    - M <= 16, fp8 and int8: the 8-bit skinny kernel's default tile (skinny_quant.DEFAULT_TILE: the
      skinny kernels won all 72 decode points, 1.6x over torch._scaled_mm, decode_skinny8/);
    - fp8 above that: cuBLASLt (torch._scaled_mm) where it applies;
    - int8 from M = 33: the Triton GEMM kernel's 8-bit config that won most prefill points
      (a8w8_tg.DEFAULT, 1.47x over bf16 at M >= 1024 tuned, prefill_tg8/; cuBLAS int8 via _int_mm ran at
      0.5x of bf16);
    - else the older Triton 8-bit kernel's heuristic config (quant_configs.default_config), else
      _int_mm, else dequantize. ROCm: scaled_mm where it applies, else _int_mm, else dequantize.
    Every runner is compiled before it is returned (none compiles during a CUDA graph capture)."""
    lib, name = native_a8w8_choice(key, device)
    if lib == "skinny":
        from . import skinny_quant

        return skinny_quant.default_runner(key, torch.device(device))
    if lib == "triton":
        be = TritonA8W8Backend()
        return be.make_runner(be.solution_from_row(0, name, 0), key, device)
    if name == SCALED_MM.kernel_name:
        return _scaled_mm_runner(key)
    return _int_mm_runner(key) if name == INT_MM.kernel_name else _dequant_runner(key, device)


class TorchA8W8Backend(Backend):
    name = "torch"
    family = "a8w8"

    def is_available(self, device: torch.device) -> bool:
        return True

    def _usable(self, key, device) -> list[Solution]:
        sols = []
        if _scaled_mm_ok(key, device):
            sols.append(SCALED_MM)
        if _int_mm_ok(key, device):
            sols.append(INT_MM)
        return sols + [DEQUANT]

    def candidates(self, key, device: torch.device) -> list[Solution]:
        return self._usable(key, device)

    def default_solution(self, key, device: torch.device) -> Solution:
        return NATIVE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, SCALED_MM, INT_MM, DEQUANT):
            if kernel_name == sol.kernel_name:
                return sol
        return NATIVE if solidx == 0 else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if key.outdtype not in _OUT_DTYPES:
            return False
        return solution == NATIVE or solution in self._usable(key, device)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        if solution == NATIVE:
            return _native_a8w8(key, device)
        if solution == SCALED_MM:
            return _scaled_mm_runner(key)
        if solution == INT_MM:
            return _int_mm_runner(key)
        return _dequant_runner(key, device)


class TorchA8W8BPreshuffleBackend(TorchA8W8Backend):
    family = "a8w8_bpreshuffle"


# ---- block-scale: torch -----------------------------------------------------------------------------
def _blockwise_ok(key, device) -> bool:
    """cuBLASLt's 1x128 x 128x128 block-scaled fp8 GEMM through torch._scaled_mm, where the probe of
    this torch and GPU (backends/blockwise.py, once per GPU) found it right for this key's shape."""
    if not (_cuda(device) and key.q_dtype_w == formats.FP8 and formats.FP8 is not None):
        return False
    return blockwise.cuda_support(torch.device(device).index).fits(key.M, key.N, key.K, key.outdtype)


def _blockwise_runner(key, device) -> Runner:
    out = key.outdtype
    pad_k = blockwise.cuda_support(torch.device(device).index).pad_k is not False

    def run(xq, wq, xs, ws):
        return blockwise.scaled_mm_blockwise(xq, wq, xs, ws, out, pad_k)

    return run


def _block_dequant_runner(key, device) -> Runner:
    mid = torch.bfloat16 if _cuda(device) and key.outdtype != torch.float32 else torch.float32
    out = key.outdtype

    def run(xq, wq, xs, ws):
        return F.linear(dequantize_1x128(xq, xs).to(mid), dequantize_128x128(wq, ws).to(mid)).to(out)

    return run


class TorchBlockscaleBackend(Backend):
    name = "torch"
    family = "a8w8_blockscale"

    def is_available(self, device: torch.device) -> bool:
        return True

    def _usable(self, key, device) -> list[Solution]:
        return ([SCALED_MM_BLOCKWISE] if _blockwise_ok(key, device) else []) + [DEQUANT]

    def candidates(self, key, device: torch.device) -> list[Solution]:
        return self._usable(key, device)

    def default_solution(self, key, device: torch.device) -> Solution:
        return NATIVE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, SCALED_MM_BLOCKWISE, DEQUANT):
            if kernel_name == sol.kernel_name:
                return sol
        return _OLD_NAMES.get(kernel_name, NATIVE if solidx == 0 else None)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if key.outdtype not in _OUT_DTYPES or key.K % formats.BLOCK:
            return False
        return solution == NATIVE or solution in self._usable(key, device)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        if solution == NATIVE:
            solution = self._usable(key, device)[0]
            if solution == DEQUANT:
                tri = _triton_default("blockscale", key, device)
                if tri is not None:
                    return tri
        if solution == SCALED_MM_BLOCKWISE:
            return _blockwise_runner(key, device)
        return _block_dequant_runner(key, device)


class TorchBlockscaleBPreshuffleBackend(TorchBlockscaleBackend):
    family = "a8w8_blockscale_bpreshuffle"


# ---- Triton -----------------------------------------------------------------------------------------
class _TritonQuantBackend(Backend):
    name = "triton"
    kind = "a8w8"

    def is_available(self, device: torch.device) -> bool:
        return HAS_TRITON and _cuda(device)

    def unavailable_reason(self, device: torch.device) -> str:
        if not HAS_TRITON:
            return "triton is not installed"
        return "" if self.is_available(device) else "the Triton 8-bit GEMMs need a CUDA or ROCm GPU"

    def _key_ok(self, key, device) -> bool:
        q_ok = key.q_dtype_w == torch.int8 or _tensor_core_fp8(key.q_dtype_w)
        return (q_ok and key.outdtype in _OUT_DTYPES and key.N * key.K < 2**31 and key.M * key.N < 2**31
                and key.M > 0)  # fmt: skip

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not (self.is_available(device) and self._key_ok(key, device)):
            return []
        from .quant_configs import tile_configs

        return [self._solution(c) for c in tile_configs(self.kind, key, torch.device(device))]

    def default_solution(self, key, device: torch.device) -> Solution | None:
        return None

    def _solution(self, cfg) -> Solution:
        return Solution(self.name, cfg.name, stable_solidx(cfg.name), cfg.split_k)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        from ..kernels.a8w8 import TileConfig

        cfg = TileConfig.parse(kernel_name)
        return self._solution(cfg) if cfg is not None and cfg.kind == self.kind else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        from ..kernels.a8w8 import TileConfig

        cfg = TileConfig.parse(solution.kernel_name)
        return cfg is not None and cfg.kind == self.kind and self.is_available(device) and self._key_ok(key, device)


def _tg():
    """backends/a8w8_tg.py, imported on use (it needs Triton; the torch backends here do not)."""
    from . import a8w8_tg

    return a8w8_tg


def _is_tg(solution: Solution) -> bool:
    return solution.kernel_name.startswith("a8w8_tg_") and _tg().parse_config(solution.kernel_name) is not None


class TritonA8W8Backend(_TritonQuantBackend):
    family = "a8w8"
    kind = "a8w8"

    def candidates(self, key, device: torch.device) -> list[Solution]:
        sols = super().candidates(key, device)
        return (sols + _tg().candidates(key, torch.device(device))) if sols else sols

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        if kernel_name.startswith("a8w8_tg_"):
            return _tg().solution_from_row(solidx, kernel_name)
        return super().solution_from_row(solidx, kernel_name, splitk)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if not _is_tg(solution):
            return super().supports(solution, key, device)
        ok = self.is_available(device) and self._key_ok(key, device)
        return ok and _tg().supports(solution.kernel_name, key, torch.device(device))

    def precompile(self, jobs: list, device: torch.device, workers: int = 8) -> list:
        """Compile the a8w8_tg_ candidates ahead (the a8w8_ tiles compile on their first call)."""
        return _tg().precompile(type(self), jobs, device, workers)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        from ..kernels.a8w8 import TileConfig, a8w8_launch

        if _is_tg(solution):
            if not self.supports(solution, key, device):
                raise ValueError(f"triton a8w8: {solution.kernel_name} cannot run {key} on {device}")
            return _tg().make_runner(solution.kernel_name, key, torch.device(device))
        cfg = TileConfig.parse(solution.kernel_name)
        out = key.outdtype

        def run(xq, wq, xs, ws, bias):
            y = torch.empty((xq.shape[0], wq.shape[0]), device=xq.device, dtype=out)
            return a8w8_launch(cfg, xq, wq, xs, ws, bias, y)

        return run


class TritonA8W8BPreshuffleBackend(TritonA8W8Backend):
    family = "a8w8_bpreshuffle"


class TritonBlockscaleBackend(_TritonQuantBackend):
    family = "a8w8_blockscale"
    kind = "blockscale"

    def _key_ok(self, key, device) -> bool:
        return super()._key_ok(key, device) and key.K % formats.BLOCK == 0

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        from ..kernels.a8w8 import TileConfig
        from ..kernels.blockscale import blockscale_launch

        cfg = TileConfig.parse(solution.kernel_name)
        out = key.outdtype

        def run(xq, wq, xs, ws):
            y = torch.empty((xq.shape[0], wq.shape[0]), device=xq.device, dtype=out)
            return blockscale_launch(cfg, xq, wq, xs, ws, y)

        return run


class TritonBlockscaleBPreshuffleBackend(TritonBlockscaleBackend):
    family = "a8w8_blockscale_bpreshuffle"
