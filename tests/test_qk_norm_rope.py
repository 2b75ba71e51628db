"""Fused per-head q/k RMSNorm + rotary embedding (one launch) vs the reference and vs today's unfused
kernels (rmsnorm of q, rmsnorm of k, then rope).

Without a GPU the kernels run under the Triton interpreter in a subprocess (see test_norms.py), where
the fused kernel must equal the unfused kernels bit for bit; with one, in-process on the GPU, bf16 and
Qwen3 shapes included (there a row sum may be ordered differently: an output may move by one rounding).
Outputs are NaN-poisoned first.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, kernel_results, nan_outputs
from tiers import tiered

from gemmtune.kernels import norms, rope
from gemmtune.kernels import qk_norm_rope as F

HAS_GPU = torch.cuda.is_available()
EPS_Q, EPS_K = 1e-6, 0.5  # a large k eps, so a kernel that ignored it fails

# (name, B, S, Hq, Hkv, D, rotary dim, cos batch, layout, style, dtype)
CASES = [
    (f"{dt}-{st}-{lay}-d{d}r{r}-cb{cb}-h{hq}x{hkv}", 2, 5, hq, hkv, d, r, cb, lay, st, dt)
    for dt in ("float32", "float16")
    for st in ("llama", "gemma")
    for lay in ("qkv", "contig")
    for d, r in ((16, 16), (16, 8), (24, 16))
    for cb in (1, 2)
    for hq, hkv in ((4, 2), (16, 4))  # 20 heads: two head blocks, the second mixes q and k
] + [("float16-llama-qkv-qwen3-decode", 3, 1, 32, 4, 128, 128, 1, "qkv", "llama", "float16")]
# Qwen3 (Hq 32, Hkv 4 / 8, D 128) prefill shapes: GPU only (too slow for the interpreter)
QWEN3 = [
    (f"bfloat16-{st}-qkv-qwen3-b{b}s{s}-h32x{hkv}", b, s, 32, hkv, 128, 128, cb, "qkv", st, "bfloat16")
    for st in ("llama", "gemma")
    for b, s, cb in ((1, 2048, 1), (2, 1000, 2), (2, 77, 1))
    for hkv in (4, 8)
]
GPU_CASES = [(n.replace("float16", "bfloat16"), *c[:-1], "bfloat16") for n, *c in CASES if c[-1] == "float16"] + QWEN3
ALL = CASES + (GPU_CASES if HAS_GPU else [])
_DR, _HEADS = [(16, 16), (16, 8), (24, 16)], [(4, 2), (16, 4)]


def _in_default(case) -> bool:
    """The default tier of the grid: each dtype and head size, the two styles each with one layout, with
    one of the four (cos batch, head counts) pairs, the pairs in turn; the Qwen3 shapes all."""
    _, _, _, hq, hkv, d, r, cb, lay, st, dt = case
    if (d, r) not in _DR:
        return True
    turn = (dt != "float32") + (st == "gemma") + (lay == "contig") + _DR.index((d, r))
    return (st == "gemma") == (lay == "contig") and (cb - 1) * 2 + _HEADS.index((hq, hkv)) == turn % 4


# vs the same-dtype reference, relative to the largest output: fp32 sum order only; half types may
# differ by one rounding of the norm output, which rope then carries.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def make(case, device):
    name, B, S, HQ, HKV, D, r, cb, lay, style, dt = case
    dtype = getattr(torch, dt)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if lay == "qkv":  # views into a fused [B, S, (Hq + 2 Hkv) D] projection output
        full = torch.randn(B, S, (HQ + 2 * HKV) * D, generator=gen).to(dtype).to(device)
        q = full[..., : HQ * D].view(B, S, HQ, D)
        k = full[..., HQ * D : (HQ + HKV) * D].view(B, S, HKV, D)
    else:
        q = torch.randn(B, S, HQ, D, generator=gen).to(dtype).to(device)
        k = torch.randn(B, S, HKV, D, generator=gen).to(dtype).to(device)
    wq, wk = ((torch.randn(D, generator=gen) * 0.5 + (0 if style == "gemma" else 1)).to(dtype) for _ in "qk")
    cos = torch.randn(cb, S, r, generator=gen).to(dtype).to(device)
    sin = torch.randn(cb, S, r, generator=gen).to(dtype).to(device)
    kw = {"offset": 1.0, "cast_before_weight": False} if style == "gemma" else {}
    return q, k, wq.to(device), wk.to(device), cos, sin, kw


def unfused(q, k, wq, wk, cos, sin, kw):
    """Today's path with the Triton kernels: rmsnorm of q, of k, then rope (three launches)."""
    qn = norms.rmsnorm(q, wq, EPS_Q, impl="triton", **kw)
    kn = norms.rmsnorm(k, wk, EPS_K, impl="triton", **kw)
    return rope.rope(qn, kn, cos, sin, impl="triton")


def _rel(a, b, scale):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)) / scale


def run_cases(cases, device: str) -> dict:
    with nan_outputs(F), nan_outputs(norms), nan_outputs(rope):
        return _run_cases(cases, device)


