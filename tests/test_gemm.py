"""gemmtune.gemm on the CPU: F.linear parity, custom op under torch.compile, bad inputs, dispatch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.configs import ConfigTable, TunedRow
from gemmtune.device import identity
from gemmtune.keys import GemmKey
from gemmtune.tuned_gemm import gemm_a16w16

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (7,), (3, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_linear(dtype, lead, with_bias):
    g = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), lead, with_bias)).encode()))  # same every run
    N, K = 37, 53  # odd sizes on purpose
    x = torch.randn(*lead, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    y = gemmtune.gemm(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (*lead, N) and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < TOL[dtype]
    assert torch.equal(y, gemmtune.gemm(x, w, b))  # the cached path gives the same answer


def test_out_dtype_fp32_keeps_wide_accumulation():
    x = torch.randn(9, 130).to(torch.bfloat16)
    w = torch.randn(33, 130).to(torch.bfloat16)
    b = torch.randn(33).to(torch.bfloat16)
    y = gemmtune.gemm(x, w, b, out_dtype=torch.float32)
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == torch.float32
    assert rel_err(y, ref) < 1e-5


def test_empty_leading_dim():
    y = gemmtune.gemm(torch.randn(0, 16), torch.randn(8, 16))
    assert y.shape == (0, 8)


def test_aiter_alias():
    x = torch.randn(4, 32, dtype=torch.float16)
    w = torch.randn(24, 32, dtype=torch.float16)
    y = gemm_a16w16(x, w, otype=torch.float32)
    assert y.dtype == torch.float32
    assert rel_err(y, F.linear(x.float(), w.float())) < 1e-3
    with pytest.raises(ValueError, match="scale"):
        gemm_a16w16(x, w, scale_a=torch.ones(1))


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape, match",
    [
        ((4, 16), (8, 15), None, r"K=16.*K=15"),
        ((4, 16), (8, 16, 1), None, "w must be 2-D"),
        ((), (8, 16), None, "at least 1 dimension"),
        ((4, 16), (8, 16), (7,), "bias must be 1-D of length N=8"),
        ((4, 16), (8, 16), (8, 1), "bias must be 1-D"),
    ],
)
def test_bad_shapes_name_the_shapes(x_shape, w_shape, b_shape, match):
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    b = torch.randn(b_shape) if b_shape else None
    with pytest.raises(ValueError, match=match) as info:
        gemmtune.gemm(x, w, b)
    assert str(tuple(w.shape)) in str(info.value)


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="dtype mismatch"):
        gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="unsupported dtype"):
        gemmtune.gemm(torch.ones(2, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="bias dtype"):
        gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(4).half())
    with pytest.raises(ValueError, match="device mismatch"):
        gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 8, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_gemm_rejects_float64_inputs(dtype):
    # Float dtypes other than fp16/bf16/fp32 used to pass validation and run, against the error text.
    x, w = torch.randn(2, 8).to(dtype), torch.randn(4, 8).to(dtype)
    with pytest.raises(ValueError, match=f"unsupported dtype {dtype} \\(gemm takes float16/bfloat16/float32\\)"):
        gemmtune.gemm(x, w)
    with pytest.raises(ValueError, match="unsupported out_dtype torch.float64"):
        gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 8), out_dtype=torch.float64)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.randn(2, 8), torch.randn(4, 8), 1.0), "bias must be a tensor or None, got float"),
        ((torch.randn(2, 8), torch.randn(4, 8), [0.0] * 4), "bias must be a tensor or None, got list"),
        ((torch.randn(2, 8), [[0.0] * 8] * 4), "w must be a tensor, got list"),
        ((torch.randn(2, 8), 2.0), "w must be a tensor, got float"),
    ],
)
def test_gemm_non_tensor_argument_is_a_type_error_naming_it(args, match):
    # These used to escape as AttributeError from the hot path ('float' object has no attribute 'shape').
    with pytest.raises(TypeError, match=match):
        gemmtune.gemm(*args)


def test_errors_are_raised_again_on_the_cached_path():
    gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 8))  # caches this signature
    with pytest.raises(ValueError):
        gemmtune.gemm(torch.randn(2, 8), torch.randn(4, 9))


def test_custom_op_passes_opcheck():
    x, w, b = torch.randn(5, 24), torch.randn(12, 24), torch.randn(12)
    torch.library.opcheck(torch.ops.gemmtune.gemm.default, (x, w, b, None))
    torch.library.opcheck(torch.ops.gemmtune.gemm.default, (x.half(), w.half(), None, torch.float32))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph(backend):
    def f(x, w, b):
        return torch.relu(gemmtune.gemm(x, w, b)) * 2

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    x, w, b = torch.randn(3, 6, 40), torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(compiled(x, w, b), torch.relu(F.linear(x, w, b)) * 2, rtol=1e-5, atol=1e-5)


def test_compiled_graph_contains_the_op():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(lambda x, w: gemmtune.gemm(x, w), fullgraph=True, backend=backend)(
        torch.randn(2, 8), torch.randn(4, 8)
    )
    assert any("gemmtune.gemm" in s for s in seen), seen


def test_autograd_matches_linear():
    x = torch.randn(6, 20, requires_grad=True)
    w = torch.randn(10, 20, requires_grad=True)
    b = torch.randn(10, requires_grad=True)
    gemmtune.gemm(x, w, b).square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).square().sum().backward()
    for g, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(g, t.grad)


def _row(key: GemmKey, libtype: str, us: float, kernel="native", solidx=0, gfx=None, cu=None) -> TunedRow:
    ident = identity("cpu")
    return TunedRow(gfx if gfx is not None else ident.gfx, cu or ident.cu_num, key, libtype, solidx, 0, us, kernel)


def test_dispatch_uses_table_row_and_caches(clean_dispatch):
    key = GemmKey(4, 8, 16, False, torch.float32, torch.float32)
    clean_dispatch.set_config(ConfigTable([_row(key, "torch", 3.0)]))
    res = gemmtune.resolve(key, "cpu")
    assert res.row is not None and res.solution.libtype == "torch" and not res.note
    calls = []
    orig = clean_dispatch.resolve
    clean_dispatch.resolve = lambda k, d, *fam: calls.append(k) or orig(k, d, *fam)
    try:
        for _ in range(3):
            gemmtune.gemm(torch.randn(4, 16), torch.randn(8, 16))
    finally:
        del clean_dispatch.resolve
    assert calls == [key]  # resolved once, then served from the cache


def test_row_that_cannot_run_here_falls_back_and_logs_once(clean_dispatch, caplog):
    key = GemmKey(4, 8, 16, False, torch.float32, torch.float32)
    clean_dispatch.set_config(ConfigTable([_row(key, "asm", 3.0, kernel="_ZN5aiter_kernel", solidx=5)]))
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        for _ in range(3):
            res = gemmtune.resolve(key, "cpu")
        y = gemmtune.gemm(torch.randn(4, 16), torch.randn(8, 16))
    assert res.solution.libtype == "torch" and "fallback" in res.note and "asm" in res.note
    assert y.shape == (4, 8)
    assert sum("falls back" in r.message for r in caplog.records) == 1


def test_rows_for_another_gpu_are_ignored(clean_dispatch):
    key = GemmKey(4, 8, 16, False, torch.float32, torch.float32)
    clean_dispatch.set_config(ConfigTable([_row(key, "asm", 3.0, gfx="gfx942", cu=80)]))
    res = gemmtune.resolve(key, "cpu")
    assert res.row is None and res.solution.libtype == "torch" and not res.note


def test_gemmtune_log_reports_resolution(tmp_path):
    code = "import torch, gemmtune; gemmtune.gemm(torch.randn(3, 16), torch.randn(5, 16))"
    env = dict(os.environ, GEMMTUNE_LOG="1")
    env.pop("GEMMTUNE_CONFIG", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "M=3 N=5 K=16" in out.stderr and "torch:native" in out.stderr


def test_missing_config_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.csv"
    code = "import torch, gemmtune; gemmtune.gemm(torch.randn(3, 16), torch.randn(5, 16))"
    env = dict(os.environ, GEMMTUNE_CONFIG=str(missing))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert f"{missing}: no such file" in out.stderr
