"""Skinny (small-M) fp8 block-scale GEMMs (kernels/skinny_blockscale.py on kernels/skinny.py,
backends/quantized/triton_skinny_blockscale.py).

Kernel cases run without a GPU under the Triton interpreter in a subprocess (fp8 e4m3 loads and dots
run there), with a GPU on it: every kernel kind x split-K reduction, BLOCK_K 32 / 64 / 128, M 1/3/16,
N not a multiple of 128 nor of BLOCK_N, K = 128 x odd, x_scale row-major and M-major, w_scale packed
and with padded rows (the padding NaN, so a read of it shows), outputs NaN-poisoned, against the
dequantized fp32 reference. The operands get a random magnitude per 1x128 group / 128x128 block
(2^-3 .. 2^3), so a scale taken from the wrong group or block, or dropped, is far off the reference.
On a GPU: every backend candidate passes the tuner's block-scale check (both scale layouts, CUDA-
graph replay) and replays bit-equal to eager; a tuned row runs through gemm_a8w8_blockscale.
"""

from __future__ import annotations

import json
import zlib

import kernel_cases as kc
import pytest
import torch
from tiers import tiered, tiered_at

from gemmtune.families.quantized import FP8, BlockKey

HAS_GPU = torch.cuda.is_available()
_CFGS = [
    "skinny_dot_bn32_bk128_sk1_w4_s2",
    "skinny_dot_bn32_bk64_sk3_w4_s2_fx",
    "skinny_dot_bn16_bk32_sk2_w4_s2_rk",
    "skinny_gemv_bn16_bk64_sk1_w4_s1",
    "skinny_gemv_bn8_bk128_sk3_w4_s1_fx",
]
# (M, N, K, x_scale layout, w_scale layout, out): K 384 / 640 / 128, N across 128-row blocks and ragged.
_SHAPES = [(1, 300, 384, "mmajor", "padded", "fp32"), (3, 200, 640, "row", "packed", "fp16"),
           (16, 130, 384, "mmajor", "packed", "fp32"), (3, 45, 128, "row", "padded", "fp32")]  # fmt: skip
_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _name(c) -> str:
    return "{}-M{}-N{}-K{}-xs_{}-ws_{}>{}".format(c[0][7:], *c[1:])


CASES = [(cfg, *s) for cfg in _CFGS for s in _SHAPES]
# bf16 out only on the GPU (the interpreter rounds bf16 wrong); larger K: many loop iterations.
GPU_CASES = [(cfg, 16, 1000, 128 * 33, "mmajor", "padded", "bf16") for cfg in _CFGS]
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _operands(m, n, k, g):
    """fp32 x [M, K], w [N, K] with a random power-of-two magnitude per 1x128 group / 128x128 block."""
    from gemmtune.quant.quantize import expand_blocks

    kb, nb = k // 128, -(-n // 128)
    x = torch.randn(m, k, generator=g) * expand_blocks(2.0 ** torch.randint(-3, 4, (m, kb), generator=g), m, k, 1)
    w = torch.randn(n, k, generator=g) * expand_blocks(2.0 ** torch.randint(-3, 4, (nb, kb), generator=g), n, k)
    return x, w / k**0.5


def _layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """The [rows, G] grid as the layout says; padding (of `padded` rows) is NaN."""
    from gemmtune.quant import layouts

    if layout == "mmajor":
        return layouts.m_major(s)
    if layout == "padded":
        rows, cols = s.shape
        buf = torch.full((rows, layouts.round_up(cols, 4) + 4), float("nan"), device=s.device)
        buf[:, :cols] = s
        return buf[:, :cols]
    return s.contiguous()


def run_case(case, device: str) -> dict:
    from gemmtune.kernels import skinny_blockscale as kb
    from gemmtune.kernels.skinny import SkinnyConfig
    from gemmtune.quant.quantize import quantize_1x128, quantize_128x128

    cfg_name, m, n, k, xs_layout, ws_layout, out = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    x, w = _operands(m, n, k, g)
    (xq, xs), (wq, ws) = quantize_1x128(x, FP8), quantize_128x128(w, FP8)
    args = [xq.to(device), wq.to(device), _layout(xs.to(device), xs_layout), _layout(ws.to(device), ws_layout)]
    with kc.nan_outputs(kb):
        y = kb.skinny_blockscale(*args, out_dtype=_DT[out], cfg=SkinnyConfig.parse(cfg_name))
    return kc.rel_outcome(y, kb.skinny_blockscale_ref(*args), (m, n), _DT[out])


