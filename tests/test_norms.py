"""Triton RMSNorm / residual-add + RMSNorm vs the PyTorch references.

Without a GPU the kernels run under the Triton interpreter in a subprocess (TRITON_INTERPRET must be
set before triton is first imported, which this pytest process may already have done); with one,
in-process on the GPU, bf16 included. Outputs are NaN-poisoned so an unwritten element fails.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import compare, kernel_results, nan_outputs

from gemmtune.kernels import norms

HAS_GPU = torch.cuda.is_available()

# (name, x shape, dtype, style, residual, view): odd sizes, several rows per program, a strided
# per-head view like q out of a fused qkv output, and a wide row (4096).
CASES = [
    (f"{shape}-{dt}-{style}-{'res' if res else 'plain'}-{view}", shape, dt, style, res, view)
    for dt in ("float32", "float16")
    for style in ("llama", "gemma")
    for res in (False, True)
    for shape, view in (([1, 37], "contig"), ([5, 129], "contig"), ([3, 7, 100], "contig"), ([2, 7, 4, 16], "qkv"))
] + [("wide-float16-llama-res", [2, 4096], "float16", "llama", True, "contig")]
GPU_CASES = [
    (n.replace("float16", "bfloat16"), s, "bfloat16", st, r, v) for n, s, d, st, r, v in CASES if d == "float16"
]
ALL = CASES + (GPU_CASES if HAS_GPU else [])
# Tolerances vs the same-dtype reference (op-for-op model numerics): fp32 sum order only; half
# types may differ by one rounding of the output.
TOL = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}


def _make(shape, dtype, view, gen):
    if view == "qkv":  # [B, S, H, D] slice of a [B, S, (H + 2 * Hkv) * D] tensor
        b, s, h, d = shape
        full = torch.randn(b, s, (h + 4) * d, generator=gen)
        return full.to(dtype)[..., : h * d].view(b, s, h, d)
    return torch.randn(shape, generator=gen).to(dtype)


def run_cases(cases, device: str) -> dict:
    """{name: (max |kernel - same-dtype ref| / scale, max |kernel - fp32 ref|)} for each case."""
    with nan_outputs(norms):
        return _run_cases(cases, device)


def _run_cases(cases, device: str) -> dict:
    out = {}
    for name, shape, dt, style, res, view in cases:
        dtype = getattr(torch, dt)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        x = _make(shape, dtype, view, gen).to(device)
        w = (torch.randn(shape[-1], generator=gen) * 0.5 + (0 if style == "gemma" else 1)).to(dtype).to(device)
        r = torch.randn(x.shape, generator=gen).to(dtype).to(device) if res else None
        kw = {"offset": 1.0, "cast_before_weight": False} if style == "gemma" else {}
        if res:
            y, s = norms.add_rmsnorm(x, r, w, 1e-6, impl="triton", **kw)
            y_ref, s_ref = norms.add_rmsnorm_ref(x, r, w, 1e-6, **kw)
            y32, _ = norms.add_rmsnorm_ref(x.float(), r.float(), w.float(), 1e-6, **kw)
            sum_err = (s.float() - s_ref.float()).abs().max().item()
        else:
            y = norms.rmsnorm(x, w, 1e-6, impl="triton", **kw)
            y_ref = norms.rmsnorm_ref(x, w, 1e-6, **kw)
            y32 = norms.rmsnorm_ref(x.float(), w.float(), 1e-6, **kw)
            sum_err = 0.0
        scale = y_ref.float().abs().max().item() or 1.0
        out[name] = {**compare(y, y_ref, y32, x.shape, x.dtype, scale), "sum": sum_err}
    return out


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.mark.parametrize("case", ALL, ids=[c[0] for c in ALL])
def test_kernel_matches_reference(case, results):
    name, dt = case[0], case[2]
    r = results[name]
    assert r["shape_ok"] and not r["nan"], r
    assert r["vs_ref"] <= TOL[dt], r
    assert r["vs_fp32"] <= {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dt], r
    assert r["sum"] == 0.0, r  # the residual sum is one rounded add, exactly as torch does it


def test_cpu_auto_uses_the_reference_exactly():
    x = torch.randn(4, 33)
    w = torch.randn(33)
    assert torch.equal(norms.rmsnorm(x, w, 1e-5), norms.rmsnorm_ref(x, w, 1e-5))
    r = torch.randn(4, 33)
    y, s = norms.add_rmsnorm(x, r, w, 1e-5, offset=1.0, cast_before_weight=False)
    y2, s2 = norms.add_rmsnorm_ref(x, r, w, 1e-5, offset=1.0, cast_before_weight=False)
    assert torch.equal(y, y2) and torch.equal(s, s2)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"weight \(32,\)"):
        norms.rmsnorm(torch.randn(2, 33), torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        norms.add_rmsnorm(torch.randn(2, 33), torch.randn(3, 33), torch.randn(33), 1e-5)


def test_reference_matches_transformers_modules():
    tf = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 48).to(dtype)
        ln = LlamaRMSNorm(48, eps=1e-5).to(dtype)
        gn = GemmaRMSNorm(48, eps=1e-6).to(dtype)
        with torch.no_grad():
            ln.weight.normal_()
            gn.weight.normal_()
            assert torch.equal(ln(x), norms.rmsnorm_ref(x, ln.weight, 1e-5))
            assert torch.equal(gn(x), norms.rmsnorm_ref(x, gn.weight, 1e-6, offset=1.0, cast_before_weight=False))
    assert tf.__version__


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
