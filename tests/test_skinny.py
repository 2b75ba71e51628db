"""Skinny (small-M) Triton GEMMs: kernel logic on the CPU through the Triton interpreter (fp16/fp32),
solution ids, and on a GPU bf16/fp16 accuracy plus CUDA-graph replay equal to eager bit for bit.

The interpreter cases run in one subprocess with TRITON_INTERPRET=1 set before triton is imported,
so they work whatever else the test session has imported (the env var is read when a kernel is
decorated). Run this file as a script with --interp to see the raw results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
from kernel_cases import assert_replays_bit_equal, chosen_cases, interpreter_gap, selected_cases_env
from tiers import tiered

from gemmtune.keys import GemmKey

# (config name, in dtype, out dtype, M, N, K, bias, x strided). N, K odd: not multiples of any block,
# K not a multiple of 16; M from 1 to 20 (20 takes a 32-row dot tile and two gemv row tiles).
_NAMES = [
    "skinny_dot_bn32_bk32_sk1_w4_s2",
    "skinny_dot_bn32_bk32_sk3_w4_s2_fx",
    "skinny_dot_bn16_bk64_sk2_w4_s2_rk",
    "skinny_gemv_bn16_bk32_sk1_w4_s1",
    "skinny_gemv_bn8_bk64_sk3_w4_s1_fx",
]
INTERP_CASES = []
for _i, _name in enumerate(_NAMES):
    for _j, (_dt, _odt, _m) in enumerate(
        [("fp32", "fp32", 1), ("fp16", "fp16", 3), ("fp16", "fp32", 16), ("fp32", "fp16", 5), ("fp16", "fp16", 20)]
    ):
        INTERP_CASES.append((_name, _dt, _odt, _m, 77 + 2 * _i, 203 + 16 * _j, (_i + _j) % 2 == 0, _j % 2 == 1))
# The default tier: each config with one of the dtype / M combinations, the combinations in turn.
_INTERP_DEFAULT = {INTERP_CASES[_i * 5 + _i] for _i in range(len(_NAMES))}
# One K that is a multiple of the block (the unmasked EVEN_K loop), with bias.
INTERP_CASES.append(("skinny_dot_bn32_bk32_sk3_w4_s2_fx", "fp16", "fp16", 2, 70, 192, True, False))
INTERP_CASES.append(("skinny_gemv_bn16_bk32_sk1_w4_s1", "fp32", "fp32", 4, 70, 192, True, True))
_INTERP_DEFAULT |= set(INTERP_CASES[-2:])

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _run_case(case, device: str = "cpu") -> dict:
    """Run one case through kernels.skinny.launch into a NaN-poisoned output; error vs fp64 reference."""
    from gemmtune.kernels import skinny as ks

    name, dt, odt, m, n, k, bias, strided = case
    cfg = ks.SkinnyConfig.parse(name)
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    x = torch.randn(m, k + 7 if strided else k, generator=g).to(_DT[dt]).to(device)
    x = x[:, 3 : 3 + k] if strided else x
    w = (torch.randn(n, k, generator=g) / k**0.5).to(_DT[dt]).to(device)
    b = torch.randn(n, generator=g).to(_DT[dt]).to(device) if bias else None
    y = torch.full((m, n), float("nan"), dtype=_DT[odt], device=device)
    ks.launch(cfg, x, w, b, y, ks.new_counters(cfg, n, m, device))
    ref = ks.skinny_gemm_ref(x.double(), w.double(), None if b is None else b.double(), torch.float64)
    return {"nan": int(torch.isnan(y).sum()), "err": _rel_err(y, ref), "x_strided": not x.is_contiguous()}


def _interp_main() -> None:
    gap = interpreter_gap()
    if gap:
        print(json.dumps({"skip": gap}), flush=True)
        return
    for case in chosen_cases(INTERP_CASES):
        print(json.dumps({"case": list(case), **_run_case(case)}), flush=True)


@pytest.fixture(scope="module")
def interp_results(request):
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    env.update(selected_cases_env(request, INTERP_CASES))
    proc = subprocess.run([sys.executable, __file__, "--interp"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if rows and "skip" in rows[0]:
        pytest.skip(rows[0]["skip"])
    return {tuple(r["case"]): r for r in rows}


@pytest.mark.parametrize(
    "case",
    tiered(INTERP_CASES, _INTERP_DEFAULT.__contains__),
    ids=lambda c: f"{c[0][7:]}-{c[1]}>{c[2]}-M{c[3]}-N{c[4]}-K{c[5]}",
)
def test_interpreter_matches_reference(interp_results, case):
    r = interp_results[tuple(case)]
    assert r["nan"] == 0, f"{case}: {r['nan']} outputs never written"
    assert r["x_strided"] == case[7]
    tol = 2e-3 if "fp16" in (case[1], case[2]) else 1e-5
    assert r["err"] < tol, f"{case}: relative error {r['err']:.2e}"


# ---- solution ids (no kernels run) --------------------------------------------------------------


def test_solution_ids_round_trip():
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend
    from gemmtune.backends.base import stable_solidx
    from gemmtune.kernels.skinny import SkinnyConfig

    be = SkinnyBackend()
    cpu = torch.device("cpu")
    seen = set()
    for n, k in [(1280, 8192), (28672, 4096), (77, 203)]:
        for m in (1, 4, 16):
            sols = be.candidates(GemmKey(m, n, k), cpu)
            assert 4 <= len(sols) <= 30
            for sol in sols:
                assert sol.libtype == "skinny" and sol.solidx == stable_solidx(sol.kernel_name)
                assert SkinnyConfig.parse(sol.kernel_name).name == sol.kernel_name
                assert be.solution_from_row(sol.solidx, sol.kernel_name, sol.splitk) == sol
                assert be.supports(sol, GemmKey(m, n, k), cpu)
                seen.add(sol.kernel_name)
    for kind in ("_dot_", "_gemv_", "_fx"):
        assert any(kind in s for s in seen), kind


def test_pdl_names_round_trip():
    from gemmtune.kernels.skinny import SkinnyConfig

    cfg = SkinnyConfig("dot", 64, 256, 2, 4, 3, 1, pdl=3)
    assert cfg.name == "skinny_dot_bn64_bk256_sk2_w4_s3_fx_pdl3"
    assert SkinnyConfig.parse(cfg.name) == cfg
    assert SkinnyConfig.parse("skinny_gemv_bn8_bk512_sk1_w4_s1_pdl2").pdl == 2
    assert SkinnyConfig.parse("skinny_gemv_bn8_bk512_sk1_w4_s1_pdl9") is None  # beyond MAX_PDL
    assert SkinnyConfig.parse("skinny_gemv_bn8_bk512_sk1_w4_s1_pdl") is None


@pytest.mark.parametrize(
    "name",
    [
        "native",
        "skinny_dot_bn64_bk256_sk4_w4_s3",
        "skinny_dot_bn64_bk256_sk1_w4_s3_fx",
        "skinny_dot_bn60_bk256_sk1_w4_s3",
        "skinny_mma_bn64_bk256_sk1_w4_s3",
        "skinny_dot_bn8_bk256_sk1_w4_s3",
        "skinny_dot_bn64_bk256_sk2_w4_s3_at",
        "skinny_dot_bn64_bk256_sk65_w4_s3_fx",
        "",
    ],
)
def test_unknown_names_give_none(name):
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend

    assert SkinnyBackend().solution_from_row(0, name, 0) is None


def test_supports_and_default():
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend

    be = SkinnyBackend()
    cpu = torch.device("cpu")
    assert not be.is_available(cpu)
    assert be.candidates(GemmKey(1, 4096, 4096, dtype=torch.float32, outdtype=torch.float32), cpu) == []
    assert be.candidates(GemmKey(1, 4096, 4096, scaleAB=True), cpu) == []
    assert be.candidates(GemmKey(128, 4096, 4096), cpu) == []
    assert be.default_solution(GemmKey(32, 4096, 4096), cpu) is None
    for m, n, k in [(1, 4096, 4096), (16, 1280, 8192), (3, 77, 203)]:
        key = GemmKey(m, n, k, bias=True, outdtype=torch.float32)
        sol = be.default_solution(key, cpu)
        assert sol is not None and be.supports(sol, key, cpu)
        assert be.solution_from_row(sol.solidx, sol.kernel_name, sol.splitk) == sol


def _binary_of(cfg, key) -> tuple:
    """What Triton compiles a launch of `cfg` on `key` into: the plan's constexprs, the key's dtypes and
    bias, and the ==1 / %16 facts of every int argument (M, N, K, iterations per split, the strides)."""
    from gemmtune.kernels import skinny as ks

    plan = ks.make_plan(cfg, key.M, key.N, key.K, key.dtype)
    facts = tuple((v == 1, v % 16 == 0) for v in (key.M, key.N, key.K, plan.iters_per_split))
    return tuple(sorted(plan.constexprs.items())), plan.split > 1, facts, key.dtype, key.outdtype, key.bias


def test_precompile_items_keep_one_key_per_binary_and_never_merge_two_binaries():
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend, compile_items
    from gemmtune.kernels.skinny import SkinnyConfig

    names = ["skinny_dot_bn64_bk256_sk4_w4_s4_fx", "skinny_dot_bn32_bk256_sk1_w4_s3", "skinny_gemv_bn8_bk512_sk1_w4_s1",
             "skinny_dot_bn16_bk512_sk8_w4_s3_rk"]  # fmt: skip
    sizes = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (77, 203), (128256, 4096))
    keys = [GemmKey(m, n, k, bias=b) for m in (1, 2, 3, 4, 8, 16, 32) for n, k in sizes for b in (False, True)]
    be = SkinnyBackend()
    jobs = [(be.solution_from_row(0, name, 0), key) for name in names for key in keys]
    items = compile_items(jobs)
    binary = {(s.kernel_name, key): _binary_of(SkinnyConfig.parse(s.kernel_name), key) for s, key in jobs}
    kept = {(name, binary[name, key]) for name, key in items}
    assert len(kept) == len(items)  # no two items build one binary
    assert kept == {(name, binary[name, key]) for name, key in binary}  # every binary of the jobs is built
    assert len(items) < len(jobs) / 3


def test_bad_operands_raise_value_error():
    from gemmtune.kernels.skinny import skinny_gemm

    with pytest.raises(ValueError, match="K"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="dtype|fp16"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


# ---- GPU ----------------------------------------------------------------------------------------


def _representatives(be, key, device):
    """A few candidates that cover every code path (each kernel kind x reduction, the default, and
    the partials + reduce-kernel variant): compiling every candidate of every case would take minutes."""
    from gemmtune.backends.base import Solution, stable_solidx

    sols = be.candidates(key, device)
    picked = {}
    for sol in sols:
        kind, red = sol.kernel_name.split("_")[1], sol.kernel_name.endswith("_fx")
        picked.setdefault((kind, red), sol)
    default = be.default_solution(key, device)
    out = list(dict.fromkeys([default, *picked.values()]))
    fx = next((s for s in out if s.kernel_name.endswith("_fx")), None)
    if fx is not None:
        rk = fx.kernel_name[:-3] + "_rk"
        out.append(Solution("skinny", rk, stable_solidx(rk), fx.splitk))
    # PDL variants (offered on sm90+): one per kernel kind, prefetching and not
    for sol in [s for s in out if "_pdl" not in s.kernel_name and not s.kernel_name.endswith("_rk")][:3]:
        for pdl in (1, 3):
            name = f"{sol.kernel_name}_pdl{pdl}"
            out.append(Solution("skinny", name, stable_solidx(name), sol.splitk))
    return out


# (dtype, out dtype, M, N, K, bias): odd N and K (not multiples of the blocks, K not of 16), M 1..16.
_GPU_CASES = [
    (torch.bfloat16, torch.bfloat16, 1, 1000, 1030, False),
    (torch.bfloat16, torch.float32, 3, 77, 203, True),
    (torch.bfloat16, torch.bfloat16, 7, 1280, 8192, False),
    (torch.bfloat16, torch.bfloat16, 16, 4096, 1000, True),
    (torch.bfloat16, torch.float32, 2, 4096, 4096, True),
    (torch.float16, torch.float16, 13, 333, 4099, True),
    (torch.float16, torch.float32, 1, 1280, 8192, False),
    (torch.float16, torch.float16, 4, 2000, 3000, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", tiered(_GPU_CASES, lambda c: c[2:4] in ((1, 1000), (3, 77), (13, 333))), ids=str)
def test_gpu_matches_fp32_reference(gpu, case):
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend

    dtype, outdtype, M, N, K, bias = case
    be = SkinnyBackend()
    g = torch.Generator(device=gpu).manual_seed(M * 131 + N + K)
    x = torch.randn(M, K + 5, device=gpu, generator=g).to(dtype)[:, 2 : 2 + K]  # strided rows
    w = (torch.randn(N, K, device=gpu, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device=gpu, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch_err = _rel_err(torch.nn.functional.linear(x, w, b), ref)
    key = GemmKey(M, N, K, bias, dtype, outdtype)
    sols = _representatives(be, key, gpu)
    assert len(sols) >= 2
    for sol in sols:
        y = be.make_runner(sol, key, gpu)(x, w, b)
        assert y.dtype == outdtype and y.shape == (M, N)
        assert not torch.isnan(y).any(), sol.kernel_name
        err = _rel_err(y, ref)
        # The bar is what PyTorch reaches in the same precision; an fp32 output skips the last rounding.
        assert err < max(2 * torch_err, 1e-3 if outdtype == torch.float32 else 4e-3), (sol.kernel_name, err)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M, N, K",
    [
        (1, 1280, 8192),
        pytest.param(16, 4096, 1030, marks=pytest.mark.slow),
        pytest.param(3, 333, 4099, marks=pytest.mark.slow),
    ],
)
def test_gpu_graph_replay_bit_exact(gpu, M, N, K):
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend

    be = SkinnyBackend()
    key = GemmKey(M, N, K, True, torch.bfloat16, torch.bfloat16)
    x = torch.randn(M, K, device=gpu).to(torch.bfloat16)
    w = (torch.randn(N, K, device=gpu) / K**0.5).to(torch.bfloat16)
    b = torch.randn(N, device=gpu).to(torch.bfloat16)
    sols = _representatives(be, key, gpu)
    assert any(s.kernel_name.endswith("_fx") for s in sols)
    for sol in sols:
        run = be.make_runner(sol, key, gpu)
        eager = run(x, w, b)
        for _ in range(3):
            assert torch.equal(eager, run(x, w, b)), f"{sol.kernel_name} not deterministic"
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(x, w, b)
        torch.cuda.current_stream().wait_stream(s)
        assert_replays_bit_equal(run, (x, w, b), eager, sol.kernel_name)


@pytest.mark.gpu
def test_gpu_runner_leading_dims_and_large_m(gpu):
    from gemmtune.backends.a16w16.triton_skinny import MAX_ROWS, SkinnyBackend

    be = SkinnyBackend()
    key = GemmKey(4, 512, 768, False, torch.float16, torch.float16)
    run = be.make_runner(be.default_solution(key, gpu), key, gpu)
    w = torch.randn(512, 768, device=gpu, dtype=torch.float16) / 28
    for shape in [(2, 2, 768), (3, 768), (MAX_ROWS + 3, 768)]:
        x = torch.randn(*shape, device=gpu, dtype=torch.float16)
        y = run(x, w, None)
        assert y.shape == (*shape[:-1], 512)
        ref = x.double() @ w.double().t()
        assert _rel_err(y, ref) < 2e-3


@pytest.mark.gpu
def test_gpu_table_row_dispatches_to_skinny(gpu, clean_dispatch):
    """A tuned row with libtype=skinny runs this backend through gemmtune.gemm, also in a graph."""
    import gemmtune
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve

    key = GemmKey(2, 1280, 8192, False, torch.bfloat16, torch.bfloat16)
    sol = SkinnyBackend().default_solution(key, gpu)
    ident = identity(gpu)
    row = TunedRow(ident.gfx, ident.cu_num, key, "skinny", sol.solidx, sol.splitk, 5.0, sol.kernel_name)
    clean_dispatch.set_config(ConfigTable([row]))
    assert resolve(key, gpu).solution == sol
    x = torch.randn(2, 8192, device=gpu, dtype=torch.bfloat16)
    w = torch.randn(1280, 8192, device=gpu, dtype=torch.bfloat16) / 90
    y = gemmtune.gemm(x, w)
    assert _rel_err(y, x.double() @ w.double().t()) < 1e-2


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
