"""Triton GEMM tile machinery shared by the Triton backends of several families: the tile lists, the
shared-memory fit, split-K and wave rules, `config_space` (the a16w16 kernel's configs for a key, also
the 8-bit and batched spaces), config <-> solution naming, and compiling configs in worker processes.

A config's solution is named by the config string (`tg_bm128_bn128_bk64_g8_w8_s4_sk1`, see
kernels/triton_gemm.py) with solidx its crc, so a table row means the same kernel after a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ... import child_process
from ...device import facts
from ...kernels._common import pdl_enabled
from ...kernels.tile_config import GemmTileConfig
from ...kernels.triton_gemm import TensorDescriptor, TGConfig, TGKernel, parse_config
from ...keys import GemmKey
from ..base import Backend, Solution, stable_solidx

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the 16/32-bit kernels take


class Hardware(NamedTuple):
    sms: int
    smem: int  # bytes of shared memory one program may use
    tma: bool  # Hopper or newer with a Triton that has host TMA descriptors
    pdl: bool = False  # programmatic dependent launch (sm90+ CUDA, GEMMTUNE_PDL not 0)


def hardware(device: torch.device) -> Hardware:
    f = facts(device)
    hopper = not f.rocm and (f.capability >= (9, 0) or device.type != "cuda")
    return Hardware(f.sms, f.smem_per_block, hopper and TensorDescriptor is not None, pdl_enabled(device))


def next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (BM, BN, BK, warps, stages) for 2-byte inputs. Weight-streaming tiles for small M (BM is filled in
# from M), and compute tiles for larger M; taken from Triton's Hopper tutorials and vLLM/SGLang tables.
STREAM_TILES = [
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (128, 128, 4, 4),
    (128, 64, 4, 5),
    (256, 64, 8, 4),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (32, 256, 4, 4),
    (32, 256, 4, 6),
    (32, 128, 4, 6),
]
MID_TILES = [
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4),
]
COMPUTE_TILES = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
]
# 8-bit operands (a8w8 on this kernel, backends/a8w8_tg.py; offered above M = 32): 128-deep K steps
# (128 bytes, the bf16 tiles' 64) on the large tiles; 64-row tiles beside them up to M = 128.
EIGHT_BIT_TILES = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
               (256, 128, 128, 8, 3)]  # fmt: skip
EIGHT_BIT_SHORT_TILES = [(64, 128, 128, 4, 4), (64, 256, 128, 8, 3)]
# int8 only: Triton (3.9 checked, sm_90 PTX) keeps an int32-accumulating wgmma synchronous (a wait for
# it after every K step; fp32 accumulators stay one step in flight), so each step idles the tensor
# cores once. 256-deep steps halve those waits per MAC (TMA variants only, to keep the space small).
INT8_DEEP_TILES = [(128, 128, 256, 8, 3), (128, 256, 256, 8, 2)]
SPLITS = (2, 3, 4, 5, 6, 8, 10, 12, 16)
SPLIT_MODES = ("f", "r")  # in-kernel fixup, separate reduce kernel
SMEM_MARGIN = 4 * 1024  # barriers and the epilogue's scratch
# Up to this M a GEMM is short enough (5-30 us) that a launch's fixed cost shows, so each config also
# comes as a programmatic-dependent-launch variant (pdl2 with a weight prefetch; pdl1 with TMA).
PDL_MAX_M = 256


def tiles_for(key: GemmKey) -> list[tuple[int, int, int, int, int]]:
    M = key.M
    if key.dtype.itemsize == 1:
        deep = INT8_DEEP_TILES if key.dtype == torch.int8 and M > 128 else []
        return EIGHT_BIT_TILES + (EIGHT_BIT_SHORT_TILES if M <= 128 else []) + deep
    if M <= 64:  # weight streaming: one row-tile as tall as M
        bm = max(16, next_pow2(M))
        tiles = [(bm, *t) for t in STREAM_TILES]
    elif M <= 256:
        tiles = [(64, *t) for t in STREAM_TILES] + [t for t in MID_TILES if t[0] <= next_pow2(M)]
    else:
        tiles = list(COMPUTE_TILES)
    if key.dtype.itemsize == 4:  # same bytes per stage for fp32
        tiles = [(bm, bn, max(16, bk // 2), w, s) for bm, bn, bk, w, s in tiles]
    return list(dict.fromkeys(tiles))


def fits(cfg: TGConfig, key: GemmKey, hw: Hardware) -> bool:
    if cfg.smem_bytes(key.dtype.itemsize) + SMEM_MARGIN > hw.smem:
        return False
    if cfg.bm > max(64, next_pow2(key.M)):  # a tile far taller than M only computes padding
        return False
    return cfg.bn <= max(32, next_pow2(key.N)) and cfg.bk <= max(32, next_pow2(key.K))


def runs_here(cfg: TGConfig, key: GemmKey, hw: Hardware) -> bool:
    """Can the config run `key` on hardware `hw` at all: its buffers fit shared memory, and a TMA config
    has TMA and rows of whole 16-byte steps."""
    if cfg.smem_bytes(key.dtype.itemsize) + SMEM_MARGIN > hw.smem:
        return False
    return not cfg.tma or (hw.tma and (key.K * key.dtype.itemsize) % 16 == 0)


def split_factors(tiles: int, k_tiles: int, sms: int) -> list[int]:
    """Split-K factors that bring a short grid to about one and about two full waves, each split
    keeping >= 4 K-tiles; [] when splitting cannot help."""
    ok = [s for s in SPLITS if k_tiles // s >= 4 and tiles * s <= 2.2 * sms]
    if not ok or tiles >= sms:
        return []
    one = [s for s in ok if tiles * s >= 0.8 * sms]
    two = [s for s in ok if tiles * s >= 1.6 * sms]
    return sorted({min(one) if one else max(ok), *([min(two)] if two else [])})


def wave_efficiency(programs: int, sms: int) -> float:
    """Busy fraction of the SMs over the waves `programs` equal programs take (1.0: a full last wave)."""
    return programs / (cdiv(programs, sms) * sms)


WAVE_GAIN = 0.1  # how much a split must lift the wave efficiency to be worth timing
WAVE_NEAR = 0.05  # a split this close to the best one's efficiency is as good (and splits less)
WAVE_MIN_K_TILES = 8  # K tiles each split keeps: its partial store and sum stay small beside them


def wave_split_factors(tiles: int, k_tiles: int, sms: int, most: int = 2) -> list[int]:
    """For a grid of several waves whose last one is poor: up to `most` split-K factors, smallest
    first, that raise the wave efficiency by >= WAVE_GAIN to within WAVE_NEAR of the best any split
    reaches (a larger split only adds partial sums), each split keeping >= WAVE_MIN_K_TILES K-tiles."""
    if tiles < sms:
        return []
    base = wave_efficiency(tiles, sms)
    ok = [s for s in SPLITS if k_tiles // s >= WAVE_MIN_K_TILES]
    gain = [s for s in ok if wave_efficiency(tiles * s, sms) >= base + WAVE_GAIN]
    best = max((wave_efficiency(tiles * s, sms) for s in gain), default=0.0)
    return [s for s in gain if wave_efficiency(tiles * s, sms) >= best - WAVE_NEAR][:most]


def config_space(key: GemmKey, hw: Hardware, cls: type[TGConfig] = TGConfig) -> list[TGConfig]:
    """The configs worth timing for `key` on hardware `hw` (see the module docstring for the pruning), as
    `cls` (a TGConfig subclass names another family's configs: 8-bit ones take key.dtype int8)."""
    out: list[TGConfig] = []
    tma_ok = hw.tma and (key.K * key.dtype.itemsize) % 16 == 0
    for bm, bn, bk, warps, stages in tiles_for(key):
        base = cls(bm, bn, bk, 8, warps, stages)
        if not fits(base, key, hw):
            continue
        tiles = cdiv(key.M, bm) * cdiv(key.N, bn)
        splits = split_factors(tiles, cdiv(key.K, bk), hw.sms)
        variants: list[TGConfig] = []
        if tiles >= hw.sms // 2:  # enough programs to keep most SMs busy without splitting K
            variants.append(base)
        if tiles > hw.sms:  # several waves: a persistent grid saves launch and tail cost
            variants.append(cls(bm, bn, bk, 8, warps, stages, persistent=True))
        for split in splits:
            variants += [cls(bm, bn, bk, 8, warps, stages, split, mode) for mode in SPLIT_MODES]
        deep = key.dtype == torch.int8 and (bm, bn, bk, warps, stages) in INT8_DEEP_TILES  # TMA only
        if deep and not tma_ok:
            continue
        for cfg in variants:
            if not deep:
                out.append(cfg)
            if tma_ok:
                out.append(cls(**{**cfg.__dict__, "tma": True}))
        if key.dtype.itemsize == 1:  # 8-bit keys only, so the bf16 tuning time stays as it is
            out += _8bit_extras(cls(bm, bn, bk, 8, warps, stages, tma=tma_ok), tiles, key, hw)
    if hw.pdl and key.M <= PDL_MAX_M:
        out += [cls(**{**c.__dict__, "pdl": 1 if c.tma else 2}) for c in out]
    return out


def _8bit_extras(base: TGConfig, tiles: int, key: GemmKey, hw: Hardware) -> list[TGConfig]:
    """An 8-bit tile's extra variants: split-K by the best wave_split_factors factor (in-kernel fixup,
    TMA where usable) where a grid of several waves ends in a poor one, and the flattened persistent
    grid (TMA, 3-stage tiles)."""
    cls = type(base)
    fields = {**base.__dict__, "sk_mode": "f"}
    splits = wave_split_factors(tiles, cdiv(key.K, base.bk), hw.sms, most=1)
    extras = [cls(**{**fields, "split_k": s}) for s in splits]
    if tiles > hw.sms and base.tma and base.stages == 3:  # one pipeline depth: flattening adds a buffer
        extras.append(cls(**{**base.__dict__, "persistent": True, "flatten": True}))
    return [c for c in extras if fits(c, key, hw)]


def twin(n: int) -> int:
    """A small size Triton specializes exactly like n (n == 1, n % 16 == 0, or neither)."""
    return n if n <= 16 else (16 if n % 16 == 0 else 17)


def config_solution(cfg: GemmTileConfig) -> Solution:
    """A Triton tile config as a solution: the kernel name is the config's name, solidx its hash."""
    return Solution("triton", cfg.name, stable_solidx(cfg.name), cfg.split_k)


def solution_from_name(parse: Callable[[str], GemmTileConfig | None], kernel_name: str, solidx: int) -> Solution | None:
    """The solution a table row's kernel name spells (None when `parse` does not know it); the name
    decides, a stale solidx is only logged."""
    cfg = parse(kernel_name)
    if cfg is None:
        return None
    if solidx != stable_solidx(cfg.name):
        log.info("triton row %s has solidx %s, expected %s; the name decides", kernel_name, solidx,
                 stable_solidx(cfg.name))  # fmt: skip
    return config_solution(cfg)


def compile_stand_in(key):
    """A key whose first call compiles the same kernels as `key`'s on far less memory: N specializes
    only as twin(N) does. Each compile process holding a full lm_head-sized weight ran a 16-process
    precompile out of memory on an 80 GB GPU."""
    return key._replace(N=twin(key.N)) if hasattr(key, "_replace") and hasattr(key, "N") else key


class CompileItem(NamedTuple):
    """One kernel to compile ahead: its name, the key it is built for, and the class that builds it: a backend
    (its runner for the solution the name names, run once if its kernels compile on the first call), or a
    builder whose build_item(name, key, device) compiles what a name of its own names (a backend's
    compile_items may name one: items that are no solution of the backend)."""

    name: str
    key: tuple
    backend: type


def _precompile_worker(args):
    backend_cls, names, keys, device_str = args
    backend = backend_cls()
    device = torch.device(device_str)
    build = getattr(backend, "build_item", None)
    failed = []
    for name, key in zip(names, keys, strict=True):
        try:
            if build is not None:
                build(name, key, device)
                continue
            first_call = getattr(backend, "compiles_on_first_call", False)  # its kernels compile when first run
            if first_call:
                key = compile_stand_in(key)
            run = backend.make_runner(backend.solution_from_row(0, name, 0), key, device)
            if first_call:
                from ...families import get as family

                run(*family(getattr(backend, "family", "a16w16")).make_inputs(key, device, 1, 0)[0])
        except Exception as exc:  # noqa: BLE001 - reported back, the tuner drops the config
            failed.append((name, key, f"{type(exc).__name__}: {exc}"))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return failed


def _compile_one(args):
    """One item in a pool process: (its number, failures, seconds spent, the process id)."""
    number, item, device_str = args
    t0 = time.perf_counter()
    failed = _precompile_worker((item.backend, [item.name], [item.key], device_str))
    return number, failed, time.perf_counter() - t0, os.getpid()


def compile_streaming(items: list[CompileItem], device: torch.device, workers: int,
                      on_done: Callable[[int, list, float, int], None]) -> None:  # fmt: skip
    """Build `items` in `workers` processes (child_process: gemmtune's own entry, never the caller's main
    module), handed out one at a time in list order (so the first items are done first, whatever each
    costs), calling on_done(number in the list, failures, seconds, process id) as each finishes. Returns
    when all are done."""
    args = [(i, item, str(device)) for i, item in enumerate(items)]
    results = child_process.map_unordered(f"{__name__}:_compile_one", args, workers)
    with contextlib.closing(results):  # on_done may raise (a cancel): the processes end then, not at GC
        for number, failed, seconds, pid in results:
            on_done(number, failed, seconds, pid)


def compile_all(items: list[CompileItem], device: torch.device, workers: int,
                busy: list[float] | None = None) -> list:  # fmt: skip
    """Build `items` (compile_streaming) and return when all are done: [(name, key, error)] for those that
    failed; each process's busy seconds are appended to `busy`."""
    failures: list = []
    per_process: dict[int, float] = {}

    def done(number, failed, seconds, pid):
        failures.extend(failed)
        per_process[pid] = per_process.get(pid, 0.0) + seconds

    compile_streaming(items, device, workers, done)
    if busy is not None:
        busy += list(per_process.values())
    return failures


def compile_in_workers(backend_cls: type[Backend], items: list[tuple[str, tuple]], device: torch.device,
                       workers: int, share: tuple[int, int] = (0, 1)) -> list:  # fmt: skip
    """Build `backend_cls`'s runner for each (kernel name, key) of this process's part in a pool of
    `workers` spawned processes: the share (i, n) takes every n-th of the items in a fixed order, so the
    n processes sharing a cache (a host's ranks, each listing the same items) build each once. Returns
    [(name, key, error)] for those that failed."""
    own = sorted((CompileItem(name, key, backend_cls) for name, key in items), key=lambda it: (it.name, repr(it.key)))
    return compile_all(own[share[0] :: share[1]], device, workers)


def tile_kernel(backend: Backend, solution: Solution, key, device: torch.device) -> TGKernel:
    """The Triton GEMM kernel `solution` names for `key` (an a16w16 or epilogue key), ValueError if `backend`
    does not support it; a PDL config runs as its plain twin where PDL is off."""
    cfg = parse_config(solution.kernel_name)
    if cfg is None or not backend.supports(solution, key, device):
        raise ValueError(f"{backend.name} cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
    if cfg.pdl and not pdl_enabled(device):
        cfg = TGConfig(**{**cfg.__dict__, "pdl": 0})  # the same kernel, plain launch
    return TGKernel(cfg, device, lock_tiles=cdiv(max(key.M, 1), cfg.bm) * cdiv(key.N, cfg.bn))
