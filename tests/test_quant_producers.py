"""8-bit producers (kernels/quant_producers.py): RMSNorm (+ residual add) and act(gate) * up that emit the
quantized activation and its scales, against the unfused chain (the op's reference, then quant/quantize.py).

Without a GPU the Triton kernels run under the interpreter in a subprocess (kernel_cases.py), fp32 and
fp16; with one, in-process, bf16 included. Every output is poisoned first (NaN, or -128 for int8, which
the quantizer never writes), so an element a kernel skips fails. The interpreter's fp8 cast rounds a
value that carries into the next power of two down instead (31.6 -> 16, not 32), so there the fp8
values are checked against that same cast of the reference's scaled values; on a GPU against torch's.
The PyTorch path (what runs on the CPU), the custom ops and their fake impls run in-process.
"""

from __future__ import annotations

import contextlib
import json
import zlib

import pytest
import torch
from kernel_cases import kernel_results

from gemmtune.kernels import activations, norms
from gemmtune.kernels import quant as kq
from gemmtune.kernels import quant_producers as P
from gemmtune.quant import quantize as Q
from gemmtune.quant.layouts import is_m_major

HAS_GPU = torch.cuda.is_available()
KINDS = ("rmsnorm", "add_rmsnorm", "silu", "gelu_tanh")
FP8 = torch.float8_e4m3fn


def _cases(dtypes, shapes):
    return [
        (f"{kind}-{dt}-{qd}-{sc}-M{m}-K{k}", kind, dt, qd, sc, m, k)
        for kind in KINDS
        for dt in dtypes
        for qd in ("int8", "fp8")
        for sc in P.SCALINGS
        for m, k in shapes
    ]


# K: not a multiple of 16 (96 is, but under one 128 group), ragged last group (200), three groups (384);
# 4100 a norm row past 4096, and the per-token act kernel's row read once (one pass) or, its "-twopass"
# twin (ONE_PASS_MAX lowered), in two passes that each loop twice; 1040 read as a 1024 block and a 16
# tail ("-tail": quant.TAIL_MIN_ROWS lowered to reach it with two rows).
CASES = _cases(("float32", "float16"), [(1, 96), (3, 200), (17, 384)]) + _cases(("float16",), [(2, 4100)])
CASES += [(f"{c[0]}-twopass", *c[1:]) for c in CASES if c[1] in ("silu", "gelu_tanh") and c[-1] == 4100]
CASES += [(f"{c[0]}-tail", *c[1:]) for c in _cases(("float16",), [(2, 1040)]) if c[1] in ("silu", "gelu_tanh")]
GPU_CASES = _cases(("bfloat16",), [(1, 96), (3, 200), (17, 384), (300, 4096), (2, 14336), (1030, 17408)])
ALL = CASES + (GPU_CASES if HAS_GPU else [])


@contextlib.contextmanager
def poisoned_outputs():
    """P._alloc hands out poisoned tensors: NaN, or -128 for int8 (the quantizer clamps to +-127)."""
    saved = P._alloc

    def alloc(shape, dtype, device, strides=None):
        return saved(shape, dtype, device, strides).fill_(-128 if dtype == torch.int8 else float("nan"))

    P._alloc = alloc
    try:
        yield
    finally:
        P._alloc = saved


def _poisoned(t: torch.Tensor) -> int:
    return int((t == -128).sum()) if t.dtype == torch.int8 else int(torch.isnan(t.float()).sum())


def _inputs(kind, dtype, m, k, device, gen):
    if kind in ("silu", "gelu_tanh"):
        return {"gu": (torch.randn(m, 2 * k, generator=gen) * 2).to(dtype).to(device)}
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(k, generator=gen) * 0.5 + 1).to(dtype).to(device)
    r = torch.randn(m, k, generator=gen).to(dtype).to(device) if kind == "add_rmsnorm" else None
    return {"x": x, "w": w, "r": r}