def _run_cases(cases, device: str) -> dict:
    out = {}
    for case in cases:
        q, k, wq, wk, cos, sin, kw = make(case, device)
        got = F.qk_norm_rope(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, impl="triton", **kw)
        ref = F.qk_norm_rope_ref(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, **kw)
        two = unfused(q, k, wq, wk, cos, sin, kw)
        scale = max(t.float().abs().max().item() for t in ref)
        # references with the weights or the k eps left out: the kernel must be far from both
        no_w = F.qk_norm_rope_ref(q, k, torch.ones_like(wq), torch.ones_like(wk), cos, sin, EPS_Q, EPS_K, **kw)
        no_eps = F.qk_norm_rope_ref(q, k, wq, wk, cos, sin, EPS_Q, EPS_Q, **kw)
        out[case[0]] = {
            "shape_ok": all(
                g.shape == x.shape and g.is_contiguous() and g.dtype == x.dtype for g, x in zip(got, (q, k))
            ),
            "nan": any(bool(torch.isnan(g).any().item()) for g in got),
            "err": _rel(got, ref, scale),
            "vs_unfused": _rel(got, two, scale),
            "mismatch_unfused": sum(int((g != t).sum().item()) for g, t in zip(got, two)) / (q.numel() + k.numel()),
            "no_w": _rel(got, no_w, scale),
            "no_eps": _rel(got, no_eps, scale),
        }
    return out


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES, GPU_CASES, request)


@pytest.mark.parametrize("case", tiered(ALL, _in_default), ids=[c[0] for c in ALL])
def test_kernel_matches_reference_and_unfused_kernels(case, results):
    r, dt = results[case[0]], case[-1]
    assert r["shape_ok"] and not r["nan"], r
    assert r["err"] <= TOL[dt], r
    # the case can see a dropped weight / eps: those references lie >= 5 tolerances away (bf16 Qwen3 shapes:
    # a dropped k eps moves the outputs by 11-28% of the largest, against a tolerance of 1.6%)
    assert r["no_w"] > 5 * TOL[dt] and r["no_eps"] > 5 * TOL[dt], r
    if HAS_GPU:  # same arithmetic; only the row sum's order (and fp32 FMA contraction) may differ
        assert r["vs_unfused"] <= TOL[dt], r
        assert dt == "float32" or r["mismatch_unfused"] <= 1e-3, r  # a rare flip of one rounding
    else:
        assert r["vs_unfused"] == 0.0, r


def test_cpu_auto_runs_the_unfused_ops_exactly():
    q, k, wq, wk, cos, sin, kw = make(CASES[3], "cpu")
    got = F.qk_norm_rope(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, **kw)
    want = rope.rope(norms.rmsnorm(q, wq, EPS_Q, **kw), norms.rmsnorm(k, wk, EPS_K, **kw), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("module", [F, rope], ids=["qk_norm_rope", "rope"])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_the_launch_rounds_every_product_on_the_gpu(module, dt, monkeypatch):
    """The interpreter rounds each op; the GPU compiler may contract a product into the following add
    (one rounding skipped: 22% of the outputs one rounding off the unfused kernels on an H100). The
    launch the wrapper makes is built here for sm90 with the options it passes: its PTX must multiply and
    add in the model dtype, with no half-precision FMA."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    launches = []
    monkeypatch.setattr(
        module, "cached_launch", lambda plans, sig, fn, grid, *args, **kw: launches.append((fn, args, kw))
    )
    q, k, wq, wk, cos, sin, kw = make(("cpu-case", 1, 3, 4, 2, 64, 64, 1, "contig", "llama", dt), "cpu")
    if module is F:
        F._launch(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, 0.0, True)
    else:
        rope._launch(q, k, cos, sin)
    ((fn, args, opts),) = launches
    names = fn.arg_names
    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    sig, const, options = {}, {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + short[value.dtype]
        else:
            sig[name] = "fp32" if isinstance(value, float) else "i32"
    for key, value in opts.items():
        (const if key in names else options)[key] = value
    const.update({p.name: p.default for p in fn.params if p.name not in sig and p.name not in const and p.has_default})
    sig.update(dict.fromkeys(const, "constexpr"))
    options.pop("launch_pdl", None)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    except RuntimeError as exc:  # no ptxas in this Triton install
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc).splitlines()[0])
        raise
    assert "fma.rn.f16" not in ptx and "fma.rn.bf16" not in ptx, "a product is contracted into an add"
    assert options.get("enable_fp_fusion") is False


def test_bad_shapes_raise():
    q, k, w = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.ones(16)
    cs = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="norm weights"):
        F.qk_norm_rope(q, k, w, torch.ones(8), cs, cs, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        F.qk_norm_rope(q, k, w, w, torch.randn(1, 3, 18), torch.randn(1, 3, 18), 1e-6, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        F.qk_norm_rope(q, torch.randn(1, 4, 2, 16), w, w, cs, cs, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="cannot run"):  # Llama style with a weight of another dtype
        F.qk_norm_rope(q, k, w.double(), w, cs, cs, 1e-6, 1e-6, impl="triton")


@pytest.mark.parametrize("mode", ["ref", "op"])
def test_compiles_fullgraph_to_the_unfused_ops(mode):
    """Under torch.compile the fused op traces today's ops, each by its compile_mode (refs for inductor
    to fuse, or the rmsnorm / rope custom ops)."""
    from gemmtune.kernels.compile_mode import compile_ops

    q, k, wq, wk, cos, sin, kw = make(CASES[30], "cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def fn(q, k, wq, wk, cos, sin):
        return F.qk_norm_rope(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, **kw)

    torch._dynamo.reset()
    with compile_ops(mode):
        got = torch.compile(fn, fullgraph=True, backend=backend)(q, k, wq, wk, cos, sin)
    want = F.qk_norm_rope_ref(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert graphs[0].code.count("gemmtune.") == (3 if mode == "op" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_cuda_graph_replay_equals_eager_gpu(gpu, style):
    case = (f"graph-{style}", 2, 333, 32, 8, 128, 128, 1, "qkv", style, "bfloat16")
    q, k, wq, wk, cos, sin, kw = make(case, gpu)

    def run():
        return F.qk_norm_rope(q, k, wq, wk, cos, sin, EPS_Q, EPS_K, **kw)

    eager = run()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm up (compile) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager)), "graph replay differs from eager"


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES), "cpu")))
