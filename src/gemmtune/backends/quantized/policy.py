"""What an untuned key of each quantized family runs: (backend name, solution), the backend named after
the library that really runs it (a Triton kernel is a `skinny` or `triton` row, never `torch`).

a8w8 (and its bpreshuffle twin), measured on an H100 (benchmarks/results/h100/a8w8_vs_bf16/) and an
H200 (benchmarks/results/h200/serving_band/):
- fp8 at M 17..64 where N >= 23040 on an NVIDIA GPU where Triton runs: the Triton tile kernel's 64 x 128
  tile (SPLIT_TILE, K split by its rule: unsplit at these N). On an H200 over the 6 such shapes of the
  serving-band runs (N 23040 to 51200) it was 1.05-1.33x faster than the default of the time (the skinny
  tile up to M 32, cuBLASLt's pick above) at all 25 points, while at N 16384 it was 0.93-1.06x;
- on an NVIDIA GPU where Triton runs, M <= 16 (fp8 and int8), and for fp8 M <= 32, and M <= 64 where the
  skinny tile's 64-wide N tiles fit one wave of the SMs (N <= 8448 on 132 SMs): the 8-bit skinny kernel's
  default tile (triton_skinny.DEFAULT_TILE). On the H100 the skinny kernels won all 72 decode points, 1.6x
  over torch._scaled_mm (decode_fp8_int8.md). On an H200 at fp8 M 33..64 against cuBLASLt's
  fast-accumulation pick (8 shapes, N 6144..12288, 40 points, serving_band/): the tile was 1.18-1.44x
  faster up to N 8192 (one wave) and 1.13-1.37x slower from N 9216 (144 tiles: a second wave of 12), where
  cuBLASLt runs instead;
- fp8 at M 65..512 where K >= 8192 and the Triton tile kernel's 64 x 128 output tiles leave
  most SMs idle (its split rule splits K: lib/quant_tiles.tile_split): that tile with the split
  (SPLIT_TILE). On an H200 over the 11 shapes of benchmarks/results/h200/serving_band/ at M 96..512 it
  was 1.10-1.33x faster than cuBLASLt's fast-accumulation pick at every such point (9: N 1280 to 4480,
  K 8192 to 15360); where the rule leaves K whole, or K is shorter, cuBLASLt was as fast or faster;
- fp8 above that (and at M <= 16 where no skinny kernel runs it) on an NVIDIA GPU: cuBLASLt's heuristic
  algorithm for the key, called directly by the `blaslt` backend (quantized/blaslt.py; the row names the
  algorithm, `lt<version>_a.._cl..`) where nvmath-python's cuBLASLt bindings load and the heuristic has an
  algorithm for the key; else cuBLASLt through torch._scaled_mm where it applies. Above M = 32 with
  Hopper's fp8 fast accumulation (FAST_ACCUM, the `_fa` rows; vLLM's SM90 fp8 grouped CUTLASS GEMMs
  accumulate so too): in an H200 tune of Llama-3-8B's and Qwen3-32B's shapes at M 64..8192 the heuristic's
  fast-accumulation pick was never slower than its plain one, and faster by up to 1.16x
  (benchmarks/results/h200/tune_from_donor/); up to M = 32, where the skinny kernel usually runs, the
  plain accumulation, torch._scaled_mm's numerics. The plain pick is the same cuBLASLt kernel as
  _scaled_mm's: over the 170 points of default_vs_torch.md run 6 above the skinny rows, GEMM only 1.000x
  of _scaled_mm geomean (worst 0.961x, within that run's 4.6% noise);
- on an NVIDIA GPU, int8 from M = 33: the Triton GEMM kernel's 8-bit config that won most prefill points
  (triton_tg.DEFAULT, 1.47x over bf16 at M >= 1024 tuned, prefill_int8.md; cuBLAS int8 via _int_mm ran
  at 0.5x of bf16), else the Triton tile kernel's heuristic config (lib/quant_tiles.default_config);
- else torch: _int_mm, else dequantize. ROCm: scaled_mm where it applies, else _int_mm, else dequantize.
a8w8_blockscale: the blockwise torch._scaled_mm where the probe found it right; else on a GPU the Triton
tile kernel's heuristic config; else dequantize.
"""

from __future__ import annotations

import torch

from ... import device as device_facts
from ..base import Solution
from ..lib.quant_support import tensor_core_fp8
from .blaslt import BlasLtA8W8Backend
from .pytorch import DEQUANT, SCALED_MM, SCALED_MM_BLOCKWISE, TorchA8W8Backend, blockwise_ok, scaled_mm_ok