def run_producer(kind, t, qdtype, scaling, impl):
    """(q, scale, residual sum or None, the 16-bit value quantized, its fp32 counterpart) of one producer."""
    if kind in ("silu", "gelu_tanh"):
        q, s = P.act_mul_quant(t["gu"], kind, qdtype, scaling, impl=impl)
        y = activations.act_mul(t["gu"], kind, impl="ref")
        return q, s, None, y, activations.act_mul(t["gu"].float(), kind, impl="ref")
    if kind == "rmsnorm":
        q, s = P.rmsnorm_quant(t["x"], t["w"], 1e-6, qdtype, scaling, impl=impl)
        total = None
        x = t["x"]
    else:
        q, s, total = P.add_rmsnorm_quant(t["x"], t["r"], t["w"], 1e-6, qdtype, scaling, impl=impl)
        x = t["r"] + t["x"]
    return q, s, total, norms.rmsnorm_ref(x, t["w"], 1e-6), norms.rmsnorm_ref(x.float(), t["w"].float(), 1e-6)


def _expand(s, scaling, k):
    return s if scaling == "per_token" else s.repeat_interleave(128, dim=1)[:, :k]


def _expected_fp8(y, s, scaling, device):
    """The reference's scaled values cast to fp8 the way the kernel's device casts them."""
    scaled = (y.float() / _expand(s, scaling, y.shape[-1])).clamp(-448, 448)
    if device != "cpu":
        return scaled.to(FP8)
    return _interpreter_cast(scaled)


def _interpreter_cast(v: torch.Tensor) -> torch.Tensor:
    import triton
    import triton.language as tl

    @triton.jit
    def cast(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty), mask=offs < n)

    out = torch.empty(v.shape, dtype=FP8)
    cast[(triton.cdiv(v.numel(), 1024),)](v.contiguous(), out, v.numel(), BLOCK=1024)
    return out


