"""Programmatic dependent launch (PDL): chained kernels that start before their producer finishes must
still read what it wrote. A decoder-like chain (add+RMSNorm -> GEMM -> GEMM -> SiLU*mul -> GEMM, then a
weight overwritten by a torch kernel right before the GEMM that reads it) runs eagerly and as a CUDA
graph; every stage is checked against a reference computed from the stage's actual input.
"""

from __future__ import annotations

import pytest
import torch

from gemmtune.keys import GemmKey


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _pdl_runners(backend, key, device, want):
    sols = [s for s in backend.candidates(key, device) if "_pdl" in s.kernel_name]
    picked = []
    for tag in want:  # one PDL solution per wanted name fragment (kernel kind, reduction, TMA ...)
        sol = next((s for s in sols if tag in s.kernel_name and s not in picked), None)
        if sol is not None:
            picked.append(sol)
    return [(s.kernel_name, backend.make_runner(s, key, device)) for s in picked]


def _chain(gpu, M, backend, want):
    from gemmtune.kernels._common import pdl_enabled
    from gemmtune.kernels.activations import silu_mul
    from gemmtune.kernels.norms import add_rmsnorm

    if not pdl_enabled(gpu):
        pytest.skip("programmatic dependent launch needs CUDA sm90+")
    H, I2 = 2048, 2 * 2816
    g = torch.Generator(device=gpu).manual_seed(M)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device=gpu, generator=g) * scale).bfloat16()
    x0, res, wn = rnd(M, H), rnd(M, H), rnd(H, scale=0.1) + 1
    w_up, w_down = rnd(I2, H, scale=H**-0.5), rnd(H, I2 // 2, scale=(I2 // 2) ** -0.5)
    w_sq, w_new = rnd(H, H, scale=H**-0.5), rnd(H, H, scale=H**-0.5)
    up = _pdl_runners(backend, GemmKey(M, I2, H), gpu, want)
    down = _pdl_runners(backend, GemmKey(M, H, I2 // 2), gpu, want)
    sq = _pdl_runners(backend, GemmKey(M, H, H), gpu, want)
    assert up and down and sq, "no PDL candidates offered"
    cases = list(zip(up, down, sq * 3))

    def chain(r_up, r_down, r_sq, w_sq_buf):
        h, _ = add_rmsnorm(x0, res, wn, 1e-6)
        gu = r_up(h, w_up, None)
        a = silu_mul(gu)
        d = r_down(a, w_down, None)
        w_sq_buf.copy_(w_new)  # a torch kernel writes the weight the next GEMM reads
        return h, gu, a, d, r_sq(d, w_sq_buf, None)

    def check(outs, w_sq_buf, label):
        h, gu, a, d, y = outs
        for name, got, ref in [
            ("up", gu, h.double() @ w_up.double().t()),
            ("down", d, a.double() @ w_down.double().t()),
            ("sq", y, d.double() @ w_new.double().t()),
        ]:
            assert not torch.isnan(got).any(), (label, name)
            assert _rel_err(got, ref) < 1e-2, (label, name, _rel_err(got, ref))
        assert torch.equal(w_sq_buf, w_new)

    for (n_up, r_up), (n_down, r_down), (n_sq, r_sq) in cases:
        label = f"{n_up} / {n_down} / {n_sq}"
        for _ in range(5):
            buf = w_sq.clone()
            check(chain(r_up, r_down, r_sq, buf), buf, label + " eager")
        buf = w_sq.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(r_up, r_down, r_sq, buf)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(r_up, r_down, r_sq, buf)
        for _ in range(5):
            for t in outs:
                t.fill_(float("nan"))
            buf.copy_(w_sq)  # the replay must overwrite it again before the last GEMM reads it
            graph.replay()
            torch.cuda.synchronize()
            check(outs, buf, label + " graph")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gpu_skinny_pdl_chain(gpu, M):
    from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend

    _chain(gpu, M, SkinnyBackend(), ["_pdl2", "_pdl3", "_fx_pdl", "gemv", "dot"])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [64, 200])
def test_gpu_triton_pdl_chain(gpu, M):
    from gemmtune.backends.a16w16.triton import TritonGemmBackend

    _chain(gpu, M, TritonGemmBackend(), ["sk1_pdl2", "f_pdl2", "r_pdl2", "tma_pdl1", "_p_pdl2"])
