"""8-bit GEMMs on the CPU: quantizers, the ops against the dequantize-then-fp32 reference on odd shapes
(every scale kind, bias and none, leading dims), the families' compute methods, validation errors,
dispatch through tuned rows, and the custom ops under torch.compile's fake tensors."""

from __future__ import annotations

import pytest
import torch

from gemmtune import families
from gemmtune.families.quantized import BlockKey, QuantKey
from gemmtune.ops import quantized as qops
from gemmtune.quant import (
    FP8,
    dequantize,
    dequantize_1x128,
    dequantize_128x128,
    qmax,
    quant_dtype,
    quantize_1x128,
    quantize_128x128,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
    shuffle_weight,
)

QDTYPES = [torch.int8, FP8]
_ID = {torch.int8: "int8", FP8: "fp8"}


def _rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _data(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5


# ---- quantizers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", QDTYPES, ids=_ID.get)
def test_quantizers_round_trip_within_half_a_step(dt):
    x, w = _data(7, 300, 384)
    x[3] = 0.0  # an all-zero row: scale stays positive, q stays 0
    cases = [
        (quantize_per_tensor(x, dt), dequantize, (1,)),
        (quantize_per_token(x, dt), dequantize, (7, 1)),
        (quantize_per_channel(w, dt), lambda q, s: dequantize(q, s.reshape(-1, 1)), (1, 300)),
        (quantize_1x128(x, dt), dequantize_1x128, (7, 3)),
        (quantize_128x128(w, dt), dequantize_128x128, (3, 3)),
    ]
    for (q, s), deq, shape in cases:
        assert q.dtype == dt and s.dtype == torch.float32 and tuple(s.shape) == shape
        assert torch.isfinite(s).all() and (s > 0).all()
        src = x if q.shape == x.shape else w
        back = deq(q, s)
        assert torch.isfinite(back).all()
        # fp8 e4m3 keeps 3 mantissa bits: relative step 1/8; int8: half a step of the scale.
        tol = 0.07 if dt != torch.int8 else 0.02
        assert _rel(back, src) < tol, (shape, _rel(back, src))
    assert (quantize_per_token(x, dt)[0][3].float() == 0).all()


def test_quantizer_uses_full_range_and_knows_fnuz():
    x, _ = _data(4, 1, 256)
    q, _ = quantize_per_token(x, torch.int8)
    assert q.abs().amax(dim=1).eq(127).all()
    assert qmax(FP8) == 448.0 and qmax(torch.int8) == 127.0
    if hasattr(torch, "float8_e4m3fnuz"):
        assert qmax(torch.float8_e4m3fnuz) == 240.0
        assert quant_dtype("fp8_fnuz") == torch.float8_e4m3fnuz
    with pytest.raises(ValueError, match="unknown quantized dtype"):
        quant_dtype("fp4")


def test_quantize_128x128_ragged_n_and_k():
    _, w = _data(1, 200, 130)
    q, s = quantize_128x128(w, FP8)
    assert tuple(s.shape) == (2, 2)
    # each block's largest magnitude maps to the format's max
    assert q[:128, :128].float().abs().max() == 448.0 and q[128:, 128:].float().abs().max() == 448.0


# ---- ops against the reference ----------------------------------------------------------------------
SHAPES = [(1, 77, 203), (3, 64, 256), (17, 130, 96), (64, 33, 520)]


@pytest.mark.parametrize("dt", QDTYPES, ids=_ID.get)
@pytest.mark.parametrize("scale", ["per_tensor", "per_token", "mixed"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemm_a8w8_matches_dequantized_reference(dt, scale, bias, out):
    fam = families.get("a8w8")
    for m, n, k in SHAPES:
        x, w = _data(m, n, k, seed=m + n)
        if scale == "per_tensor":
            (xq, xs), (wq, ws) = quantize_per_tensor(x, dt), quantize_per_tensor(w, dt)
        elif scale == "per_token":
            (xq, xs), (wq, ws) = quantize_per_token(x, dt), quantize_per_channel(w, dt)
        else:
            (xq, xs), (wq, ws) = quantize_per_tensor(x, dt), quantize_per_channel(w, dt)
        b = torch.randn(n).to(out) if bias else None
        y = qops.gemm_a8w8(xq, wq, xs, ws, b, out)
        key = QuantKey(m, n, k, dt, "per_tensor" if scale == "per_tensor" else "per_token", bias, out)
        ref = fam.reference(key, (xq, wq, xs.reshape(-1, 1), ws.reshape(1, -1), b))
        assert y.shape == (m, n) and y.dtype == out
        assert _rel(y, ref) < fam.error_threshold(key)


@pytest.mark.parametrize("dt", QDTYPES, ids=_ID.get)
def test_gemm_a8w8_leading_dims_strided_rows_and_scale_shapes(dt):
    x, w = _data(6, 40, 128)
    xq, xs = quantize_per_token(x, dt)
    wq, ws = quantize_per_channel(w, dt)
    ref = qops.gemm_a8w8(xq, wq, xs, ws)
    y3 = qops.gemm_a8w8(xq.view(2, 3, 128), wq, xs.view(2, 3, 1), ws.view(40))
    assert y3.shape == (2, 3, 40) and torch.equal(y3.reshape(6, 40), ref)
    wide = torch.zeros(6, 160, dtype=dt)
    wide[:, :128] = xq
    assert torch.equal(qops.gemm_a8w8(wide[:, :128], wq, xs, ws.view(40, 1)), ref)
    # the pre-shuffled op: same numbers, weight from shuffle_weight (also from a [K, N] copy)
    assert torch.equal(qops.gemm_a8w8_bpreshuffle(xq, shuffle_weight(wq.t().contiguous(), "kn"), xs, ws), ref)


def test_int8_gemm_is_gemm_a8w8_for_int8():
    x, w = _data(5, 48, 64)
    (xq, xs), (wq, ws) = quantize_per_token(x, torch.int8), quantize_per_channel(w, torch.int8)
    y = qops.int8_gemm(xq, wq, xs, ws.view(48))
    assert y.dtype == torch.float16
    assert torch.equal(y, qops.gemm_a8w8(xq, wq, xs, ws, None, torch.float16))
    with pytest.raises(ValueError, match="must be int8"):
        qops.int8_gemm(xq.to(FP8), wq.to(FP8), xs, ws)


@pytest.mark.parametrize("dt", QDTYPES, ids=_ID.get)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gemm_a8w8_blockscale_matches_dequantized_reference(dt, out):
    fam = families.get("a8w8_blockscale")
    for m, n, k in [(1, 77, 128), (5, 200, 384), (33, 128, 256), (130, 260, 512)]:
        x, w = _data(m, n, k, seed=m)
        (xq, xs), (wq, ws) = quantize_1x128(x, dt), quantize_128x128(w, dt)
        key = BlockKey(m, n, k, dt, out)
        ref = fam.reference(key, (xq, wq, xs, ws))
        y = qops.gemm_a8w8_blockscale(xq, wq, xs, ws, out)
        assert y.shape == (m, n) and y.dtype == out and _rel(y, ref) < fam.error_threshold(key)
        yb = qops.gemm_a8w8_blockscale_bpreshuffle(xq, shuffle_weight(wq), xs.t().contiguous().t(), ws, out)
        assert torch.equal(yb, y)


def test_empty_and_k0_shapes():
    xq = torch.zeros(0, 64, dtype=torch.int8)
    wq = torch.zeros(8, 64, dtype=torch.int8)
    assert qops.gemm_a8w8(xq, wq, torch.ones(1), torch.ones(1)).shape == (0, 8)
    y = qops.gemm_a8w8(torch.zeros(3, 0, dtype=torch.int8), torch.zeros(8, 0, dtype=torch.int8), torch.ones(1),
                       torch.ones(1))  # fmt: skip
    assert torch.equal(y, torch.zeros(3, 8, dtype=torch.bfloat16))


# ---- bad input --------------------------------------------------------------------------------------
def _good(m=4, n=32, k=128, dt=torch.int8):
    x, w = _data(m, n, k)
    return (*quantize_per_token(x, dt), *quantize_per_channel(w, dt))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "x_scale": torch.ones(3, 1)}, r"x_scale must have 1 element .* \[M=4, 1\]"),
        (lambda a: {**a, "w_scale": torch.ones(1, 31)}, r"w_scale .* \[1, N=32\]"),
        (lambda a: {**a, "x_scale": a["x_scale"].half()}, "x_scale must be float32"),
        (lambda a: {**a, "XQ": a["XQ"].float()}, "share one 8-bit dtype"),
        (lambda a: {**a, "WQ": a["WQ"].to(FP8)}, "share one 8-bit dtype"),
        (lambda a: {**a, "WQ": a["WQ"][:, :64]}, "inner dimensions differ: K=128"),
        (lambda a: {**a, "bias": torch.zeros(31, dtype=torch.bfloat16)}, r"bias must be \[N=32\]"),
        (lambda a: {**a, "bias": torch.zeros(32)}, "bias dtype torch.float32 must be the output dtype"),
        (lambda a: {**a, "dtype": torch.int32}, "unsupported output dtype"),
        (lambda a: {**a, "w_scale": a["w_scale"].to("meta")}, "different devices"),
    ],
)
def test_gemm_a8w8_bad_input(mutate, match):
    xq, xs, wq, ws = _good()
    args = mutate(dict(XQ=xq, WQ=wq, x_scale=xs, w_scale=ws, bias=None, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        qops.gemm_a8w8(**args)


def test_blockscale_bad_input():
    x, w = _data(4, 200, 256)
    (xq, xs), (wq, ws) = quantize_1x128(x, FP8), quantize_128x128(w, FP8)
    with pytest.raises(ValueError, match="K=192 is not a multiple of 128"):
        qops.gemm_a8w8_blockscale(xq[:, :192], wq[:, :192], xs, ws)
    with pytest.raises(ValueError, match=r"x_scale must be \[M=4, K/128=2\]"):
        qops.gemm_a8w8_blockscale(xq, wq, xs[:, :1], ws)
    with pytest.raises(ValueError, match=r"w_scale must be \[ceil\(N/128\)=2, K/128=2\]"):
        qops.gemm_a8w8_blockscale(xq, wq, xs, ws[:1])
    with pytest.raises(ValueError, match="pre-shuffled weight"):
        qops.gemm_a8w8_blockscale_bpreshuffle(xq, wq.t().contiguous().t(), xs, ws)
    with pytest.raises(TypeError, match="w_scale must be a tensor"):
        qops.gemm_a8w8_blockscale(xq, wq, xs, 1.0)
    with pytest.raises(ValueError, match="shuffle_weight: weight dtype"):
        shuffle_weight(torch.zeros(4, 4))


# ---- families, dispatch, compile --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a8w8", "a8w8_bpreshuffle", "a8w8_blockscale", "a8w8_blockscale_bpreshuffle"])
def test_family_compute_methods_and_default_runner(name):
    fam = families.get(name)
    assert fam.unrunnable is None
    key = (QuantKey(5, 70, 256, FP8, "per_token", True, torch.bfloat16) if "blockscale" not in name
           else BlockKey(5, 70, 256, FP8, torch.bfloat16))  # fmt: skip
    sets = fam.make_inputs(key, torch.device("cpu"), 2, seed=3)
    assert len(sets) == 2 and not torch.equal(sets[0][0].float(), sets[1][0].float())
    from gemmtune.dispatch import get_dispatcher

    run = get_dispatcher().runner_for(key, torch.device("cpu"), family=name)
    for what, inputs, shape in [("plain", sets[0], fam.output_shape(key)), *fam.check_variants(key, sets[0])]:
        y = run(*inputs)
        assert tuple(y.shape) == shape, what
        assert _rel(y, fam.reference(key, inputs)) < fam.error_threshold(key), what
    # 8-bit roof: at large M compute-bound at twice the bf16 rate
    big = key._replace(M=8192, N=8192, K=8192)
    assert fam.roof_us(big, 3e12, 800e12) == pytest.approx(2 * 8192**3 / 1.6e15 * 1e6)
    assert fam.bytes(key) > (key.M + key.N) * key.K


def test_blockscale_family_rejects_ragged_k():
    with pytest.raises(ValueError, match="not a multiple of 128"):
        families.get("a8w8_blockscale").make_inputs(BlockKey(4, 64, 100), torch.device("cpu"), 1, 0)


def test_tuned_torch_row_is_used_and_unknown_libtype_falls_back(tmp_path):
    import gemmtune

    path = tmp_path / "a8w8_tuned_gemm.csv"
    fam = families.get("a8w8")
    from gemmtune.device import identity

    me = identity("cpu")
    tail = "per_token,False,torch.bfloat16"
    rows = [f"{me.gfx},{me.cu_num},4,32,128,torch.int8,0,0,1.0,dequant,0,0,0,torch,{tail}",
            f"{me.gfx},{me.cu_num},4,48,128,torch.int8,3,0,1.0,ck_kernel,0,0,0,ck,{tail}"]  # fmt: skip
    path.write_text("\n".join([",".join(fam.tuned_columns), *rows]) + "\n")
    gemmtune.set_config(str(path))
    res = gemmtune.resolve(QuantKey(4, 32, 128), "cpu", family="a8w8")
    assert res.row is not None and res.solution.kernel_name == "dequant"
    res = gemmtune.resolve(QuantKey(4, 48, 128), "cpu", family="a8w8")
    assert res.row is not None and "fallback" in res.note
    xq, xs, wq, ws = _good(n=48)
    assert qops.gemm_a8w8(xq, wq, xs, ws).shape == (4, 48)


def test_backends_registered_and_solutions_round_trip():
    from gemmtune import backends

    for fam in ("a8w8", "a8w8_bpreshuffle", "a8w8_blockscale", "a8w8_blockscale_bpreshuffle"):
        got = backends.all_backends(fam)
        assert {"torch", "triton"} <= set(got), fam
        tb = got["triton"]
        key = QuantKey(16, 4096, 4096, FP8) if "blockscale" not in fam else BlockKey(16, 4096, 4096)
        from gemmtune.backends.lib.quant_tiles import tile_configs

        cfgs = tile_configs(tb.kind, key, torch.device("cuda"))
        assert cfgs and all(tb.solution_from_row(0, c.name, 0).kernel_name == c.name for c in cfgs)
        assert tb.solution_from_row(0, "a8w8_bm16_bn7_bk32_g1_sk1_w4_s4", 0) is None  # not a power of two
        assert got["torch"].solution_from_row(0, "anything", 0).kernel_name == "native"


def test_custom_ops_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    xq, xs, wq, ws = _good()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        f = [mode.from_tensor(t) for t in (xq.view(2, 2, 128), wq, xs.view(2, 2, 1), ws)]
        y = torch.ops.gemmtune.gemm_a8w8(*f, None, torch.float16)
        assert y.shape == (2, 2, 32) and y.dtype == torch.float16
        x, w = _data(4, 32, 256)
        (bq, bs), (bw, bws) = quantize_1x128(x, FP8), quantize_128x128(w, FP8)
        y = torch.ops.gemmtune.gemm_a8w8_blockscale(*(mode.from_tensor(t) for t in (bq, bw, bs, bws)), torch.bfloat16)
        assert y.shape == (4, 32)


def test_compiled_call_matches_eager():
    xq, xs, wq, ws = _good(m=8, n=32, k=128)

    def f(a, b, c, d):
        return qops.gemm_a8w8(a, b, c, d) * 2

    eager = f(xq, wq, xs, ws)
    compiled = torch.compile(f, backend="eager", fullgraph=True)(xq, wq, xs, ws)
    assert torch.equal(compiled, eager)