def run_case(case, device: str) -> dict:
    name, kind, dt, qd, scaling, m, k = case
    dtype, qdtype = getattr(torch, dt), (torch.int8 if qd == "int8" else FP8)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = _inputs(kind, dtype, m, k, device, gen)
    one_pass_max, tail_rows = P.ONE_PASS_MAX, kq.TAIL_MIN_ROWS
    P.ONE_PASS_MAX = used = 4096 if name.endswith("-twopass") else one_pass_max
    kq.TAIL_MIN_ROWS = 1 if name.endswith("-tail") else tail_rows
    try:
        with poisoned_outputs():
            q, s, total, y, y32 = run_producer(kind, t, qdtype, scaling, "triton")
    finally:
        P.ONE_PASS_MAX, kq.TAIL_MIN_ROWS = one_pass_max, tail_rows
    # the per-token act launch kept for this case's gate_up and threshold: two passes for a "-twopass" case
    plans = [plan for sig, plan in P._ACT_PLANS.items()
             if sig[0][0] == (m, 2 * k) and sig[1:4] == (kind, qdtype, scaling) and sig[-1] == used]  # fmt: skip
    one_pass, tails = [plan.kwargs.get("ONE_PASS") for plan in plans], [plan.kwargs.get("TAIL") for plan in plans]
    _, s_ref = P.quantize_ref(y, qdtype, scaling)
    deq = q.float() * _expand(s, scaling, k)
    scale_layout = s.shape == (m, 1) if scaling == "per_token" else s.shape == (m, -(-k // 128)) and is_m_major(s)
    out = {
        "poisoned": _poisoned(q) + _poisoned(s) + (_poisoned(total) if total is not None else 0),
        "layout_ok": q.shape == (m, k) and q.dtype == qdtype and s.dtype == torch.float32 and scale_layout,
        "scale_err": ((s - s_ref).abs().max() / s_ref.abs().max()).item(),
        "sum_equal": total is None or torch.equal(total, t["r"] + t["x"]),
        "vs_fp32": ((deq - y32).norm() / y32.norm()).item(),
        "one_pass": one_pass,
        "tails": tails,
    }
    if qdtype == torch.int8:
        out["q_steps"] = (q.float() - P.quantize_ref(y, qdtype, scaling)[0].float()).abs().max().item()
    else:  # the same cast of the reference's values, dequantized: one fp8 step apart at most here and there
        want = _expected_fp8(y, s_ref, scaling, device).float() * _expand(s_ref, scaling, k)
        out["q_rel"] = ((deq - want).norm() / want.norm()).item()
    return out


def run_cases(cases, device):
    return {c[0]: run_case(c, device) for c in cases}


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


# Scales vs the reference's: fp32, the norm's sum order; half types, one rounding of the value quantized.
SCALE_TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
# Dequantized vs the fp32 op: the 8-bit rounding (int8 half a step of the row's or group's max, e4m3 3
# mantissa bits); the interpreter's fp8 cast halves a few values, so fp8 is bounded loosely there.
FP32_TOL = {"int8": 0.03, "fp8": 0.06 if HAS_GPU else 0.12}


@pytest.mark.parametrize("case", ALL, ids=[c[0] for c in ALL])
def test_kernel_matches_the_unfused_reference(case, results):
    r = results[case[0]]
    dt, qd = case[2], case[3]
    assert r["poisoned"] == 0 and r["layout_ok"] and r["sum_equal"], r
    if case[0].endswith("-twopass") and case[4] == "per_token":
        assert r["one_pass"] == [False], r  # the two-pass kernel ran, not the one-pass twin's kept launch
    if case[0].endswith("-tail") and case[4] == "per_token":
        assert r["tails"] == [16], r  # the block-and-tail launch ran
    assert r["scale_err"] <= SCALE_TOL[dt], r
    if qd == "int8":
        assert r["q_steps"] <= 1, r  # a value one ulp off, or a tie rounded away from zero
    else:
        assert r["q_rel"] <= 1e-2, r
    assert r["vs_fp32"] <= FP32_TOL[qd] + (2e-2 if dt == "bfloat16" else 0), r


# ---- the PyTorch path, the ops, their fake impls ---------------------------------------------------
FORMATS = [(qd, sc) for qd in (torch.int8, FP8) for sc in P.SCALINGS]


def _composed(kind, t, qdtype, scaling):
    """The unfused chain spelled out: the op's reference, then quant/quantize.py's quantizer."""
    if kind in ("silu", "gelu_tanh"):
        y, total = activations.act_mul(t["gu"], kind, impl="ref"), None
    elif kind == "rmsnorm":
        y, total = norms.rmsnorm_ref(t["x"], t["w"], 1e-6), None
    else:
        y, total = norms.add_rmsnorm_ref(t["x"], t["r"], t["w"], 1e-6)
    if scaling == "per_token":
        q, s = Q.quantize_per_token(y, qdtype)
    else:
        q, s = Q.quantize_1x128(y, qdtype)
    return q, s.reshape(-1, s.shape[-1]) if scaling == "1x128" else s, total


@pytest.mark.parametrize("qdtype,scaling", FORMATS, ids=[f"{q}-{s}" for q, s in FORMATS])
@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_path_is_the_unfused_chain_exactly(kind, dt, qdtype, scaling):
    for m, k in ((1, 96), (3, 200), (17, 384)):
        t = _inputs(kind, dt, m, k, "cpu", torch.Generator().manual_seed(m * k))
        with poisoned_outputs():
            q, s, total, _, _ = run_producer(kind, t, qdtype, scaling, "auto")
        q_want, s_want, total_want = _composed(kind, t, qdtype, scaling)
        assert q.dtype == qdtype and torch.equal(q.float(), q_want.float())
        assert torch.equal(s, s_want) and (scaling == "per_token" or is_m_major(s))
        assert total is None or torch.equal(total, total_want)


def _op_calls(qdtype, scaling):
    g = torch.Generator().manual_seed(7)
    x, r, w = torch.randn(2, 3, 256, generator=g), torch.randn(2, 3, 256, generator=g), torch.randn(256, generator=g)
    gu = torch.randn(5, 512, generator=g).half()
    ops = torch.ops.gemmtune
    return [
        (ops.rmsnorm_quant.default, (x, w, 1e-6, 0.0, True, qdtype, scaling)),
        (ops.add_rmsnorm_quant.default, (x.half(), r.half(), w.half(), 1e-5, 1.0, False, qdtype, scaling)),
        (ops.act_mul_quant.default, (gu, "silu", qdtype, scaling)),
        (ops.act_mul_quant.default, (gu.float(), "gelu_tanh", qdtype, scaling)),
    ]


@pytest.mark.parametrize("qdtype,scaling", FORMATS, ids=[f"{q}-{s}" for q, s in FORMATS])
def test_ops_pass_opcheck(qdtype, scaling):
    """The fake impls give the real outputs' shapes, dtypes and strides (M-major 1x128 scales included)."""
    for op, args in _op_calls(qdtype, scaling):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("scaling", P.SCALINGS)
def test_torch_compile_fullgraph_runs_the_ops(backend, scaling):
    seen = []

    def counting(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x, r, w, gu):
        q1, s1 = P.rmsnorm_quant(x, w, 1e-6, FP8, scaling)
        q2, s2, total = P.add_rmsnorm_quant(x, r, w, 1e-6, torch.int8, scaling)
        q3, s3 = P.act_mul_quant(gu, "silu", FP8, scaling)
        return q1, s1, q2, s2, total * 2, q3, s3

    g = torch.Generator().manual_seed(3)
    args = (torch.randn(2, 3, 256, generator=g), torch.randn(2, 3, 256, generator=g), torch.randn(256, generator=g),
            torch.randn(4, 768, generator=g))  # fmt: skip
    want = f(*args)
    got = torch.compile(f, fullgraph=True, backend=backend)(*args)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.float(), b.float())
    torch.compile(f, fullgraph=True, backend=counting)(*args)
    assert {"gemmtune.rmsnorm_quant", "gemmtune.add_rmsnorm_quant", "gemmtune.act_mul_quant"} <= set(seen), seen


def test_bad_arguments_name_the_problem():
    x, w = torch.randn(2, 128), torch.randn(128)
    with pytest.raises(ValueError, match="scaling"):
        P.rmsnorm_quant(x, w, 1e-6, torch.int8, "per_tensor")
    with pytest.raises(ValueError, match="8-bit"):
        P.add_rmsnorm_quant(x, x, w, 1e-6, torch.float16)
    with pytest.raises(ValueError, match="unknown activation"):
        P.act_mul_quant(x, "relu", torch.int8)
    with pytest.raises(ValueError, match="even"):
        P.act_mul_quant(torch.randn(2, 7), "silu", torch.int8)
    with pytest.raises(ValueError, match="weight"):
        P.rmsnorm_quant(x, torch.randn(64), 1e-6, torch.int8)


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("scaling", P.SCALINGS)
def test_gpu_ops_replay_in_a_cuda_graph_and_compile(scaling, gpu):
    """bf16 in, fp8 out: the eager kernels, a CUDA-graph replay and the compiled custom ops agree bit for bit."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 4096, generator=g).bfloat16().to(gpu)
    r = torch.randn(7, 4096, generator=g).bfloat16().to(gpu)
    w = (torch.randn(4096, generator=g) * 0.1 + 1).bfloat16().to(gpu)
    gu = torch.randn(7, 2 * 4096, generator=g).bfloat16().to(gpu)

    def f(x, r, w, gu):
        return (*P.add_rmsnorm_quant(x, r, w, 1e-6, FP8, scaling), *P.act_mul_quant(gu, "silu", FP8, scaling))

    eager = [t.clone() for t in f(x, r, w, gu)]
    f(x, r, w, gu)  # warm the launchers outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(x, r, w, gu)
    graph.replay()
    torch.cuda.synchronize()
    compiled = torch.compile(f, fullgraph=True)(x, r, w, gu)
    for e, c, k in zip(eager, captured, compiled):
        assert torch.equal(e.float(), c.float()) and torch.equal(e.float(), k.float())


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
