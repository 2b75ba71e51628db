"""Skinny (small-M, decode-time) 8-bit GEMMs for the a8w8 families: the kernel configs of
kernels/skinny.py run on fp8 e4m3 / int8 operands, scales in the epilogue (kernels/skinny_a8w8.py).

libtype "skinny" (a Triton kernel kind, named apart as in the a16w16 family); a solution's kernel_name
is `a8w8_` + the skinny config string (a8w8_skinny_dot_bn64_bk512_sk2_w4_s3_fx_pdl2), its solidx the
crc of that name. Offered for M <= MAX_TUNE_M; the untuned default's tile runs up to DEFAULT_MAX_M
(quantized/policy.py). The tiles are lib/skinny.py's, each as measured for
bf16 and with twice its block_k (1-byte elements: the same bytes per tile as the bf16 tile), split to
fill one wave with the in-kernel FIXUP reduction, plus the PDL variants on sm90+. The partials +
reduce-kernel twin is not offered (measured within 2% of the fix-up for bf16); its rows still parse
and run. Past lib/skinny.MAX_ROWS rows (no decode GEMM) a runner hands the call to torch's pick.
"""

from __future__ import annotations

import dataclasses

import torch

from ...device import Needs
from ...kernels import skinny as ks
from ...kernels import skinny_a8w8 as k8
from ...kernels._common import pdl_enabled
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib.quant_support import OUT_DTYPES, tensor_core_fp8
from ..lib.skinny import DOT_TILES, GEMV_TILES, MAX_ROWS, Shape, device_limits, smem_bytes, tile_config, tile_configs
from ..lib.skinny import compile_items as skinny_compile_items
from ..lib.triton_tiles import compile_in_workers
from .pytorch import NATIVE, TorchA8W8Backend
from .triton_tg import standins

MAX_TUNE_M = 16  # candidates are offered up to here
DEFAULT_MAX_M = 64  # the default tile runs (and a row may name a skinny kernel) up to here: one M tile
PREFIX = "a8w8_"
DOT_TILES_8BIT = tuple(dict.fromkeys(t for bn, bk, w, s in DOT_TILES for t in ((bn, bk, w, s), (bn, 2 * bk, w, s))))
GEMV_TILES_8BIT = tuple(dict.fromkeys(t for bn, bk, w in GEMV_TILES for t in ((bn, bk, w), (bn, 2 * bk, w))))


def configs(key, device: torch.device) -> list[ks.SkinnyConfig]:
    """The skinny configs offered for an a8w8 key (QuantKey)."""
    shape = Shape(key.M, key.N, key.K, 1)
    return tile_configs(shape, device, DOT_TILES_8BIT, GEMV_TILES_8BIT, reduce_kernel=False)


def config_ok(cfg: ks.SkinnyConfig) -> bool:
    """Not a config an 8-bit GEMM must run: the non-deterministic atomic reduction, a dot step shallower than 32."""
    return cfg.reduce != ks.REDUCE_ATOMIC and not (cfg.uses_dot and cfg.block_k < k8.DOT_MIN_BLOCK_K)


def parse(kernel_name: str, prefix: str = PREFIX, ok=config_ok) -> ks.SkinnyConfig | None:
    """The config a `<prefix>skinny_...` name spells; None for anything else or a config `ok` refuses."""
    if not kernel_name.startswith(prefix):
        return None
    cfg = ks.SkinnyConfig.parse(kernel_name[len(prefix) :])
    return cfg if cfg is not None and ok(cfg) else None


def solution(cfg: ks.SkinnyConfig, prefix: str = PREFIX) -> Solution:
    name = prefix + cfg.name
    return Solution("skinny", name, stable_solidx(name), cfg.split_k)


# What an untuned 8-bit key at M <= MAX_TUNE_M runs on an NVIDIA GPU (quantized/policy.py). On an H100
# the 8-bit skinny kernels won all 72 decode points (fp8 and int8, 12 shapes x M 1, 8, 16:
# benchmarks/results/h100/a8w8_vs_bf16/decode_fp8_int8.md), 1.6x over torch._scaled_mm; the
# 64-wide, 512-deep dot tile (4 warps; 3 stages won 31, 4 stages 16) won 47 of them, each with the
# split lib/skinny.py's one-wave rule picks (1 where N / 64 tiles fill most SMs, 2 for N 4096 x
# K 14336, 6 for N 1280). PDL variants won 51 of 72; pdl2 runs plain where PDL is off.
DEFAULT_TILE = ("dot", 64, 512, 4, 3)
DEFAULT_PDL = 2


def default_config(key, device: torch.device) -> ks.SkinnyConfig | None:
    """The DEFAULT_TILE config for `key` (None outside the skinny rows or when it does not fit)."""
    if not (key_ok(key, DEFAULT_MAX_M) and config_ok(ks.SkinnyConfig(*DEFAULT_TILE[:3], 1, *DEFAULT_TILE[3:]))):
        return None
    sms, smem, smem_sm = device_limits(device)
    cfg = dataclasses.replace(tile_config(*DEFAULT_TILE, Shape(key.M, key.N, key.K, 1), sms, smem_sm), pdl=DEFAULT_PDL)
    return cfg if smem_bytes(cfg, 1) <= smem else None


def key_ok(key, max_m: int = MAX_TUNE_M) -> bool:
    q_ok = key.q_dtype_w == torch.int8 or tensor_core_fp8(key.q_dtype_w)
    return q_ok and key.outdtype in OUT_DTYPES and 0 < key.M <= max_m and key.N > 0 and 0 < key.K and (
        key.N * key.K < 2**31)  # fmt: skip


def _torch_runner(key, device: torch.device) -> Runner:
    return TorchA8W8Backend().make_runner(NATIVE, key, device)


