"""Skinny (small-M) 8-bit GEMMs (kernels/skinny_a8w8.py on kernels/skinny.py, backends/skinny_quant.py).

Kernel cases run without a GPU under the Triton interpreter in a subprocess (int8 dots with int32
accumulation are exact there, and this Triton's interpreter also runs fp8 e4m3 loads and dots), with
a GPU on it: both 8-bit dtypes, every kernel kind x split-K reduction, M 1/3/16 (16 takes four gemv
row tiles), N and K not multiples of the blocks, K not a multiple of BLOCK_K * SPLIT_K (and one that
is: the unmasked loop), scales per-tensor, per-token x per-channel and mixed, bias and none, outputs
NaN-poisoned, against the dequantized fp32 reference. On a GPU: every backend candidate passes the
tuner's a8w8 check (strided rows, CUDA-graph replay) and replays bit-equal to eager, fp8 and int8.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import assert_replays_bit_equal, kernel_results, nan_outputs

from gemmtune.families.quantized import FP8, QuantKey

HAS_GPU = torch.cuda.is_available()
_CFGS = [
    "skinny_dot_bn32_bk32_sk1_w4_s2",
    "skinny_dot_bn32_bk64_sk3_w4_s2_fx",
    "skinny_dot_bn16_bk64_sk2_w4_s2_rk",
    "skinny_gemv_bn16_bk32_sk1_w4_s1",
    "skinny_gemv_bn8_bk64_sk3_w4_s1_fx",
]
# (M, N, K, scales, bias, out): K 203 / 520 ragged and not a multiple of any BLOCK_K * SPLIT_K, 192 even.
_SHAPES = [(1, 77, 203, "per_token", True, "fp32"), (3, 70, 192, "per_tensor", False, "fp16"),
           (16, 33, 520, "per_token", False, "fp32"), (3, 45, 203, "mixed", True, "fp16")]  # fmt: skip
_DT = {"int8": torch.int8, "fp8": FP8, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _name(c) -> str:
    return "{}-{}-M{}-N{}-K{}-{}{}>{}".format(c[0][7:], c[1], *c[2:6], "-bias" if c[6] else "", c[7])


CASES = [(cfg, dt, *s) for cfg in _CFGS for dt in ("int8", "fp8") for s in _SHAPES]
# bf16 out only on the GPU (the interpreter rounds bf16 wrong); larger K: many loop iterations.
GPU_CASES = [(cfg, dt, 16, 1000, 4099, "per_token", True, "bf16") for cfg in _CFGS for dt in ("int8", "fp8")]
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _quantized(m, n, k, scales, dt, g):
    from gemmtune.quant import quantize as Q

    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    xq, xs = (Q.quantize_per_tensor if scales == "per_tensor" else Q.quantize_per_token)(x, dt)
    wq, ws = (Q.quantize_per_channel if scales != "per_tensor" else Q.quantize_per_tensor)(w, dt)
    if scales == "mixed":  # one x scale, per-channel w scales
        xq, xs = Q.quantize_per_tensor(x, dt)
    return xq, wq, xs, ws


def run_case(case, device: str) -> dict:
    from gemmtune.kernels import skinny_a8w8 as k8
    from gemmtune.kernels.skinny import SkinnyConfig

    cfg_name, dt, m, n, k, scales, bias, out = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    xq, wq, xs, ws = _quantized(m, n, k, scales, _DT[dt], g)
    b = torch.randn(n, generator=g).to(_DT[out]) if bias else None
    args = [t.to(device) if t is not None else None for t in (xq, wq, xs, ws, b)]
    with nan_outputs(k8):
        y = k8.skinny_a8w8(*args, out_dtype=_DT[out], cfg=SkinnyConfig.parse(cfg_name))
    ref = k8.skinny_a8w8_ref(*args).double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    return {"nan": int(torch.isnan(y).sum()), "err": err, "ok": tuple(y.shape) == (m, n) and y.dtype == _DT[out]}


def run_cases(cases, device):
    return {_name(c): run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.mark.parametrize("case", ALL, ids=_name)
def test_kernel_matches_reference(case, results):
    r = results[_name(case)]
    assert r["nan"] == 0 and r["ok"], r
    # fp32 out: accumulation order only; fp16 / bf16: the output rounding (unit roundoff 2^-11 / 2^-8).
    assert r["err"] < {"fp32": 1e-5, "fp16": 1e-3, "bf16": 6e-3}[case[7]], r


# ---- solutions (no kernels run) -----------------------------------------------------------------


def test_candidates_round_trip_and_stay_decode_only():
    from gemmtune import backends
    from gemmtune.backends.base import stable_solidx

    cpu = torch.device("cpu")
    for fam in ("a8w8", "a8w8_bpreshuffle"):
        be = backends.get("skinny", fam)
        assert be is not None and not be.is_available(cpu)
        seen = set()
        for m, n, k, dt in [(1, 1280, 8192, FP8), (4, 77, 203, torch.int8), (16, 8192, 1024, FP8)]:
            key = QuantKey(m, n, k, dt, "per_token", m == 4, torch.float16 if m == 4 else torch.bfloat16)
            sols = be.candidates(key, cpu)
            assert len(sols) >= 8
            for sol in sols:
                assert sol.libtype == "skinny" and sol.kernel_name.startswith("a8w8_skinny_")
                assert sol.solidx == stable_solidx(sol.kernel_name) and not sol.kernel_name.endswith("_rk")
                assert be.solution_from_row(sol.solidx, sol.kernel_name, sol.splitk) == sol
                assert be.supports(sol, key, cpu)
                seen.add(sol.kernel_name.split("_")[2])
            assert be.candidates(key._replace(M=17), cpu) == []
            assert be.candidates(key._replace(outdtype=torch.float64), cpu) == []
        assert seen == {"dot", "gemv"}


@pytest.mark.parametrize(
    "name",
    ["skinny_dot_bn64_bk256_sk1_w4_s3", "a8w8_bm16_bn64_bk256_g1_sk4_w4_s4", "a8w8_skinny_dot_bn64_bk256_sk2_w4_s3_at",
     "a8w8_skinny_dot_bn64_bk16_sk1_w4_s3", "a8w8_skinny_mma_bn64_bk256_sk1_w4_s3", ""],
)  # fmt: skip
def test_other_names_give_none(name):
    from gemmtune import backends

    assert backends.get("skinny", "a8w8").solution_from_row(0, name, 0) is None


def test_bad_operands_raise_value_error():
    from gemmtune.kernels.skinny_a8w8 import skinny_a8w8

    xq, wq = torch.zeros(2, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="K"):
        skinny_a8w8(xq, wq[:, :7], one, one)
    with pytest.raises(ValueError, match="8-bit"):
        skinny_a8w8(xq.float(), wq.float(), one, one)
    with pytest.raises(ValueError, match="x_scale"):
        skinny_a8w8(xq, wq, torch.ones(3, 1), one)
    with pytest.raises(ValueError, match="w_scale"):
        skinny_a8w8(xq, wq, one, torch.ones(1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        skinny_a8w8(xq, wq, one, one, torch.zeros(5))


# ---- GPU ----------------------------------------------------------------------------------------

_GPU_KEYS = [QuantKey(1, 1000, 1030, dt, "per_token", True, torch.bfloat16) for dt in (FP8, torch.int8)] + [
    QuantKey(16, 333, 4099, dt, "per_tensor", False, torch.float16) for dt in (FP8, torch.int8)
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("key", _GPU_KEYS, ids=lambda k: k.describe().replace(" ", "_"))
def test_gpu_every_candidate_passes_the_family_check_and_replays_bit_equal(gpu, key):
    from gemmtune import backends, families
    from gemmtune.tuner.check import check_runner

    fam, be = families.get("a8w8"), backends.get("skinny", "a8w8")
    sols = be.candidates(key, gpu)
    assert any("_fx" in s.kernel_name for s in sols)
    be.precompile([(s, key) for s in sols], gpu, workers=8)  # compile in parallel, then load each
    inputs = fam.make_inputs(key, gpu, 1, seed=key.M)[0]
    ref = fam.reference(key, inputs)
    for sol in sols:
        run = be.make_runner(sol, key, gpu)
        verdict = check_runner(run, key, inputs, ref, family=fam)
        assert verdict.ok, (sol.kernel_name, verdict.reason)
        assert_replays_bit_equal(run, inputs, run(*inputs).clone(), sol.kernel_name, replays=2)


@pytest.mark.gpu
def test_gpu_runner_past_max_rows_and_op_dispatch(gpu, clean_dispatch):
    """A runner called past MAX_ROWS hands off to the untuned default; a tuned row with libtype
    skinny runs through gemmtune's gemm_a8w8 op."""
    from gemmtune import backends, families
    from gemmtune.backends.skinny import MAX_ROWS
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve
    from gemmtune.ops import quantized as qops

    fam, be = families.get("a8w8"), backends.get("skinny", "a8w8")
    key = QuantKey(4, 1280, 8192, FP8, "per_token", False, torch.bfloat16)
    sol = be.candidates(key, gpu)[0]
    big = key._replace(M=MAX_ROWS + 5)
    inputs = fam.make_inputs(big, gpu, 1, seed=3)[0]
    y = be.make_runner(sol, key, gpu)(*inputs)
    ref = fam.reference(big, inputs)
    assert ((y.float() - ref).norm() / ref.norm()).item() < fam.error_threshold(key)

    ident = identity(gpu)
    row = TunedRow(ident.gfx, ident.cu_num, key, "skinny", sol.solidx, sol.splitk, 5.0, sol.kernel_name, family=fam)
    clean_dispatch.set_config(ConfigTable([row], family="a8w8"))
    assert resolve(key, gpu, family="a8w8").solution == sol
    xq, wq, xs, ws, _ = fam.make_inputs(key, gpu, 1, seed=4)[0]
    y = qops.gemm_a8w8(xq, wq, xs, ws, None, torch.bfloat16)
    ref = fam.reference(key, (xq, wq, xs, ws, None))
    assert ((y.float() - ref).norm() / ref.norm()).item() < fam.error_threshold(key)


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
