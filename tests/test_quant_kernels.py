"""Triton 8-bit kernels (kernels/a8w8.py, blockscale.py, quant.py) against their PyTorch references.

int8 cases run everywhere: without a GPU under the Triton interpreter in a subprocess (int8 dots
with int32 accumulation are exact there), with one on the GPU. fp8 e4m3 only runs on a GPU (the
interpreter cannot cast to fp8), so those cases are GPU-only. Outputs are NaN-poisoned first, so an
element a kernel skips fails. Shapes: M from 1 to 300, N and K not multiples of any block (K a
multiple of 128 for block-scale, which needs it), split-K and unsplit configs.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import kernel_results, nan_outputs

HAS_GPU = torch.cuda.is_available()

_CFGS = {
    "a8w8": [
        "a8w8_bm16_bn32_bk32_g1_sk1_w4_s2",
        "a8w8_bm16_bn64_bk64_g1_sk3_w4_s2",
        "a8w8_bm32_bn32_bk64_g4_sk2_w4_s2",
    ],
    # bn <= 128: one weight scale per tile and group (folded); bn256: two (a vector), run on the
    # M-major / row-padded scale layouts of quant/layouts.py
    "blockscale": [
        "blockscale_bm16_bn32_bk64_g1_sk1_w4_s2",
        "blockscale_bm32_bn64_bk128_g4_sk3_w4_s2",
        "blockscale_bm16_bn256_bk128_g1_sk2_w4_s2",
    ],
}
_A8W8_SHAPES = [(1, 77, 203, "per_token", True), (5, 70, 192, "per_tensor", False), (37, 130, 96, "per_token", False),
                (20, 33, 520, "per_tensor", True)]  # fmt: skip
_BLOCK_SHAPES = [(1, 77, 256), (7, 200, 384), (40, 130, 128)]


def _cases(dt: str) -> list:
    out = []
    for cfg in _CFGS["a8w8"]:
        out += [(f"{cfg}-{dt}-M{m}-N{n}-K{k}-{s}{'-bias' if b else ''}", "a8w8", cfg, dt, m, n, k, s, b)
                for m, n, k, s, b in _A8W8_SHAPES]  # fmt: skip
    for cfg in _CFGS["blockscale"]:
        out += [(f"{cfg}-{dt}-M{m}-N{n}-K{k}", "blockscale", cfg, dt, m, n, k, "", False) for m, n, k in _BLOCK_SHAPES]
    kinds = ("per_token", "per_token_twopass", "1x128", "1x128m")
    out += [(f"quant-{g}-{dt}-M{m}-K{k}", "quant", g, dt, m, 0, k, "", False)
            for g in kinds for m, k in ((1, 300), (6, 4100))]  # fmt: skip
    # a row read as a block and a tail (kernels/quant.py's row_launch, its row threshold lowered)
    out.append((f"quant-per_token_tail-{dt}-M3-K1040", "quant", "per_token_tail", dt, 3, 0, 1040, "", False))
    return out


CASES = _cases("int8")
GPU_CASES = _cases("fp8") + [(c[0] + "-large", *c[1:4], 300, 1000, 1024, *c[7:]) for c in _cases("fp8")[:1]]
# enough rows for the block-and-tail launch (kernels/quant.py's TAIL_MIN_ROWS) through the CUDA entry point
GPU_CASES.append(("quant-per_token-fp8-M1030-K4112", "quant", "per_token", "fp8", 1030, 0, 4112, "", False))
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _dtype(name):
    return torch.int8 if name == "int8" else torch.float8_e4m3fn


def _rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def run_case(case, device: str) -> dict:
    from gemmtune.kernels import a8w8 as ka
    from gemmtune.kernels import blockscale as kb
    from gemmtune.kernels import quant as kq
    from gemmtune.quant import quantize as Q
    from gemmtune.quant.layouts import is_m_major, k_padded, m_major

    name, kind, cfg_name, dt_name, m, n, k, scale, bias = case
    dt = _dtype(dt_name)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(m, k, generator=g)
    if kind == "quant":
        x = x.to(device)
        m_major = cfg_name == "1x128m"
        per_token = cfg_name.startswith("per_token")
        if device == "cpu" or cfg_name in ("per_token_twopass", "per_token_tail"):  # the CUDA entry's launchers
            q, s = _interp_quant(kq, x, dt, cfg_name)
        elif per_token:
            q, s = kq.quantize_per_token_triton(x, dt)
        else:
            q, s = kq.quantize_1x128_triton(x, dt, m_major=m_major)
        qr, sr = (Q.quantize_per_token if per_token else Q.quantize_1x128)(x, dt)
        deq = _deq_1x128 if not per_token else (lambda q_, s_: q_.float() * s_)
        tails = [p.kwargs.get("TAIL") for sig, p in kq._PER_TOKEN.items() if tuple(sig[0][0]) == (m, k)]
        return {"scale_err": (s - sr).abs().max().item() / sr.abs().max().item(),
                "q_steps": (q.float() - qr.float()).abs().max().item() if dt == torch.int8 else
                _rel(deq(q, s), deq(qr, sr)),
                "layout_ok": is_m_major(s) if m_major else s.is_contiguous(), "nan": 0,
                "tails": tails}  # fmt: skip
    w = torch.randn(n, k, generator=g) / k**0.5
    cfg = ka.TileConfig.parse(cfg_name)
    out = torch.bfloat16 if device != "cpu" else torch.float32  # the interpreter gets bf16 wrong
    if kind == "a8w8":
        if scale == "per_tensor":
            (xq, xs), (wq, ws) = Q.quantize_per_tensor(x, dt), Q.quantize_per_tensor(w, dt)
        else:
            (xq, xs), (wq, ws) = Q.quantize_per_token(x, dt), Q.quantize_per_channel(w, dt)
        b = torch.randn(n, generator=g).to(out) if bias else None
        args = [t.to(device) if t is not None else None for t in (xq, wq, xs, ws, b)]
        with nan_outputs(ka):
            y = ka.gemm_a8w8_triton(*args, out_dtype=out, cfg=cfg)
        ref = ka.a8w8_ref(*args, out_dtype=torch.float32)
    else:
        (xq, xs), (wq, ws) = Q.quantize_1x128(x, dt), Q.quantize_128x128(w, dt)
        args = [t.to(device) for t in (xq, wq, xs, ws)]
        if "bn256" in cfg_name:
            args[2], args[3] = m_major(args[2]), k_padded(args[3])
        with nan_outputs(kb):
            y = kb.gemm_blockscale_triton(*args, out_dtype=out, cfg=cfg)
        ref = kb.blockscale_ref(*args, out_dtype=torch.float32)
    return {"nan": int(torch.isnan(y).sum()), "err": _rel(y, ref), "shape_ok": tuple(y.shape) == (m, n)}


def _deq_1x128(q, s):
    return q.float() * s.repeat_interleave(128, 1)[:, : q.shape[1]]


def _interp_quant(kq, x, dt, kind):
    m, k = x.shape
    q = torch.empty(m, k, dtype=dt, device=x.device)
    if kind.startswith("per_token"):
        s = torch.empty(m, 1, device=x.device)
        rows = kq.TAIL_MIN_ROWS
        kq.TAIL_MIN_ROWS = 1 if kind.endswith("tail") else rows
        try:
            kq.launch_per_token(x, q, s, one_pass_max=16 if kind.endswith("twopass") else kq.ONE_PASS_MAX)
        finally:
            kq.TAIL_MIN_ROWS = rows
    else:
        s = kq.scales_1x128(m, k, x.device, m_major=kind == "1x128m")
        kq.launch_1x128(x, q, s)
    return q, s


def run_cases(cases, device):
    return {c[0]: run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.mark.parametrize("case", ALL, ids=[c[0] for c in ALL])
def test_kernel_matches_reference(case, results):
    r = results[case[0]]
    assert r["nan"] == 0
    if case[1] == "quant":
        assert r["scale_err"] < 1e-6 and r["layout_ok"]
        # int8: at most one step apart (rounding ties); fp8: the dequantized values agree closely
        assert r["q_steps"] <= (1 if case[3] == "int8" else 1e-2)
        if case[2] == "per_token_tail" or case[0] == "quant-per_token-fp8-M1030-K4112":
            assert r["tails"] == [16], r  # the block-and-tail launch ran
        return
    assert r["shape_ok"]
    # fp32 out (interpreter) vs bf16 out (GPU): the output rounding dominates on the GPU.
    assert r["err"] < (1e-5 if not HAS_GPU else 6e-3), r


@pytest.mark.parametrize("width", [1, 16, 300, 1040, 4096, 4112, 5120, 14336, 17408, 25600, 32767])
def test_row_pieces_are_a_block_or_a_block_and_a_tail(width):
    pytest.importorskip("triton")
    from gemmtune.kernels.quant import LEAST_TAIL, TAIL_MAX_FILL, TAIL_MIN_ROWS, row_pieces

    whole = max(LEAST_TAIL, 1 << (width - 1).bit_length())
    assert row_pieces(width, TAIL_MIN_ROWS - 1) == (whole,)  # few rows: one block, one reduction
    pieces = row_pieces(width, TAIL_MIN_ROWS)
    assert all(p >= LEAST_TAIL and p & (p - 1) == 0 for p in pieces) and sum(pieces) >= width, pieces
    assert pieces == (whole,) or (len(pieces) == 2 and sum(pieces) <= TAIL_MAX_FILL * whole), pieces


def test_row_launch_of_the_widths_one_block_padded_most():
    pytest.importorskip("triton")
    from gemmtune.kernels.quant import TAIL_MIN_ROWS, row_launch, row_pieces

    assert row_pieces(17408, TAIL_MIN_ROWS) == (16384, 1024) and row_pieces(4112, TAIL_MIN_ROWS) == (4096, 16)
    assert row_pieces(14336, TAIL_MIN_ROWS) == (16384,)  # a tail would pad 8192 + 8192: no gain
    want = {"BLOCK": 16384, "TAIL": 1024, "ONE_PASS": True, "num_warps": 32}
    assert row_launch(17408, TAIL_MIN_ROWS) == want
    assert row_launch(40000, TAIL_MIN_ROWS)["ONE_PASS"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["a8w8", "a8w8_blockscale"])
def test_triton_candidates_pass_the_family_check_and_replay_in_a_graph(family, gpu):
    """Every Triton candidate for a decode and a prefill key: accuracy vs the family reference, and a
    CUDA-graph replay equal to eager bit for bit."""
    from gemmtune import backends, families
    from gemmtune.families.quantized import FP8, BlockKey, QuantKey

    fam = families.get(family)
    be = backends.get("triton", family)
    for m in (3, 300):
        key = QuantKey(m, 1000, 1024, FP8, "per_token", True) if family == "a8w8" else BlockKey(m, 1000, 1024)
        inputs = fam.make_inputs(key, gpu, 1, seed=m)[0]
        ref = fam.reference(key, inputs)
        for sol in be.candidates(key, gpu):
            run = be.make_runner(sol, key, gpu)
            y = run(*inputs)
            assert _rel(y, ref) < fam.error_threshold(key), sol.kernel_name
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                yg = run(*inputs)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(yg, y), sol.kernel_name


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