class SkinnyA8W8Backend(Backend):
    name = "skinny"
    family = "a8w8"
    needs = Needs(triton=True)
    prefix = PREFIX  # a subclass for another scale scheme overrides prefix, config_ok, configs, runner, warmup
    config_ok = staticmethod(config_ok)
    configs = staticmethod(configs)

    def parse(self, kernel_name: str) -> ks.SkinnyConfig | None:
        return parse(kernel_name, self.prefix, self.config_ok)

    def runner(self, cfg: ks.SkinnyConfig, key, device: torch.device) -> Runner:
        return make_runner(cfg, key, device, k8.check_operands, ks.scale_code, lambda k: _torch_runner(k, device))

    def warmup(self, cfg: ks.SkinnyConfig, key, device: torch.device) -> None:
        """Compile `cfg` for `key` now (one launch on stand-in operands with key's M and K), so a runner
        first called inside a CUDA-graph capture compiles nothing there."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        xq, wq, xs, ws, bias, y = standins(key, device)  # M's twin (<= DEFAULT_MAX_M), N's 16/17-row twin
        if cfg.pdl and not pdl_enabled(device):
            cfg = dataclasses.replace(cfg, pdl=0)  # as make_runner runs it
        ks.launch(cfg, xq, wq, bias, y, ks.new_counters(cfg, wq.shape[0], xq.shape[0], device), scales=(xs, ws))

    def key_ok(self, key) -> bool:
        return key_ok(key)

    def runs_key(self, key) -> bool:
        """Whether a row or the default may run one of this backend's kernels for `key`: up to
        MAX_TUNE_M rows as offered, and the per-row / per-tensor scale kinds (this prefix) up to
        DEFAULT_MAX_M, where the untuned default runs them."""
        return self.key_ok(key) or (self.prefix == PREFIX and key_ok(key, DEFAULT_MAX_M))

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # launch plans are made per M inside the runner

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not self.key_ok(key):
            return []
        return [solution(c, self.prefix) for c in self.configs(key, torch.device(device))]

    def default_solution(self, key, device: torch.device) -> Solution | None:
        cfg = default_config(key, torch.device(device)) if self.prefix == PREFIX else None
        return None if cfg is None else solution(cfg, self.prefix)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        cfg = self.parse(kernel_name)
        return None if cfg is None else solution(cfg, self.prefix)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if solution.libtype != self.name or not self.runs_key(key):
            return False
        cfg = self.parse(solution.kernel_name)
        if cfg is None:
            return False
        return smem_bytes(cfg, 1) <= device_limits(torch.device(device))[1]

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        cfg = self.parse(solution.kernel_name)
        if cfg is None or not self.supports(solution, key, device):
            raise ValueError(f"skinny {self.family}: solution {solution.describe()} cannot run {key.describe()} on "
                             f"{device}")  # fmt: skip
        device = torch.device(device)
        run = self.runner(cfg, key, device)
        self.warmup(cfg, key, device)
        return run

    def compile_items(self, jobs: list, scope=None) -> list[tuple[str, tuple]]:
        return skinny_compile_items(jobs, parse=self.parse)

    def precompile(self, jobs: list, device: torch.device, workers: int = 8, share: tuple[int, int] = (0, 1)) -> list:
        """Compile every (config, key) in `workers` processes; they fill Triton's on-disk cache, so the
        tuner then loads them."""
        return compile_in_workers(type(self), self.compile_items(jobs), device, workers, share)


class SkinnyA8W8BPreshuffleBackend(SkinnyA8W8Backend):
    family = "a8w8_bpreshuffle"  # on NVIDIA the pre-shuffled weight is the plain [N, K] one


def make_runner(cfg: ks.SkinnyConfig, key, device: torch.device, check, code_of, fallback) -> Runner:
    """A runner of `cfg` for `key`'s N and K, any M: run(xq, wq, xs, ws[, bias]). check(xq, wq, xs, ws,
    [bias,] cfg) validates a new M's operands, code_of((xs, ws)) gives its scale code (ks.scale_code),
    fallback(key at M) the runner past MAX_ROWS rows."""
    if cfg.pdl and not pdl_enabled(device):
        cfg = dataclasses.replace(cfg, pdl=0)  # same kernel, plain launch
    n, k, out_dtype = key.N, key.K, key.outdtype
    # The FIXUP counters live as long as the runner (back at 0 after every launch): one runner must
    # not run on two streams at the same time.
    counters = ks.new_counters(cfg, n, MAX_ROWS, device)
    plans: dict[tuple, ks.LaunchPlan] = {}
    large: dict[int, Runner] = {}  # past MAX_ROWS rows this is no decode GEMM: `fallback` runs it

    def run(xq, wq, xs, ws, *bias):
        m = xq.shape[0]
        if wq.shape != (n, k) or xq.shape[1] != k:
            raise ValueError(f"skinny {cfg.name} runner for N={n} K={k} called with xq {tuple(xq.shape)}, "
                             f"wq {tuple(wq.shape)}")  # fmt: skip
        if m > MAX_ROWS:
            if m not in large:
                large[m] = fallback(key._replace(M=m))
            return large[m](xq, wq, xs, ws, *bias)
        code = code_of((xs, ws))
        plan = plans.get((m, code, xq.dtype))
        if plan is None:
            check(xq, wq, xs, ws, *bias, cfg)
            plan = plans[(m, code, xq.dtype)] = ks.make_plan(cfg, m, n, k, xq.dtype, code)
        y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
        return ks.launch(cfg, xq, wq, bias[0] if bias else None, y, counters, plan, (xs, ws), code == ks.SCALE_BLOCKS)

    return run


BACKENDS = (SkinnyA8W8Backend(), SkinnyA8W8BPreshuffleBackend())