SKINNY_MAX_M = 16  # an untuned key runs the 8-bit skinny kernel's default tile up to here;
SKINNY_FP8_MAX_M = 32  # fp8 up to here,
SKINNY_FP8_WIDE_MAX_M = 64  # and up to here where its N tiles fill at most one wave
FAST_ACCUM_MIN_M = 33  # fp8 keys from here that run cuBLASLt run its fast-accumulation pick
SPLIT_TILE = (64, 128, 128, 4, 4)  # block_m, block_n, block_k, num_warps, num_stages (wide N, short grids)
SPLIT_TILE_MAX_M = 512
SPLIT_TILE_MIN_K = 8192
WIDE_TILE_MIN_N = 23040  # fp8 at M 17..64 from here runs SPLIT_TILE too


def _skinny_default(key, device: torch.device) -> bool:
    if key.M <= SKINNY_MAX_M:
        return True
    if not tensor_core_fp8(key.q_dtype_w):
        return False
    if key.M <= SKINNY_FP8_MAX_M:
        return True
    from .triton_skinny import DEFAULT_TILE

    one_wave = (key.N + DEFAULT_TILE[1] - 1) // DEFAULT_TILE[1] <= device_facts.facts(device).sms
    return key.M <= SKINNY_FP8_WIDE_MAX_M and one_wave


def _split_tile(key, device: torch.device) -> Solution | None:
    """The Triton tile kernel's SPLIT_TILE with its rule's K split, for an fp8 key of a wide N at M 17..64
    or of a short grid at M 65..512 (module doc); None elsewhere."""
    from ..lib.quant_tiles import tile_split  # Triton's: this module loads without it
    from .triton import TritonA8W8Backend

    backend = TritonA8W8Backend()
    if not (tensor_core_fp8(key.q_dtype_w) and backend.is_available(device) and backend.key_ok(key)):
        return None
    bm, bn, bk, warps, stages = SPLIT_TILE
    wide = SKINNY_MAX_M < key.M <= SKINNY_FP8_WIDE_MAX_M and key.N >= WIDE_TILE_MIN_N
    short_band = SKINNY_FP8_WIDE_MAX_M < key.M <= SPLIT_TILE_MAX_M and key.K >= SPLIT_TILE_MIN_K
    if not (wide or short_band):
        return None
    split = tile_split(bm, bn, bk, key, device_facts.facts(device).sms)
    if short_band and split < 2:  # the grid is not short: cuBLASLt
        return None
    from ...kernels.a8w8 import TileConfig

    return backend.solution(TileConfig("a8w8", bm, bn, bk, 8, split, warps, stages))


def _triton_on_gpu(device: torch.device, vendors: tuple[str, ...]) -> bool:
    return device_facts.vendor(device) in vendors and device_facts.triton_runs_on(device)


def a8w8(key, device: torch.device) -> tuple[str, Solution]:
    device = torch.device(device)
    nvidia = _triton_on_gpu(device, (device_facts.NVIDIA,))
    tile = _split_tile(key, device) if nvidia else None
    if tile is not None:
        return "triton", tile
    if nvidia and _skinny_default(key, device):
        from .triton_skinny import SkinnyA8W8Backend

        sol = SkinnyA8W8Backend().default_solution(key, device)
        if sol is not None:
            return "skinny", sol
    if device_facts.vendor(device) == device_facts.NVIDIA and tensor_core_fp8(key.q_dtype_w):
        sol = BlasLtA8W8Backend().default_solution(key, device, fast=key.M >= FAST_ACCUM_MIN_M)
        if sol is not None:
            return "blaslt", sol
    if scaled_mm_ok(key, device):
        return "torch", SCALED_MM
    if nvidia:
        from .triton import TritonA8W8Backend

        sol = TritonA8W8Backend().default_solution(key, device)
        if sol is not None:
            return "triton", sol
    return "torch", TorchA8W8Backend().torch_choice(key, device)


def a8w8_blockscale(key, device: torch.device) -> tuple[str, Solution]:
    device = torch.device(device)
    if blockwise_ok(key, device):
        return "torch", SCALED_MM_BLOCKWISE
    if _triton_on_gpu(device, (device_facts.NVIDIA, device_facts.AMD)):
        from .triton import TritonBlockscaleBackend

        sol = TritonBlockscaleBackend().default_solution(key, device)
        if sol is not None:
            return "triton", sol
    return "torch", DEQUANT


POLICIES = {
    "a8w8": a8w8,
    "a8w8_bpreshuffle": a8w8,
    "a8w8_blockscale": a8w8_blockscale,
    "a8w8_blockscale_bpreshuffle": a8w8_blockscale,
}