def run_cases(cases, device):
    return {_name(c): run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results(request):
    if FP8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    return kc.kernel_results(__file__, run_cases, CASES, GPU_CASES, request)


# The default tier: each config on two of the shapes, the shapes in turn (every config, shape and scale
# layout runs); the other pairs are slow.
_DEFAULT = {i for i in range(len(CASES)) if (i % len(_SHAPES) - i // len(_SHAPES)) % len(_SHAPES) in (0, 1)}


@pytest.mark.parametrize("case", tiered_at(CASES, _DEFAULT) + (GPU_CASES if HAS_GPU else []), ids=_name)
def test_kernel_matches_reference(case, results):
    kc.assert_rel_outcome(results[_name(case)], case[6])


def test_padded_grid_really_is_strided_and_poisoned():
    """The layouts the kernel cases hand over are what they claim (else the stride cases test nothing)."""
    s = torch.arange(6.0).reshape(2, 3)
    p = _layout(s, "padded")
    assert p.stride() == (8, 1) and torch.equal(p, s) and torch.isnan(p.as_strided((2, 8), (8, 1))[:, 3:]).all()
    assert _layout(s, "mmajor").stride() == (1, 2)


# ---- solutions (no kernels run) -----------------------------------------------------------------


@pytest.mark.parametrize("fam", ["a8w8_blockscale", "a8w8_blockscale_bpreshuffle"])
def test_candidates_round_trip_and_stay_decode_fp8_only(fam):
    from gemmtune import backends
    from gemmtune.kernels.skinny_blockscale import config_ok

    cpu, be = torch.device("cpu"), backends.get("skinny", fam)
    assert be is not None and not be.is_available(cpu)
    keys = [BlockKey(1, 1280, 8192, FP8), BlockKey(4, 77, 384, FP8, torch.float16), BlockKey(16, 8192, 1024, FP8)]
    assert set().union(*(kc.skinny_candidate_kinds(be, key, "blockscale_") for key in keys)) == {"dot", "gemv"}
    for key in keys:
        assert all(config_ok(be.parse(s.kernel_name)) for s in be.candidates(key, cpu))
        assert be.candidates(key._replace(q_dtype_w=torch.int8), cpu) == []
        assert be.candidates(key._replace(K=key.K + 64), cpu) == []


@pytest.mark.parametrize(
    "name",
    ["skinny_dot_bn64_bk128_sk1_w4_s3", "a8w8_skinny_dot_bn64_bk128_sk1_w4_s3",
     "blockscale_skinny_dot_bn64_bk256_sk1_w4_s3", "blockscale_skinny_dot_bn256_bk128_sk1_w4_s3",
     "blockscale_skinny_gemv_bn8_bk512_sk1_w4_s1", "blockscale_skinny_dot_bn64_bk16_sk1_w4_s3",
     "blockscale_skinny_dot_bn64_bk128_sk2_w4_s3_at", ""],
)  # fmt: skip
def test_other_names_give_none(name):
    from gemmtune import backends

    assert backends.get("skinny", "a8w8_blockscale").solution_from_row(0, name, 0) is None


def test_bad_operands_raise_value_error():
    from gemmtune.kernels.skinny import SkinnyConfig
    from gemmtune.kernels.skinny_blockscale import skinny_blockscale

    xq, wq = torch.zeros(2, 256, dtype=FP8), torch.zeros(130, 256, dtype=FP8)
    xs, ws = torch.ones(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="K"):
        skinny_blockscale(xq, wq[:, :128], xs, ws)
    with pytest.raises(ValueError, match="fp8"):
        skinny_blockscale(xq.to(torch.int8), wq.to(torch.int8), xs, ws)
    with pytest.raises(ValueError, match="multiple of 128"):
        skinny_blockscale(xq[:, :192], wq[:, :192], xs, ws)
    with pytest.raises(ValueError, match="x_scale"):
        skinny_blockscale(xq, wq, torch.ones(2, 1), ws)
    with pytest.raises(ValueError, match="w_scale"):
        skinny_blockscale(xq, wq, xs, torch.ones(1, 2))
    with pytest.raises(ValueError, match="block_k"):
        skinny_blockscale(xq, wq, xs, ws, cfg=SkinnyConfig("dot", 64, 256))


# ---- GPU ----------------------------------------------------------------------------------------

_GPU_KEYS = [BlockKey(1, 1000, 1152, FP8, torch.bfloat16), BlockKey(3, 4096, 128 * 33, FP8, torch.float32),
             BlockKey(16, 333, 4224, FP8, torch.float16)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fam_name", ["a8w8_blockscale", "a8w8_blockscale_bpreshuffle"])
@pytest.mark.parametrize("key", tiered(_GPU_KEYS, lambda k: k.M == 1), ids=lambda k: k.describe().replace(" ", "_"))
def test_gpu_every_candidate_passes_the_family_check_and_replays_bit_equal(gpu, key, fam_name):
    from gemmtune import backends, families

    # The family check also runs row-major x_scale and packed w_scale beside make_inputs' layouts.
    sols = kc.check_every_candidate(backends.get("skinny", fam_name), families.get(fam_name), key, gpu)
    assert any("_fx" in s.kernel_name for s in sols) and any("gemv" in s.kernel_name for s in sols) == (key.M <= 4)


@pytest.mark.gpu
def test_gpu_runner_past_max_rows_and_op_dispatch(gpu, clean_dispatch):
    """A runner called past MAX_ROWS hands off to the untuned default; a tuned row with libtype
    skinny runs through gemmtune's gemm_a8w8_blockscale op."""
    from gemmtune import backends, families
    from gemmtune.ops import quantized as qops

    fam, be = families.get("a8w8_blockscale"), backends.get("skinny", "a8w8_blockscale")
    key = BlockKey(4, 1280, 8192, FP8, torch.bfloat16)
    kc.check_past_max_rows_and_dispatch(
        be, fam, key, gpu, clean_dispatch, lambda *a: qops.gemm_a8w8_blockscale(*a, torch.bfloat16)
    )


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(kc.chosen_cases(CASES), "cpu")))
