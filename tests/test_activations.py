"""Triton act(gate) * up on the fused gate_up output vs the PyTorch references.

Without a GPU the kernel runs under the Triton interpreter in a subprocess (see test_norms.py for
why); with one, in-process on the GPU, bf16 included. Outputs are NaN-poisoned first.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import compare, kernel_results, nan_outputs

from gemmtune.kernels import activations as A

HAS_GPU = torch.cuda.is_available()

# (name, shape of gu, dtype, act, layout): odd widths, several column blocks (I > 1024), a
# row-strided view, and large magnitudes where exp() overflows.
CASES = [
    (f"{shape}-{dt}-{act}-{layout}", shape, dt, act, layout)
    for dt in ("float32", "float16")
    for act in ("silu", "gelu_tanh")
    for shape, layout in (([1, 150], "contig"), ([3, 5, 3002], "contig"), ([4, 2 * 77], "strided"), ([2, 66], "big"))
]
GPU_CASES = [(n.replace("float16", "bfloat16"), s, "bfloat16", a, lay) for n, s, d, a, lay in CASES if d == "float16"]
ALL = CASES + (GPU_CASES if HAS_GPU else [])
TOL_REF = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}  # vs the same-dtype torch ops
TOL_FP32 = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}  # vs fp32 math


def _make(shape, dtype, layout, gen):
    if layout == "strided":  # every other row of a taller tensor: row stride != width
        return (torch.randn(shape[0] * 2, shape[1], generator=gen).to(dtype))[::2]
    x = torch.randn(shape, generator=gen)
    if layout == "big":
        x = x * 40
    return x.to(dtype)


def run_cases(cases, device: str) -> dict:
    with nan_outputs(A):
        return _run_cases(cases, device)


def _run_cases(cases, device: str) -> dict:
    refs = {"silu": A.silu_mul_ref, "gelu_tanh": A.gelu_tanh_mul_ref}
    out = {}
    for name, shape, dt, act, layout in cases:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        gu = _make(shape, getattr(torch, dt), layout, gen).to(device)
        y = A.act_mul(gu, act, impl="triton")
        y_ref = refs[act](gu)
        y32 = refs[act](gu.float())
        out_shape = (*gu.shape[:-1], gu.shape[-1] // 2)
        out[name] = compare(y, y_ref, y32, out_shape, gu.dtype, y32.abs().max().item() or 1.0)
    return out


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.mark.parametrize("case", ALL, ids=[c[0] for c in ALL])
def test_kernel_matches_reference(case, results):
    name, dt = case[0], case[2]
    r = results[name]
    assert r["shape_ok"] and not r["nan"], r
    assert r["vs_ref"] <= TOL_REF[dt], r
    assert r["vs_fp32"] <= TOL_FP32[dt], r


def test_cpu_auto_uses_the_reference_exactly():
    gu = torch.randn(3, 2 * 21)
    assert torch.equal(A.silu_mul(gu), A.silu_mul_ref(gu))
    assert torch.equal(A.gelu_tanh_mul(gu), A.gelu_tanh_mul_ref(gu))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="even"):
        A.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="unknown activation"):
        A.act_mul(torch.randn(2, 8), "relu")


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
