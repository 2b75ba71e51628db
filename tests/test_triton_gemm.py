"""Triton GEMM family (kernels/triton_gemm.py) and the `triton` backend.

CPU: the kernel logic through the Triton interpreter (fp16/fp32) on odd shapes, bias, strided x, every
variant (plain, split-K reduce / fixup, persistent, TMA), outputs NaN-poisoned first. The interpreter
cases run in one subprocess with TRITON_INTERPRET=1 set before triton is imported, so they work
whatever the rest of the session imported. Run this file as a script with --interp to see them.
GPU (marked gpu): bf16/fp16 against an fp32 reference, and CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import interpreter_gap
from tiers import SWEEP_TIERS

from gemmtune.keys import GemmKey

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Configs covering every code path; small blocks keep the interpreter fast.
INTERP_CONFIGS = [
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1",
    "tg_bm32_bn16_bk32_g2_w4_s2_sk3r",
    "tg_bm16_bn16_bk16_g1_w4_s2_sk4f",
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1_p",
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1_tma",
    "tg_bm32_bn32_bk16_g2_w4_s2_sk2f_tma",
]
# (M, N, K, bias, x layout): N, K not multiples of any block; 'strided' = a column slice of a wider
# tensor, 'transposed' = x with a non-unit K stride (TMA configs copy it first).
INTERP_SHAPES = [
    (37, 45, 70, True, "contiguous"),
    (5, 33, 48, False, "strided"),
    (3, 17, 40, True, "transposed"),
]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _make(m, n, k, bias, layout, dt, device, seed):
    g = torch.Generator().manual_seed(seed)
    cast = lambda t: None if t is None else t.to(dt).to(device)
    if layout == "strided":  # rows further apart than K
        x = cast(torch.randn(m, k + 9, generator=g))[:, 5 : 5 + k]
    elif layout == "transposed":  # K is the strided dimension
        x = cast(torch.randn(k, m, generator=g)).t()
    else:
        x = cast(torch.randn(m, k, generator=g))
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, cast(w), cast(b)


def _interp_case(name: str, dt: str, odt: str, shape) -> dict:
    from gemmtune.kernels.triton_gemm import TGKernel, parse_config, triton_gemm_ref

    m, n, k, bias, layout = shape
    k = k if "_tma" not in name else (k + 7) // 8 * 8  # TMA rows must be 16-byte multiples
    x, w, b = _make(m, n, k, bias, layout, _DT[dt], "cpu", seed=m * 1000 + n + k)
    kern = TGKernel(parse_config(name), torch.device("cpu"), lock_tiles=1)
    y = torch.full((m, n), float("nan"), dtype=_DT[odt])
    kern(x, w, b, y)
    ref = triton_gemm_ref(x.double(), w.double(), None if b is None else b.double(), torch.float64)
    out = {"err": _rel_err(y, ref), "nan": bool(torch.isnan(y).any())}
    # Other values of the same signature: the kept launch (descriptors, copies, partials made anew).
    x2, w2, b2 = _make(m, n, k, bias, layout, _DT[dt], "cpu", seed=m * 1000 + n + k + 1)
    y2 = torch.full((m, n), float("nan"), dtype=_DT[odt])
    kern(x2, w2, b2, y2)
    ref2 = triton_gemm_ref(x2.double(), w2.double(), None if b2 is None else b2.double(), torch.float64)
    out |= {"err_kept": _rel_err(y2, ref2), "nan_kept": bool(torch.isnan(y2).any()), "launches": len(kern._launches)}
    if kern._lock is not None:
        out["lock_clear"] = bool((kern._lock == 0).all())
        y2 = torch.full((m, n), float("nan"), dtype=_DT[odt])
        kern(x, w, b, y2)  # the counters reset themselves: a second call is identical
        out["repeat_equal"] = bool(torch.equal(y, y2))
    return out


def _interp_backend_case() -> dict:
    """The backend's runner path on a 3-D input, with compile-on-make_runner (warmup) in between."""
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.kernels.triton_gemm import triton_gemm_ref

    be = TritonGemmBackend()
    key = GemmKey(6, 40, 48, True, torch.float16, torch.float32)
    sol = be.solution_from_row(0, "tg_bm16_bn16_bk16_g1_w4_s2_sk3f", 3)
    run = be.make_runner(sol, key, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 48, generator=g).half()
    w = (torch.randn(40, 48, generator=g) / 7).half()
    b = torch.randn(40, generator=g).half()
    y = run(x, w, b)
    ref = triton_gemm_ref(x.reshape(6, 48).double(), w.double(), b.double(), torch.float64).view(2, 3, 40)
    return {
        "err": _rel_err(y, ref),
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "available": be.is_available(torch.device("cpu")),
    }


