"""The per-token activation quantizer (kernels/quant.py) reading a row as a block and a tail where one
block of next_power_of_2(K) pads most (quant.row_pieces) against that one block (its launch before), fp8 out,
bf16 in: CUDA-graph replays over cold input sets, interleaved (the pieces twice: the noise), median of 20.

    python benchmarks/experiments/exp_quant_pieces.py
"""

from __future__ import annotations

import torch
import triton

from gemmtune.kernels import quant as kq
from gemmtune.kernels._common import pdl_kwargs
from gemmtune.quant.formats import SCALE_DTYPE, qmax
from gemmtune.tuner.timing import l2_bytes, time_graphs

FP8 = torch.float8_e4m3fn


def whole_block(x, q, s) -> None:
    """The launch before row_pieces: one next_power_of_2(K) block, 16 values a thread (and PDL, as
    launch_per_token launches)."""
    m, k = x.shape
    block = triton.next_power_of_2(k)
    kq._per_token_kernel[(m,)](x, q, s, k, x.stride(0), QMAX=qmax(q.dtype), IS_INT=False, BLOCK=block,
                               ONE_PASS=True, num_warps=4 if block <= 2048 else min(32, block // 512),
                               **pdl_kwargs(x.device))  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    for m in (128, 1024, 4096):
        for k in (4096, 4112, 5120, 14336, 17408, 25600):
            n_sets = max(2, min(32, int(2 * l2_bytes(dev) / (m * k * 3)) + 1))  # > 2x L2: cold
            sets = [(torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.empty(m, k, device=dev, dtype=FP8),
                     torch.empty(m, 1, device=dev, dtype=SCALE_DTYPE)) for _ in range(n_sets)]  # fmt: skip
            whole_block(*sets[0])
            ref = [t.clone() for t in sets[0][1:]]
            kq.launch_per_token(*sets[0])
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8)
                                   if b.dtype == FP8 else b) for a, b in zip(ref, sets[0][1:]))  # fmt: skip

            def run(fn, sets=sets):
                def all_sets():
                    for t in sets:
                        fn(*t)

                return all_sets

            ms = time_graphs({"whole": run(whole_block), "pieces": run(kq.launch_per_token),
                              "pieces#2": run(kq.launch_per_token)}, reps=20, calls_per_graph=n_sets)  # fmt: skip
            whole, pieces, again = (ms[c] * 1e3 for c in ("whole", "pieces", "pieces#2"))
            gbs = m * k * 3 / (pieces * 1e-6) / 1e9  # bf16 read + fp8 written
            print(f"M={m:5d} K={k:6d} pieces={kq.row_pieces(k, m)}: whole block {whole:7.2f} us, now {pieces:7.2f} us "
                  f"({whole / pieces:.2f}x, {gbs:.0f} GB/s; noise {abs(pieces - again) / pieces:.1%}; "
                  f"same bytes: {same})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
