"""The runtime on a GPU: parity in bf16/fp16, CUDA-graph replay equals eager, compile on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gemmtune

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (7, 1000, 1030), (300, 1280, 8192), (33, 129, 77)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_parity_on_gpu(gpu, dtype, M, N, K, with_bias):
    g = torch.Generator(device=gpu).manual_seed(M * 7 + N)
    x = torch.randn(M, K, device=gpu, generator=g).to(dtype)
    w = (torch.randn(N, K, device=gpu, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device=gpu, generator=g).to(dtype) if with_bias else None
    y = gemmtune.gemm(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_cuda_graph_replay_matches_eager(gpu):
    x = torch.randn(2, 5, 512, device=gpu, dtype=torch.bfloat16)
    w = torch.randn(768, 512, device=gpu, dtype=torch.bfloat16)
    b = torch.randn(768, device=gpu, dtype=torch.bfloat16)

    def f(inp):
        return torch.relu(gemmtune.gemm(inp, w, b))

    eager = f(x)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f(static_x)  # warm-up: resolve the dispatch outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(static_x)
    static_x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, f(static_x), rtol=0, atol=0)
    static_x.copy_(x)
    g.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_compile_fullgraph_on_gpu(gpu):
    w = torch.randn(256, 128, device=gpu, dtype=torch.float16)
    f = torch.compile(lambda x: gemmtune.gemm(x, w).float().sum(-1), fullgraph=True)
    x = torch.randn(4, 128, device=gpu, dtype=torch.float16)
    torch.testing.assert_close(f(x), F.linear(x, w).float().sum(-1), rtol=2e-3, atol=2e-2)


def test_out_dtype_fp32_on_gpu(gpu):
    x = torch.randn(16, 256, device=gpu, dtype=torch.bfloat16)
    w = torch.randn(64, 256, device=gpu, dtype=torch.bfloat16)
    y = gemmtune.gemm(x, w, out_dtype=torch.float32)
    ref = F.linear(x.double(), w.double())
    assert y.dtype == torch.float32
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
