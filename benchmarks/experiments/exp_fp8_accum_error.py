"""How far each fp8 GEMM's accumulation moves its result: on the same quantized operands (per-token x,
per-channel w, e4m3), the relative error ||y - ref|| / ||ref|| against an fp64 product of the dequantized
operands (bf16 output: its rounding alone is ~1e-3) and the share of outputs that are not ref rounded to
bf16 (an fp32 accumulation misses only near ties), for cuBLASLt's heuristic pick with plain and with fast
accumulation, and the Triton kernel the default runs at M 65..512 (kernels/a8w8.py, fp32 accumulation).
Activations gaussian, and gaussian with a few outlier channels (x100 on 1 in 256 columns), as trained models'
are.

    python benchmarks/experiments/exp_fp8_accum_error.py
"""

from __future__ import annotations

import torch

from gemmtune.backends.quantized.blaslt import BlasLtA8W8Backend
from gemmtune.backends.quantized.triton import TritonA8W8Backend
from gemmtune.families.quantized import QuantKey
from gemmtune.kernels.quant import quantize_per_token_triton

SHAPES = [(128, 4096, 4096), (128, 4096, 14336), (1024, 4096, 14336), (1024, 1280, 8192), (2048, 5120, 25600)]


def operands(m, n, k, outliers: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    if outliers:
        x[:, ::256] *= 100.0
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    xq, xs = quantize_per_token_triton(x.bfloat16(), torch.float8_e4m3fn)
    wq, ws = quantize_per_token_triton(w.bfloat16(), torch.float8_e4m3fn)
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    return xq, wq, xs, ws.view(1, n), ref


def errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    return rel, (y != ref.to(y.dtype)).double().mean().item()


def main() -> None:
    lt, tile, dev = BlasLtA8W8Backend(), TritonA8W8Backend(), torch.device("cuda")
    print("| M | N | K | x | cuBLASLt plain: rel / not rounded ref | cuBLASLt fast | Triton tile |")
    print("|---|---|---|---|---|---|---|")
    for m, n, k in SHAPES:
        key = QuantKey(m, n, k, torch.float8_e4m3fn, "per_token", False, torch.bfloat16)
        runners = {
            "plain": lt.make_runner(lt.default_solution(key, dev, fast=False), key, dev),
            "fast": lt.make_runner(lt.default_solution(key, dev, fast=True), key, dev),
            "tile": tile.make_runner(tile.default_solution(key, dev), key, dev),
        }
        for outliers in (False, True):
            xq, wq, xs, ws, ref = operands(m, n, k, outliers)
            cells = []
            for run in runners.values():
                rel, off = errors(run(xq, wq, xs, ws, None), ref)
                cells.append(f"{rel:.2e} / {off:.1%}")
            print(f"| {m} | {n} | {k} | {'outliers' if outliers else 'gaussian'} | " + " | ".join(cells) + " |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
