"""What an untuned a8w8 key runs (the family's policy, backends/quantized/policy.py), and the 8-bit-only
additions to the Triton GEMM candidate space (backends/lib/triton_tiles.py: split-K against a poor last
wave, the flattened persistent grid, int8's 256-deep tiles).

On the CPU the choice is checked as it resolves on an H100 (the device vocabulary patched to answer an
NVIDIA sm90 GPU; device facts off a GPU are an H100's), against the measured winners in
benchmarks/results/h100/a8w8_vs_bf16/: the skinny default must pick the winner's split wherever its tile
won a decode point, the int8 prefill default must be the config that won most points. On a GPU: the new
candidates pass the family check and replay bit-equal in a CUDA graph, and an untuned key at M = 8 and 1024
runs its default, captured in a graph on its first call, within the family's threshold of the dequantized
reference.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_replays_bit_equal, check_every_candidate
from tiers import tiered

from gemmtune.families.quantized import FP8, QuantKey

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/h100/a8w8_vs_bf16"
CPU = torch.device("cpu")
_Q = {"int8": torch.int8, "fp8": FP8}


def _rows(name: str) -> list[dict]:
    """The per-point rows (fmt, M, N, K, winner) of a quant benchmark table."""
    out = []
    for line in (RESULTS / name).read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 16 and cells[2] in _Q:
            out.append({"q": _Q[cells[2]], "M": int(cells[3]), "N": int(cells[4]), "K": int(cells[5]),
                        "winner": cells[15].split(":", 1)[1]})  # fmt: skip
    return out


def _choice(key, device) -> tuple[str, str]:
    """(backend name, kernel name) of what the a8w8 policy runs for an untuned `key`."""
    from gemmtune.backends.quantized import policy

    name, sol = policy.a8w8(key, device)
    assert sol.libtype == name  # the row names the backend that runs it
    return name, sol.kernel_name


@pytest.fixture
def h100(monkeypatch):
    """The a8w8 policy as it runs on an H100: the device vocabulary answers an NVIDIA sm90 GPU (a CUDA
    build, not ROCm) whatever device it is asked about."""
    from gemmtune import device
    from gemmtune.kernels import _common

    monkeypatch.setattr(device, "vendor", lambda d=None: device.NVIDIA)
    monkeypatch.setattr(device, "facts", lambda d=None: device.OFF_GPU._replace(capability=(9, 0)))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(_common, "_pdl_on", {})  # its per-device answers must not outlive the patch
    return _choice


# ---- split-K against a poor last wave ------------------------------------------------------------


def test_wave_split_factors():
    from gemmtune.backends.lib.triton_tiles import wave_efficiency, wave_split_factors

    assert wave_efficiency(320, 132) == pytest.approx(320 / 396) and wave_efficiency(264, 132) == 1.0
    # Qwen3-32B down, M 1024: 128x128 tiles 320 (2.4 waves, 0.81) -> 2 splits (0.97; 16 reach 0.99)
    assert wave_split_factors(320, 200, 132) == [2, 4] and wave_split_factors(320, 200, 132, most=1) == [2]
    # 128x256 tiles 160 (0.61): 2 splits 0.81, 3 0.91, 4 0.97 (the best, as 8 and 12)
    assert wave_split_factors(160, 200, 132) == [4, 8]
    assert wave_split_factors(160, 200, 132, most=1) == [4]
    assert wave_split_factors(160, 24, 132) == [3]  # each split keeps >= 8 K-tiles: 2 (0.81) or 3 (0.91)
    assert wave_split_factors(320, 15, 132) == []  # too short a K for any split
    assert wave_split_factors(264, 200, 132) == []  # two full waves
    assert wave_split_factors(250, 200, 132) == []  # 0.95 already: no split gains 0.1
    assert wave_split_factors(100, 200, 132) == []  # one partial wave: split_factors' case


def _space(m, n, k, dtype):
    from gemmtune.backends.lib.triton_tiles import Hardware, config_space
    from gemmtune.keys import GemmKey

    return config_space(GemmKey(m, n, k, False, dtype, torch.bfloat16), Hardware(132, 227 * 1024, True, False))


def test_8bit_extras_only_for_1_byte_keys():
    from gemmtune.backends.lib.triton_tiles import SMEM_MARGIN

    names = {c.name for c in _space(1024, 5120, 25600, torch.int8)}
    assert "tg_bm128_bn128_bk128_g8_w8_s3_sk2f_tma" in names  # 320 tiles: the wave split
    assert "tg_bm128_bn256_bk128_g8_w8_s3_sk4f_tma" in names
    assert "tg_bm128_bn128_bk128_g8_w8_s3_sk1_pf_tma" in names  # flattened persistent, 3 stages only
    assert "tg_bm128_bn128_bk128_g8_w8_s4_sk1_pf_tma" not in names
    assert "tg_bm128_bn128_bk256_g8_w8_s3_sk1_tma" in names and "tg_bm128_bn128_bk256_g8_w8_s3_sk1" not in names
    for cfg in _space(1024, 5120, 25600, torch.int8):
        assert cfg.smem_bytes(1) + SMEM_MARGIN <= 227 * 1024, cfg.name
        assert not cfg.flatten or (cfg.persistent and cfg.tma), cfg.name
    fp8 = _space(1024, 5120, 25600, FP8)
    assert any(c.flatten for c in fp8) and all(c.bk == 128 for c in fp8)  # the deep tiles are int8's
    assert any(c.split_k > 1 for c in fp8)
    # 2-byte keys keep their space: no split of a grid of several waves, no flattened grid
    for m, n, k in [(1024, 5120, 25600), (4096, 1280, 8192), (1024, 5120, 8192)]:
        bf16 = _space(m, n, k, torch.bfloat16)
        assert bf16 and not any(c.flatten for c in bf16)
        assert all(c.split_k == 1 for c in bf16 if (-(-m // c.bm)) * (-(-n // c.bn)) >= 132)


@pytest.mark.parametrize(
    "name", ["a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_pf_tma", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_pf"]
)
def test_flattened_names_round_trip(name):
    from gemmtune.kernels.a8w8_tg import parse_config

    cfg = parse_config(name)
    assert cfg.flatten and cfg.persistent and cfg.name == name
    assert cfg.smem_bytes(1) == 3 * 256 * 128 + 32 * 1024


def test_flatten_needs_the_persistent_grid():
    from gemmtune.kernels.a8w8_tg import A8W8TGConfig, parse_config

    assert parse_config("a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk2f_pf") is None
    with pytest.raises(ValueError, match="persistent"):
        A8W8TGConfig(128, 128, 128, 8, 8, 3, flatten=True).validate()


# ---- untuned defaults ----------------------------------------------------------------------------


def test_skinny_default_takes_the_winners_split_where_its_tile_won(h100):
    from gemmtune.backends.quantized.triton_skinny import DEFAULT_TILE

    tile = "a8w8_skinny_{}_bn{}_bk{}_".format(*DEFAULT_TILE[:3])
    rows = [r for r in _rows("decode_fp8_int8.md") if r["winner"].startswith(tile)]
    assert len(rows) >= 40  # 47 of the 72 fp8 / int8 decode points
    for r in rows:
        key = QuantKey(r["M"], r["N"], r["K"], r["q"], "per_token", False, torch.bfloat16)
        lib, name = h100(key, CPU)
        split = re.search(r"_sk(\d+)", r["winner"]).group(1)
        assert lib == "skinny" and name.startswith(f"{tile}sk{split}_w4_s3"), (key.describe(), name, r["winner"])


def test_int8_prefill_default_is_the_config_that_won_most_points(h100):
    from gemmtune.backends.quantized import triton_tg as a8w8_tg

    rows = [r for r in _rows("prefill_int8.md") if r["q"] == torch.int8]
    assert len(rows) == 36
    most = collections.Counter(r["winner"] for r in rows).most_common(1)[0][0]
    assert a8w8_tg.DEFAULT.name == most
    for r in rows:
        key = QuantKey(r["M"], r["N"], r["K"], torch.int8, "per_token", False, torch.bfloat16)
        assert h100(key, CPU) == ("triton", most)


@pytest.mark.parametrize(
    "key, want",
    [
        (QuantKey(1, 1280, 8192, FP8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk6_w4_s3_fx_pdl2")),
        (QuantKey(16, 6144, 4096, torch.int8, "per_tensor", True, torch.float16),
         ("skinny", "a8w8_skinny_dot_bn64_bk512_sk1_w4_s3_pdl2")),
        # fp8 at M 17..32 anywhere and 33..64 where the 64-wide tiles fit one wave of 132 SMs (N <= 8448):
        # the skinny default tile; from 133 tiles cuBLASLt (H200 serving band)
        (QuantKey(17, 6144, 4096, FP8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk1_w4_s3_pdl2")),
        (QuantKey(32, 16384, 4096, FP8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk1_w4_s3_pdl2")),
        (QuantKey(64, 8448, 4096, FP8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk1_w4_s3_pdl2")),
        (QuantKey(33, 8512, 4096, FP8), ("torch", "scaled_mm")),
        (QuantKey(64, 12288, 4096, FP8), ("torch", "scaled_mm")),
        (QuantKey(48, 16384, 4096, FP8), ("torch", "scaled_mm")),
        (QuantKey(65, 6144, 4096, FP8), ("torch", "scaled_mm")),
        (QuantKey(1024, 6144, 4096, FP8), ("torch", "scaled_mm")),
        # fp8 at M 17..64 from N 23040: the 64 x 128 tile, unsplit there (H200 band); decode stays skinny
        (QuantKey(24, 28672, 4096, FP8), ("triton", "a8w8_bm64_bn128_bk128_g8_sk1_w4_s4")),
        (QuantKey(64, 51200, 5120, FP8), ("triton", "a8w8_bm64_bn128_bk128_g8_sk1_w4_s4")),
        (QuantKey(16, 28672, 4096, FP8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk1_w4_s3_pdl2")),
        # fp8 at M 65..512, K >= 8192, where 64 x 128 tiles leave most SMs idle: that tile split (H200 band)
        (QuantKey(128, 1280, 8192, FP8), ("triton", "a8w8_bm64_bn128_bk128_g8_sk8_w4_s4")),
        (QuantKey(96, 3840, 11520, FP8), ("triton", "a8w8_bm64_bn128_bk128_g8_sk4_w4_s4")),
        (QuantKey(512, 1280, 8192, FP8), ("triton", "a8w8_bm64_bn128_bk128_g8_sk3_w4_s4")),
        (QuantKey(256, 4480, 15360, FP8), ("torch", "scaled_mm")),  # the rule leaves K whole: cuBLASLt
        (QuantKey(128, 3840, 3840, FP8), ("torch", "scaled_mm")),  # K < 8192
        (QuantKey(1024, 1280, 8192, FP8), ("torch", "scaled_mm")),  # above M 512
        (QuantKey(24, 6144, 4096, torch.int8), ("triton", "a8w8_bm16_bn64_bk256_g1_sk1_w4_s4")),
        (QuantKey(33, 6144, 4096, torch.int8), ("triton", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma")),
        (QuantKey(1024, 1000, 1000, torch.int8), ("triton", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1")),  # no TMA
        # cuBLASLt's rowwise fp8 writes bf16 only: the older Triton kernel's heuristic tile
        (QuantKey(1024, 6144, 4096, FP8, "per_token", False, torch.float32),
         ("triton", "a8w8_bm128_bn256_bk128_g8_sk1_w8_s3")),
    ],
    ids=lambda v: v.describe().replace(" ", "_") if isinstance(v, QuantKey) else "",
)  # fmt: skip
def test_native_choice_on_an_h100(h100, key, want):
    assert h100(key, CPU) == want


def test_fp8_skinny_band_follows_the_sm_count(h100, monkeypatch):
    """M 33..64 keeps the skinny tile while its 64-wide N tiles fit one wave of *this* GPU's SMs."""
    from gemmtune import device

    key = QuantKey(48, 8192, 4096, FP8)  # 128 tiles
    assert h100(key, CPU)[0] == "skinny"  # 132 SMs
    monkeypatch.setattr(device, "facts", lambda d=None: device.OFF_GPU._replace(capability=(9, 0), sms=108))
    assert h100(key, CPU) == ("torch", "scaled_mm")  # 108 SMs: a second wave
    assert h100(key._replace(N=6912), CPU)[0] == "skinny"  # 108 tiles: one wave again
    assert h100(key._replace(M=32), CPU)[0] == "skinny"  # M <= 32 keeps it at any N


