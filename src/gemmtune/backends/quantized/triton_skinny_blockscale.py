"""Skinny (small-M, decode-time) fp8 block-scale GEMMs for the a8w8_blockscale families: the kernel
configs of kernels/skinny.py with the block scales applied per K step (kernels/skinny_blockscale.py).

libtype "skinny" (a Triton kernel kind); a solution's kernel_name is `blockscale_` + the skinny config string
(blockscale_skinny_dot_bn64_bk128_sk4_w4_s4_fx_pdl2), its solidx the crc of that name. Offered for
M <= MAX_TUNE_M, fp8 operands. A step must lie in one 128-wide K group and a tile in one 128-row N
block, so the tiles are the 8-bit skinny tiles with block_k 128 (or 64) and block_n <= 128, more
stages making up for the shallower step (the bytes in flight of the a8w8 tiles; not yet measured
one against another), split to fill one wave with the in-kernel FIXUP reduction, plus the PDL
variants on sm90+. Everything else (parsing, support, precompile, the runner) is triton_skinny.py's.
"""

from __future__ import annotations

import torch

from ...kernels import skinny as ks
from ...kernels import skinny_blockscale as kb
from ...quant import formats
from ..base import Runner
from ..lib.skinny import Shape, tile_configs
from .pytorch import NATIVE, TorchBlockscaleBackend
from .triton_skinny import SkinnyA8W8Backend, make_runner

PREFIX = "blockscale_"
# (block_n, block_k, num_warps, num_stages) and (block_n, block_k, num_warps)
DOT_TILES = ((16, 128, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6), (64, 128, 4, 4), (64, 128, 4, 6),
             (64, 128, 8, 6), (64, 64, 4, 8), (128, 128, 4, 4), (128, 128, 8, 4))  # fmt: skip
GEMV_TILES = ((8, 128, 4), (16, 128, 4), (32, 128, 4), (64, 128, 4))


def configs(key, device: torch.device) -> list[ks.SkinnyConfig]:
    """The skinny configs offered for a block-scale key (BlockKey)."""
    return tile_configs(Shape(key.M, key.N, key.K, 1), device, DOT_TILES, GEMV_TILES, reduce_kernel=False)


def _torch_runner(key, device: torch.device) -> Runner:
    return TorchBlockscaleBackend().make_runner(NATIVE, key, device)


class SkinnyBlockscaleBackend(SkinnyA8W8Backend):
    family = "a8w8_blockscale"
    prefix = PREFIX
    config_ok = staticmethod(kb.config_ok)
    configs = staticmethod(configs)
    compiles_on_first_call = True  # launch plans (and so the kernels) are made on the first call

    def key_ok(self, key) -> bool:
        # fp8 only (int8 block scales would need an int32 dot per step): the base takes this build's fp8.
        return key.q_dtype_w != torch.int8 and key.K % formats.BLOCK == 0 and super().key_ok(key)

    def runner(self, cfg: ks.SkinnyConfig, key, device: torch.device) -> Runner:
        return make_runner(cfg, key, device, kb.check_operands, lambda _s: ks.SCALE_BLOCKS,
                           lambda k: _torch_runner(k, device))  # fmt: skip

    def warmup(self, cfg: ks.SkinnyConfig, key, device: torch.device) -> None:
        pass  # compiled on the first call (compiles_on_first_call: the tuner runs each once ahead)


class SkinnyBlockscaleBPreshuffleBackend(SkinnyBlockscaleBackend):
    family = "a8w8_blockscale_bpreshuffle"  # on NVIDIA the pre-shuffled weight is the plain [N, K] one


BACKENDS = (SkinnyBlockscaleBackend(), SkinnyBlockscaleBPreshuffleBackend())
