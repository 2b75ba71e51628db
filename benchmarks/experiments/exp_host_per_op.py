"""What one call costs the host, op by op, on the fp8 prefill's shapes (Llama-3-8B, M=2048): bf16 F.linear,
torch._scaled_mm, gemmtune's gemm_a8w8, the quantizer, the norm->fp8 producer and a quantized linear's whole
forward; and a Triton launch through JITFunction against a launch of the same compiled kernel with its
bound arguments kept. Each figure is the median over 7 rounds of the host time of 200 calls issued behind a
GPU sleep (so no launch waits on the GPU), per call.

    python benchmarks/experiments/exp_host_per_op.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemmtune
from gemmtune.kernels.quant import quantize_per_token_triton
from gemmtune.kernels.quant_producers import rmsnorm_quant
from gemmtune.models.quantize import quantize_linears
from gemmtune.models.report import OptimizeReport

CALLS = 200


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        torch.cuda._sleep(300_000_000)  # ~0.2 s: every launch below is queued behind it
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    m, k, n = 2048, 4096, 4096
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
    fp8 = torch.float8_e4m3fn
    xq, xs = quantize_per_token_triton(x, fp8)
    wq, ws = quantize_per_token_triton(w, fp8)
    ws_row = ws.view(1, n)
    norm_w = torch.ones(k, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    qlin = torch.nn.Sequential(lin)
    quantize_linears(qlin, "fp8", OptimizeReport("none", "none", "", {}))
    small = torch.zeros(4096, device=dev)
    ck = _touch[(4,)](small, 4096, BLOCK=1024)
    runner = ck[(4, 1, 1)]
    stream = torch.cuda.current_stream().cuda_stream
    hooks = (None, None, None)

    rows = {
        "F.linear bf16": lambda: F.linear(x, w),
        "torch._scaled_mm rowwise": lambda: torch._scaled_mm(xq, wq.t(), xs, ws_row, out_dtype=torch.bfloat16),
        "gemmtune.gemm_a8w8 (default)": lambda: gemmtune.gemm_a8w8(xq, wq, xs, ws_row),
        "quantize_per_token_triton": lambda: quantize_per_token_triton(x, fp8),
        "rmsnorm_quant (norm->fp8)": lambda: rmsnorm_quant(x, norm_w, 1e-6, fp8, "per_token"),
        "quantized linear forward (bf16 in)": lambda: qlin(x),
        "torch.empty [M, N] bf16": lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16),
        "triton JIT launch (3 args)": lambda: _touch[(4,)](small, 4096, BLOCK=1024),
        "CompiledKernel[grid](*args)": lambda: runner(small, 4096, 1024),
        "CompiledKernel.run (stream kept)": lambda: ck.run(4, 1, 1, stream, ck.function, ck.packed_metadata, *hooks,
                                                           small, 4096, 1024),
    }  # fmt: skip
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for label, fn in rows.items():
        print(f"{label:40s} {host_us(fn):7.1f} us/call")


if __name__ == "__main__":
    main()