def test_native_choice_off_cuda_and_on_rocm(h100, monkeypatch):
    from gemmtune import device

    monkeypatch.setattr(device, "vendor", lambda d=None: device.AMD)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert h100(QuantKey(8, 4096, 4096, torch.int8), CPU) == ("torch", "dequant")  # no skinny; _int_mm: M > 16
    assert h100(QuantKey(1024, 4096, 4096, torch.int8), CPU) == ("torch", "int_mm")
    monkeypatch.undo()
    for m in (8, 1024):
        for q in (torch.int8, FP8):
            assert _choice(QuantKey(m, 4096, 4096, q), CPU) == ("torch", "dequant")


def test_native_runner_on_the_cpu_matches_the_reference():
    from gemmtune import backends, families
    from gemmtune.backends.quantized.pytorch import NATIVE

    fam, key = families.get("a8w8"), QuantKey(8, 48, 64, torch.int8, "per_token", True, torch.float32)
    inputs = fam.make_inputs(key, CPU, 1, seed=1)[0]
    y = backends.get("torch", "a8w8").make_runner(NATIVE, key, CPU)(*inputs)
    ref = fam.reference(key, inputs)
    assert ((y.float() - ref).norm() / ref.norm()).item() < fam.error_threshold(key)


# ---- GPU ----------------------------------------------------------------------------------------

