"""Skinny (small-M) 8-bit GEMMs (kernels/skinny_a8w8.py on kernels/skinny.py, backends/quantized/triton_skinny.py).

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

import pytest
import torch
from kernel_cases import (
    assert_bad_operands_raise,
    assert_rel_outcome,
    check_every_candidate,
    check_past_max_rows_and_dispatch,
    chosen_cases,
    kernel_results,
    nan_outputs,
    quantized_args,
    rel_outcome,
    skinny_candidate_kinds,
)
from tiers import tiered

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
# M 37 and 64: the rows the fp8 default runs past decode (one M tile of up to 64 rows).
_SHAPES = [(1, 77, 203, "per_token", True, "fp32"), (3, 70, 192, "per_tensor", False, "fp16"),
           (16, 33, 520, "per_token", False, "fp32"), (3, 45, 203, "mixed", True, "fp16"),
           (37, 70, 203, "per_token", True, "fp32"), (64, 45, 520, "mixed", False, "fp16")]  # fmt: skip
_DT = {"int8": torch.int8, "fp8": FP8, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _name(c) -> str:
    return "{}-{}-M{}-N{}-K{}-{}{}>{}".format(c[0][7:], c[1], *c[2:6], "-bias" if c[6] else "", c[7])


CASES = [(cfg, dt, *s) for cfg in _CFGS for dt in ("int8", "fp8") for s in _SHAPES]
# bf16 out only on the GPU (the interpreter rounds bf16 wrong); larger K: many loop iterations.
GPU_CASES = [(cfg, dt, 16, 1000, 4099, "per_token", True, "bf16") for cfg in _CFGS for dt in ("int8", "fp8")]
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _in_default(case) -> bool:
    """The default tier: each config with each 8-bit type on one shape, the shapes in turn; the GPU cases."""
    if case in GPU_CASES:
        return True
    return _SHAPES.index(tuple(case[2:])) == (_CFGS.index(case[0]) * 2 + (case[1] == "fp8")) % len(_SHAPES)


def run_case(case, device: str) -> dict:
    from gemmtune.kernels import skinny_a8w8 as k8
    from gemmtune.kernels.skinny import SkinnyConfig

    cfg_name, dt, m, n, k, scales, bias, out = case
    args = quantized_args(case, m, n, k, scales, _DT[dt], _DT[out], bias, device)
    with nan_outputs(k8):
        y = k8.skinny_a8w8(*args, out_dtype=_DT[out], cfg=SkinnyConfig.parse(cfg_name))
    return rel_outcome(y, k8.skinny_a8w8_ref(*args), (m, n), _DT[out])


def run_cases(cases, device):
    return {_name(c): run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES, GPU_CASES, request)


@pytest.mark.parametrize("case", tiered(ALL, _in_default), ids=_name)
def test_kernel_matches_reference(case, results):
    assert_rel_outcome(results[_name(case)], case[7])


# ---- solutions (no kernels run) -----------------------------------------------------------------


def test_candidates_round_trip_and_stay_decode_only():
    from gemmtune import backends

    cpu = torch.device("cpu")
    for fam in ("a8w8", "a8w8_bpreshuffle"):
        be = backends.get("skinny", fam)
        assert be is not None and not be.is_available(cpu)
        seen = set()
        for m, n, k, dt in [(1, 1280, 8192, FP8), (4, 77, 203, torch.int8), (16, 8192, 1024, FP8)]:
            key = QuantKey(m, n, k, dt, "per_token", m == 4, torch.float16 if m == 4 else torch.bfloat16)
            seen |= skinny_candidate_kinds(be, key, "a8w8_")
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

    assert_bad_operands_raise(skinny_a8w8, "skinny a8w8")


# ---- GPU ----------------------------------------------------------------------------------------

_GPU_KEYS = [QuantKey(1, 1000, 1030, dt, "per_token", True, torch.bfloat16) for dt in (FP8, torch.int8)] + [
    QuantKey(16, 333, 4099, dt, "per_tensor", False, torch.float16) for dt in (FP8, torch.int8)
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "key", tiered(_GPU_KEYS, lambda k: k.M == 1 and k.q_dtype_w == FP8), ids=lambda k: k.describe().replace(" ", "_")
)
def test_gpu_every_candidate_passes_the_family_check_and_replays_bit_equal(gpu, key):
    from gemmtune import backends, families

    sols = check_every_candidate(backends.get("skinny", "a8w8"), families.get("a8w8"), key, gpu)
    assert any("_fx" in s.kernel_name for s in sols)


@pytest.mark.gpu
def test_gpu_runner_past_max_rows_and_op_dispatch(gpu, clean_dispatch):
    """A runner called past MAX_ROWS hands off to the untuned default; a tuned row with libtype
    skinny runs through gemmtune's gemm_a8w8 op."""
    from gemmtune import backends, families
    from gemmtune.ops import quantized as qops

    fam, be = families.get("a8w8"), backends.get("skinny", "a8w8")
    key = QuantKey(4, 1280, 8192, FP8, "per_token", False, torch.bfloat16)
    check_past_max_rows_and_dispatch(be, fam, key, gpu, clean_dispatch, lambda *a: qops.gemm_a8w8(*a, torch.bfloat16))


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES), "cpu")))