_INTERP_DTYPES = (("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"))


def _interp_tier(tier: str) -> list:
    """(config, dtype, out dtype, shape) of one tier: the default one runs each config with one dtype pair
    (the pairs in turn) on every shape, the slow one the other pairs."""
    return [(name, dt, odt, shape) for i, name in enumerate(INTERP_CONFIGS)
            for j, (dt, odt) in enumerate(_INTERP_DTYPES) for shape in INTERP_SHAPES
            if (j == i % len(_INTERP_DTYPES)) == (tier == "default")]  # fmt: skip


def _case_name(name, dt, odt, shape) -> str:
    return f"{name}|{dt}->{odt}|{shape}"


def _interp_main(tier: str) -> dict:
    gap = interpreter_gap()
    if gap:
        return {"skip": gap}
    res = {_case_name(*c): _interp_case(*c) for c in _interp_tier(tier)}
    if tier == "default":
        res["backend"] = _interp_backend_case()
    return res


@pytest.fixture(scope="module")
def interp(request):
    """The interpreter sweep's results of one tier: (tier, {case: result}); the backend case is the default's."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, __file__, "--interp", request.param]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(res["skip"])
    return request.param, res


@pytest.mark.parametrize("interp", SWEEP_TIERS, indirect=True)
def test_interpreter_all_variants_match_reference(interp):
    tier, res = interp
    cases = {k: v for k, v in res.items() if k != "backend"}
    assert len(_interp_tier("default")) + len(_interp_tier("slow")) == len(INTERP_CONFIGS) * 3 * len(INTERP_SHAPES)
    assert set(cases) == {_case_name(*c) for c in _interp_tier(tier)}
    for case, r in cases.items():
        assert not r["nan"] and not r["nan_kept"], f"{case}: output left unwritten (NaN)"
        tol = 1e-5 if "->fp32" in case and case.split("|")[1].startswith("fp32") else 3e-3
        assert r["err"] < tol, f"{case}: rel err {r['err']:.2e}"
        assert r["err_kept"] < tol and r["launches"] == 1, f"{case}: kept launch rel err {r['err_kept']:.2e}"
        if "lock_clear" in r:
            assert r["lock_clear"] and r["repeat_equal"], f"{case}: split-K counters not reset"


@pytest.mark.parametrize("interp", ["default"], indirect=True)
def test_interpreter_backend_runner(interp):
    r = interp[1]["backend"]
    assert r["available"]
    assert r["shape"] == [2, 3, 40] and r["dtype"] == "torch.float32"
    assert r["err"] < 1e-3


# ---- pure Python: ids and the config space ----------------------------------------------------
def test_config_names_round_trip():
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.backends.base import stable_solidx
    from gemmtune.backends.lib.triton_tiles import Hardware, config_space
    from gemmtune.kernels.triton_gemm import parse_config

    be = TritonGemmBackend()
    hw = Hardware(132, 227 * 1024, True, pdl=True)
    names = set()
    for m in (1, 32, 100, 256, 1024, 8192):
        for cfg in config_space(GemmKey(m, 1280, 8192), hw):
            assert parse_config(cfg.name) == cfg
            sol = be.solution_from_row(stable_solidx(cfg.name), cfg.name, cfg.split_k)
            assert sol.kernel_name == cfg.name and sol.solidx == stable_solidx(cfg.name)
            assert sol.splitk == cfg.split_k
            names.add(cfg.name)
    assert len(names) > 20
    assert any(n.endswith("_tma_pdl1") for n in names) and any(n.endswith("f_pdl2") for n in names)
    assert not any("_pdl" in cfg.name for cfg in config_space(GemmKey(1024, 1280, 8192), hw))  # M > PDL_MAX_M
    for bad in (
        "tg_bm64_bn64_bk64_g8_w4_s3_sk1_tma_pdl2",  # the prefetch reads raw pointers, not TMA
        "tg_bm64_bn64_bk64_g8_w4_s3_sk1_pdl3",
        "tg_bm128",
        "tg_bm96_bn128_bk64_g8_w8_s4_sk1",
        "tg_bm128_bn128_bk64_g8_w8_s4_sk2",
        "tg_bm128_bn128_bk64_g8_w8_s4_sk1f",
        "tg_bm64_bn64_bk64_g8_w4_s3_sk2f_p",
        "tg_bm064_bn64_bk64_g8_w4_s3_sk1",
        "skinny_dot_bn32_bk32_sk1_w4_s2",
    ):
        assert parse_config(bad) is None, bad
        assert be.solution_from_row(0, bad, 0) is None


def test_config_space_is_pruned():
    from gemmtune.backends.lib.triton_tiles import SMEM_MARGIN, Hardware, config_space

    hw = Hardware(132, 227 * 1024, True)
    for m in (32, 64, 128, 256, 512, 1024, 8192):
        for n, k in ((1280, 8192), (8192, 1024), (28672, 4096), (1000, 1000)):
            key = GemmKey(m, n, k)
            space = config_space(key, hw)
            assert space, key
            assert len(space) <= 100, (key, len(space))
            for cfg in space:
                assert cfg.smem_bytes(2) + SMEM_MARGIN <= hw.smem
                assert cfg.bm <= max(64, 1 << (m - 1).bit_length())
                tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
                if cfg.split_k > 1:
                    assert tiles < hw.sms and tiles * cfg.split_k <= 2.2 * hw.sms
                if cfg.persistent:
                    assert tiles > hw.sms
                if cfg.tma:
                    assert (k * 2) % 16 == 0
    # K rows that are not 16-byte multiples get no TMA configs.
    assert not any(c.tma for c in config_space(GemmKey(64, 1000, 1001), hw))
    assert not any(c.tma for c in config_space(GemmKey(64, 1000, 1024), hw._replace(tma=False)))


def test_supports_rejects_what_it_cannot_run():
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.backends.base import Solution

    be = TritonGemmBackend()
    sol = be.solution_from_row(0, "tg_bm64_bn64_bk64_g8_w4_s3_sk1", 0)
    cpu = torch.device("cpu")
    assert be.supports(sol, GemmKey(8, 64, 64), cpu)
    assert not be.supports(sol, GemmKey(8, 64, 64, scaleAB=True), cpu)
    assert not be.supports(Solution("torch", sol.kernel_name, sol.solidx), GemmKey(8, 64, 64), cpu)
    huge = be.solution_from_row(0, "tg_bm256_bn256_bk128_g8_w8_s8_sk1", 0)
    assert not be.supports(huge, GemmKey(8, 64, 64), cpu)  # 1 MiB of shared memory
    with pytest.raises(ValueError, match="cannot run"):
        be.make_runner(huge, GemmKey(8, 64, 64), cpu)


# ---- GPU ---------------------------------------------------------------------------------------
GPU_CONFIGS = [
    "tg_bm64_bn128_bk64_g8_w4_s4_sk1",
    "tg_bm128_bn128_bk64_g8_w8_s4_sk1_p",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3f",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3r",
    "tg_bm128_bn256_bk64_g8_w8_s3_sk1_tma",
    "tg_bm64_bn128_bk128_g8_w4_s4_sk4f_tma",
    "tg_bm32_bn64_bk128_g8_w4_s4_sk1",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3f_pdl2",
    "tg_bm128_bn128_bk64_g8_w8_s4_sk1_p_pdl2",
    "tg_bm64_bn128_bk128_g8_w4_s4_sk4f_tma_pdl1",
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_matches_fp32_reference(gpu, name, dtype):
    from gemmtune.backends.lib.triton_tiles import hardware
    from gemmtune.kernels.triton_gemm import TGKernel, parse_config, triton_gemm_ref

    cfg = parse_config(name)
    if cfg.tma and not hardware(gpu).tma:
        pytest.skip("TMA needs Hopper")
    if cfg.pdl and not hardware(gpu).pdl:
        pytest.skip("programmatic dependent launch needs CUDA sm90+")
    for m, n, k, bias, layout in [
        (37, 1000, 1032, True, "contiguous"),
        (300, 1280, 4096, False, "strided"),
        (1, 8192, 1024, True, "contiguous"),
    ]:
        x, w, b = _make(m, n, k, bias, layout, dtype, gpu, seed=m + n)
        y = torch.full((m, n), float("nan"), dtype=dtype, device=gpu)
        TGKernel(cfg, gpu, lock_tiles=1)(x, w, b, y)
        ref = triton_gemm_ref(x, w, b, torch.float32)
        torch_err = _rel_err(torch.nn.functional.linear(x, w, b), ref)
        assert not torch.isnan(y).any(), (name, m, n, k)
        err = _rel_err(y, ref)
        assert err <= 2 * torch_err + 1e-3, (name, m, n, k, err, torch_err)


@pytest.mark.gpu
def test_gpu_kept_launch_is_the_jit_launch(gpu):
    """A TGKernel's second call of a signature (its kept _Launch: descriptors, partials and copies made
    anew, the compiled kernel's own launcher) computes bit for bit what a first call through JITFunction
    computes, on new values, a misaligned x (TMA copies it) and an epilogue with C and alpha."""
    from gemmtune.backends.lib.triton_tiles import hardware
    from gemmtune.kernels.triton_gemm import TGKernel, parse_config

    for name in GPU_CONFIGS:
        cfg = parse_config(name)
        if (cfg.tma and not hardware(gpu).tma) or (cfg.pdl and not hardware(gpu).pdl):
            continue
        kept = TGKernel(cfg, gpu, lock_tiles=1)
        for seed, offset in ((1, 0), (2, 0), (3, 4)):
            g = torch.Generator(device=gpu).manual_seed(seed)
            base = torch.randn(300 * 1032 + offset, device=gpu, generator=g).bfloat16()
            x = base[offset:].view(300, 1032)  # offset 4: a base 8 bytes past 16-byte alignment
            w = (torch.randn(1000, 1032, device=gpu, generator=g) / 32).bfloat16()
            c = torch.randn(300, 1000, device=gpu, generator=g).bfloat16()
            y_kept, y_jit = (torch.full((300, 1000), float("nan"), device=gpu, dtype=torch.bfloat16) for _ in "ab")
            kept(x, w, None, y_kept, c=c, alpha=0.5, beta=2.0)
            TGKernel(cfg, gpu, lock_tiles=1)(x, w, None, y_jit, c=c, alpha=0.5, beta=2.0)
            assert torch.equal(y_kept, y_jit), (name, seed, offset)
        assert len(kept._launches) == 1, name


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager(gpu):
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.backends.lib.triton_tiles import hardware

    be = TritonGemmBackend()
    key = GemmKey(200, 1280, 2048, True, torch.bfloat16, torch.bfloat16)
    g = torch.Generator(device=gpu).manual_seed(0)
    x = torch.randn(200, 2048, device=gpu, generator=g).bfloat16()
    w = (torch.randn(1280, 2048, device=gpu, generator=g) / 45).bfloat16()
    b = torch.randn(1280, device=gpu, generator=g).bfloat16()
    for name in GPU_CONFIGS:
        sol = be.solution_from_row(0, name, 0)
        if not be.supports(sol, key, gpu) or ("_tma" in name and not hardware(gpu).tma):
            continue
        run = be.make_runner(sol, key, gpu)  # compiles here, before capture
        eager = run(x, w, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x, w, b)
        for _ in range(3):  # split-K counters must be back at zero after every replay
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), name


@pytest.mark.gpu
def test_gpu_candidates_compile_and_run(gpu):
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.kernels.triton_gemm import triton_gemm_ref

    be = TritonGemmBackend()
    key = GemmKey(64, 1280, 1024)
    x = torch.randn(64, 1024, device=gpu).bfloat16()
    w = (torch.randn(1280, 1024, device=gpu) / 32).bfloat16()
    ref = triton_gemm_ref(x, w, None, torch.float32)
    sols = be.candidates(key, gpu)
    assert sols
    for sol in sols[:: max(1, len(sols) // 8)]:  # a spread of the space: each config compiles once
        y = be.make_runner(sol, key, gpu)(x, w, None)
        assert _rel_err(y, ref) < 1e-2, sol.kernel_name


if __name__ == "__main__" and "--interp" in sys.argv:
    print(json.dumps(_interp_main(sys.argv[sys.argv.index("--interp") + 1])))