# Odd M and N; tiles of 128x128 154 (0.58 of 2 waves): a wave split and the flattened grid are offered.
_WAVE_KEYS = [QuantKey(1300, 1700, 2064, q, "per_token", True, torch.bfloat16) for q in (torch.int8, FP8)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "key", tiered(_WAVE_KEYS, lambda k: k.q_dtype_w == FP8), ids=lambda k: k.describe().replace(" ", "_")
)
def test_gpu_new_candidates_pass_the_family_check_and_replay_bit_equal(gpu, key):
    from gemmtune import backends, families

    sols = check_every_candidate(backends.get("triton", "a8w8"), families.get("a8w8"), key, gpu, "a8w8_tg_")
    names = [s.kernel_name for s in sols]
    assert any("_pf" in n for n in names) and any(re.search(r"_sk\d+f_tma", n) for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("q", ["int8", "fp8"])
@pytest.mark.parametrize("m", [8, 1024])
def test_gpu_untuned_key_runs_its_default(gpu, q, m):
    from gemmtune import backends
    from gemmtune.backends.quantized import policy
    from gemmtune.device import is_rocm

    key = QuantKey(m, 1536, 2048, _Q[q], "per_token", True, torch.bfloat16)
    backend, sol = backends.default("a8w8", key, gpu)
    lib, name = backend.name, sol.kernel_name
    assert sol.libtype == lib
    hopper, rocm = torch.cuda.get_device_capability(gpu) >= (9, 0), is_rocm()
    if m == 8 and not rocm:
        assert lib == "skinny" and name.startswith("a8w8_skinny_dot_bn64_bk512_"), name
    elif q == "int8" and hopper and not rocm:
        assert (lib, name) == ("triton", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma")
    elif q == "fp8" and hopper:  # cuBLASLt: directly where nvmath-python's bindings load (quantized/blaslt.py)
        direct = backends.get("blaslt", "a8w8").default_solution(key, gpu, fast=m >= policy.FAST_ACCUM_MIN_M)
        assert (lib, name) == (("blaslt", direct.kernel_name) if direct else ("torch", "scaled_mm"))
    _replays_and_passes_the_check(backend, sol, key, gpu, seed=m)


@pytest.mark.gpu
def test_gpu_untuned_fp8_short_grid_runs_the_split_tile(gpu):
    from gemmtune import backends

    key = QuantKey(100, 1040, 8208, FP8, "per_token", True, torch.bfloat16)  # odd M, N; K not a 128 multiple
    backend, sol = backends.default("a8w8", key, gpu)
    if torch.cuda.get_device_capability(gpu) >= (8, 9):  # fp8 tensor cores
        assert (backend.name, sol.kernel_name) == ("triton", "a8w8_bm64_bn128_bk128_g8_sk8_w4_s4")
    _replays_and_passes_the_check(backend, sol, key, gpu, seed=7)


def _replays_and_passes_the_check(backend, sol, key, gpu, seed: int) -> None:
    """The runner's first call captured in a CUDA graph replays what eager computes, and passes the family check."""
    from gemmtune import families
    from gemmtune.tuner.check import check_runner

    name = sol.kernel_name
    fam = families.get("a8w8")
    run = backend.make_runner(sol, key, gpu)
    inputs = fam.make_inputs(key, gpu, 1, seed=seed)[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the runner's first call: it must not compile now
        out = run(*inputs)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run(*inputs)
    assert torch.equal(out, eager), name
    verdict = check_runner(run, key, inputs, fam.reference(key, inputs), family=fam)
    assert verdict.ok, (name, verdict.reason)
    assert_replays_bit_equal(run, inputs, eager, name, replays=2)
