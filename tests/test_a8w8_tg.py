"""8-bit GEMMs on the Triton GEMM kernel (kernels/a8w8_tg.py on kernels/triton_gemm.py,
backends/quantized/triton_tg.py).

Kernel cases run without a GPU under the Triton interpreter in a subprocess (int8 dots with int32
accumulation are exact there; this Triton's interpreter also runs fp8 e4m3 dots and TMA descriptors),
with a GPU on it: int8 and fp8, the plain, split-K (in-kernel fixup and reduce kernel), persistent and
TMA variants, M / N / K not multiples of the blocks (TMA cases K % 16 == 0, which TMA needs), scales
per-tensor, per-token x per-channel and both mixes, bias and none, fp32 / fp16 out (bf16 on the GPU),
outputs NaN-poisoned, against the dequantized fp32 reference. Cases that drop one scale must fail the
same check. On a GPU: every a8w8_tg_ candidate passes the tuner's a8w8 check and replays bit-equal to
eager in a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from kernel_cases import (
    assert_bad_operands_raise,
    assert_rel_outcome,
    check_every_candidate,
    chosen_cases,
    kernel_results,
    nan_outputs,
    quantized_args,
    rel_outcome,
)
from tiers import tiered

from gemmtune.families.quantized import FP8, QuantKey

HAS_GPU = torch.cuda.is_available()
_PLAIN = [
    "a8w8_tg_bm32_bn32_bk32_g2_w4_s2_sk1",
    "a8w8_tg_bm32_bn64_bk64_g2_w4_s2_sk3f",
    "a8w8_tg_bm32_bn32_bk64_g2_w4_s2_sk2r",
    "a8w8_tg_bm32_bn32_bk32_g2_w4_s2_sk1_p",
]
_TMA = ["a8w8_tg_bm64_bn64_bk128_g8_w4_s3_sk1_p_tma", "a8w8_tg_bm32_bn32_bk128_g8_w4_s3_sk2f_tma",
        "a8w8_tg_bm32_bn32_bk64_g2_w4_s3_sk1_pf_tma"]  # fmt: skip
# (M, N, K, scales, bias, out): every dim ragged against every block; K 100 and 300 not multiples of 16.
_SHAPES = [(37, 70, 208, "per_token", True, "fp32"), (5, 33, 100, "per_tensor", False, "fp16"),
           (130, 77, 336, "mixed", True, "fp16"), (70, 45, 300, "mixed_w", False, "fp32")]  # fmt: skip
_DT = {"int8": torch.int8, "fp8": FP8, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _shapes(cfg):
    return [s for s in _SHAPES if "_tma" not in cfg or s[2] % 16 == 0]


CASES = [(cfg, dt, *s, "") for cfg in _PLAIN + _TMA for dt in ("int8", "fp8") for s in _shapes(cfg)]
# Dropped scales (the kernel given ones for xs or ws): the check below must reject these.
DROPPED = [(_PLAIN[1], dt, *_SHAPES[0], drop) for dt in ("int8", "fp8") for drop in ("xs", "ws")]
GPU_CASES = [(cfg, dt, 300, 1000, 4096, "per_token", True, "bf16", "") for cfg in (
    "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma", "a8w8_tg_bm128_bn256_bk128_g8_w8_s3_sk2r",
    "a8w8_tg_bm256_bn128_bk128_g8_w8_s3_sk1_p_tma", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_pf_tma",
    "a8w8_tg_bm128_bn256_bk256_g8_w8_s2_sk3f_tma") for dt in ("int8", "fp8")]  # fmt: skip
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _in_default(case) -> bool:
    """The default tier: each config with each 8-bit type on one of its shapes, the shapes in turn; the GPU cases."""
    if case in GPU_CASES:
        return True
    cfg, shapes = case[0], _shapes(case[0])
    turn = (_PLAIN + _TMA).index(cfg) * 2 + (case[1] == "fp8")
    return shapes.index(tuple(case[2:8])) == turn % len(shapes)


def _name(c) -> str:
    return "{}-{}-M{}-N{}-K{}-{}{}>{}{}".format(c[0][8:], c[1], *c[2:6], "-bias" if c[6] else "", c[7],
                                                 f"-no{c[8]}" if c[8] else "")  # fmt: skip


def run_cases(cases, device):
    return {_name(c): run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES + DROPPED, GPU_CASES, request)


def run_case(case, device: str) -> dict:
    from gemmtune.kernels import a8w8_tg as kt

    cfg_name, dt, m, n, k, scales, bias, out, drop = case
    args = quantized_args(case[:8], m, n, k, scales, _DT[dt], _DT[out], bias, device)
    run_args = list(args)
    if drop:  # the kernel runs without one scale; the reference keeps it
        i = 2 if drop == "xs" else 3
        run_args[i] = torch.ones_like(args[i])
    with nan_outputs(kt):
        y = kt.gemm_a8w8_tg(*run_args, out_dtype=_DT[out], cfg=kt.parse_config(cfg_name))
    return rel_outcome(y, kt.a8w8_tg_ref(*args), (m, n), _DT[out])


@pytest.mark.parametrize("case", tiered(ALL, _in_default), ids=_name)
def test_kernel_matches_reference(case, results):
    assert_rel_outcome(results[_name(case)], case[7])


@pytest.mark.parametrize("case", DROPPED, ids=_name)
def test_dropping_a_scale_fails_the_check(case, results):
    with pytest.raises(AssertionError):
        assert_rel_outcome(results[_name(case)], case[7])


# ---- solutions (no kernels run) -----------------------------------------------------------------


def test_candidates_are_8bit_tg_configs_above_m32():
    from gemmtune import backends
    from gemmtune.backends.base import stable_solidx
    from gemmtune.backends.quantized import triton_tg as a8w8_tg
    from gemmtune.kernels import a8w8, triton_gemm

    cpu = torch.device("cpu")
    be = backends.get("triton", "a8w8")
    seen = set()
    for m, n, k in [(33, 4096, 4096), (300, 1000, 1024), (1024, 4096, 4096), (4096, 6144, 4096), (1024, 1000, 1000)]:
        key = QuantKey(m, n, k, FP8, "per_token", False, torch.bfloat16)
        sols = a8w8_tg.candidates(key, cpu)
        assert sols, key
        for sol in sols:
            cfg = a8w8_tg.parse_config(sol.kernel_name)
            assert sol.libtype == "triton" and sol.kernel_name.startswith("a8w8_tg_") and cfg.bk == 128
            assert sol.solidx == stable_solidx(sol.kernel_name) and cfg.name == sol.kernel_name
            assert be.solution_from_row(sol.solidx, sol.kernel_name, sol.splitk) == sol
            assert a8w8.TileConfig.parse(sol.kernel_name) is None and triton_gemm.parse_config(sol.kernel_name) is None
            assert not cfg.tma or k % 16 == 0
            seen |= {"tma" if cfg.tma else "ptr", "p" if cfg.persistent else f"sk{min(cfg.split_k, 2)}"}
            if m >= 1024:
                assert (cfg.bm, cfg.bn) in ((128, 128), (128, 256), (256, 128))
        assert a8w8_tg.candidates(key._replace(M=32), cpu) == []
    assert seen == {"tma", "ptr", "p", "sk1", "sk2"}
    assert not be.supports(sols[0], key, cpu)  # no GPU here: the backend is unavailable


@pytest.mark.parametrize(
    "name",
    ["tg_bm128_bn128_bk128_g8_w8_s3_sk1", "a8w8_bm128_bn128_bk128_g8_sk1_w8_s3",
     "a8w8_tg_bm128_bn128_bk16_g8_w8_s3_sk1", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk2",
     "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk2f_p", ""],
)  # fmt: skip
def test_other_names_are_not_tg_configs(name):
    from gemmtune.kernels.a8w8_tg import parse_config

    assert parse_config(name) is None


def test_bad_operands_raise_value_error():
    from gemmtune.kernels.a8w8_tg import gemm_a8w8_tg

    assert_bad_operands_raise(gemm_a8w8_tg, "a8w8 tg")


# ---- GPU ----------------------------------------------------------------------------------------

_GPU_KEYS = [
    QuantKey(300, 1000, 1024, FP8, "per_token", True, torch.bfloat16),
    QuantKey(1024, 4096, 1024, torch.int8, "per_tensor", False, torch.float16),
    QuantKey(77, 1000, 1000, torch.int8, "per_token", True, torch.float32),  # K % 16 != 0: no TMA
    QuantKey(2048, 1536, 2048, FP8, "per_token", False, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("key", tiered(_GPU_KEYS, lambda k: k.M == 300), ids=lambda k: k.describe().replace(" ", "_"))
def test_gpu_every_candidate_passes_the_family_check_and_replays_bit_equal(gpu, key):
    from gemmtune import backends, families

    sols = check_every_candidate(backends.get("triton", "a8w8"), families.get("a8w8"), key, gpu, "a8w8_tg_")
    assert sols


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES + DROPPED), "cpu")))
