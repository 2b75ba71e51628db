"""batched_gemm_a8w8 (aiter's batched 8-bit GEMM): the op and its torch backend against an fp32 reference
on odd shapes, the Triton kernel into NaN-poisoned outputs (on the GPU, or under Triton's interpreter in a
subprocess: fp16 / fp32 outputs, bf16 is wrong there), validation, and a tune -> table -> dispatch round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune.cli.main import cli
from gemmtune.configs import ConfigTable
from gemmtune.families import get
from gemmtune.families.quantized import BatchedQuantKey
from gemmtune.kernels.batched_a8w8 import batched_a8w8_ref

SHAPES = [(3, 5, 19, 40), (2, 17, 33, 130), (1, 1, 7, 64), (4, 33, 128, 96)]
Q_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _inputs(B, M, N, K, q, seed=0):
    key = BatchedQuantKey(B, M, N, K, q, torch.float32)
    return get("batched_a8w8").make_inputs(key, torch.device("cpu"), 1, seed)[0]


def _rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", Q_DTYPES, ids=str)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16], ids=str)
def test_op_matches_the_fp32_reference(shape, q, out):
    gemmtune.set_config(None)
    xq, wq, xs, ws = _inputs(*shape, q)
    key = BatchedQuantKey(*shape, q, out)
    ref = get("batched_a8w8").reference(key, (xq, wq, xs, ws))
    y = gemmtune.batched_gemm_a8w8(xq, wq, xs.reshape(shape[0], shape[1]), ws, out)  # [B, M] scales accepted
    assert y.shape == ref.shape and y.dtype == out and not torch.isnan(y).any()
    assert _rel(y, ref) < (1e-6 if out == torch.float32 else 1e-2)
    assert _rel(batched_a8w8_ref(xq, wq, xs, ws, torch.float32), ref) < 1e-6


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 3, 4, dtype=torch.int8), torch.zeros(2, 5, 4, dtype=torch.int8), torch.ones(2, 3, 1),
          torch.ones(2, 1, 5), torch.int8), "dtype must be"),
        ((torch.zeros(2, 3, 4, dtype=torch.int8), torch.zeros(2, 5, 6, dtype=torch.int8), torch.ones(2, 3, 1),
          torch.ones(2, 1, 5), torch.bfloat16), "disagree on B or K"),
        ((torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.ones(2, 3, 1), torch.ones(2, 1, 5), torch.bfloat16),
         "int8 or fp8"),
        ((torch.zeros(2, 3, 4, dtype=torch.int8), torch.zeros(2, 5, 4, dtype=torch.int8), torch.ones(2, 1),
          torch.ones(2, 1, 5), torch.bfloat16), "x_scale must be per token"),
        ((torch.zeros(2, 3, 4, dtype=torch.int8), torch.zeros(2, 5, 4, dtype=torch.int8), torch.ones(2, 3, 1),
          torch.ones(1, 5), torch.bfloat16), "w_scale must be per channel"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        gemmtune.batched_gemm_a8w8(*args)
    with pytest.raises(TypeError, match="XQ must be a tensor"):
        gemmtune.batched_gemm_a8w8([1], *args[1:])


def test_compiles_without_graph_breaks():
    xq, wq, xs, ws = _inputs(2, 3, 16, 32, torch.int8)
    f = torch.compile(lambda *a: gemmtune.batched_gemm_a8w8(*a, dtype=torch.float32), fullgraph=True)
    assert torch.equal(f(xq, wq, xs, ws), gemmtune.batched_gemm_a8w8(xq, wq, xs, ws, torch.float32))


def test_tune_writes_a_table_the_dispatcher_uses(tmp_path):
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("B,M,N,K,q_dtype_w,outdtype\n3,5,24,64,torch.int8,torch.float32\n")
    out = tmp_path / "tuned.csv"
    res = CliRunner().invoke(cli, ["tune", str(shapes), "-o", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith("gfx,cu_num,B,M,N,K,kernelId,splitK,us,kernelName")
    gemmtune.set_config(str(out))
    try:
        key = BatchedQuantKey(3, 5, 24, 64, torch.int8, torch.float32)
        r = gemmtune.resolve(key, "cpu", family="batched_a8w8")
        assert r.row is not None and r.solution.libtype == "torch"
    finally:
        gemmtune.set_config(None)


def test_aiter_table_loads_and_its_rows_fall_back(aiter_configs):
    table = ConfigTable.load(str(aiter_configs / "a8w8_tuned_batched_gemm.csv"))
    assert table.family.name == "batched_a8w8" and len(table) > 0
    row = table.rows[0]
    assert row.libtype == "ck" and isinstance(row.key, BatchedQuantKey)


def test_untuned_keys_run_the_triton_default_on_an_nvidia_gpu(monkeypatch):
    from gemmtune import device
    from gemmtune.backends.batched_a8w8 import policy
    from gemmtune.backends.batched_a8w8.pytorch import NATIVE
    from gemmtune.backends.batched_a8w8.triton import default_config, tile_configs

    key = BatchedQuantKey(16, 4, 512, 128, torch.float8_e4m3fn, torch.bfloat16)
    assert policy.batched_a8w8(key, "cpu") == ("torch", NATIVE)
    monkeypatch.setattr(device, "vendor", lambda d=None: device.NVIDIA)
    monkeypatch.setattr(device, "triton_runs_on", lambda d=None: True)
    for b, n, k in ((128, 512, 128), (16, 128, 512)):
        for m in (1, 5, 16, 17, 48, 100, 4096):
            key = BatchedQuantKey(b, m, n, k, torch.int8, torch.bfloat16)
            name, sol = policy.batched_a8w8(key, "cuda")
            cfg = default_config(key)
            assert (name, sol.kernel_name) == ("triton", cfg.name)
            assert cfg in tile_configs(key)  # the tuner times the default among its candidates
            assert cfg.block_m == (16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128)
    monkeypatch.setattr(device, "vendor", lambda d=None: device.AMD)
    assert policy.batched_a8w8(key, "cuda") == ("torch", NATIVE)


# ---- the Triton kernel -----------------------------------------------------------------------------------
def _kernel_cases(device: str) -> list[dict]:
    from gemmtune.backends.batched_a8w8.triton import TritonBatchedA8W8Backend, default_config
    from gemmtune.kernels.batched_a8w8 import BatchedA8W8Config, batched_a8w8

    out = []
    cfgs = [BatchedA8W8Config(16, 32, 64, 4, 1), BatchedA8W8Config(32, 64, 128, 4, 2)]
    for shape in SHAPES:
        for q in Q_DTYPES:
            xq, wq, xs, ws = (t.to(device) for t in _inputs(*shape, q))
            ref = batched_a8w8_ref(xq.cpu(), wq.cpu(), xs.cpu(), ws.cpu(), torch.float32)
            for cfg in cfgs:
                for dt in (torch.float16, torch.float32):
                    y = torch.full(ref.shape, float("nan"), dtype=dt, device=device)
                    batched_a8w8(xq, wq, xs, ws, dt, cfg, out=y)
                    out.append({"case": f"{shape} {q} {cfg.name} {dt}", "nan": bool(torch.isnan(y).any()),
                                "rel": _rel(y.cpu(), ref), "dt": str(dt)})  # fmt: skip
            key = BatchedQuantKey(*shape, q, torch.float32)
            sol = TritonBatchedA8W8Backend().solution(default_config(key))  # what an untuned key runs
            y = TritonBatchedA8W8Backend().make_runner(sol, key, torch.device(device))(xq, wq, xs, ws)
            out.append({"case": f"{shape} {q} runner", "nan": bool(torch.isnan(y).any()), "rel": _rel(y.cpu(), ref),
                        "dt": "torch.float32"})  # fmt: skip
    return out


def test_triton_kernel_into_poisoned_outputs():
    if torch.cuda.is_available():
        results = _kernel_cases("cuda")
    else:
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(SHAPES) * len(Q_DTYPES) * 5
    for r in results:
        assert not r["nan"], r
        assert r["rel"] < (1e-6 if r["dt"] == "torch.float32" else 1e-3), r


if __name__ == "__main__":
    print(json.dumps(_kernel_cases("cpu")))
