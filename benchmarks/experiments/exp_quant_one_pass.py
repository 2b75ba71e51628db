"""The per-token activation quantizer (kernels/quant.py) reading each row once, kept in registers, against
its two-pass form (the amax, then the values: x read twice), fp8 out, bf16 in: CUDA-graph replays over
cold input sets, interleaved, median of 20.

    python benchmarks/experiments/exp_quant_one_pass.py
"""

from __future__ import annotations

import torch

from gemmtune.kernels import quant as kq
from gemmtune.quant.formats import SCALE_DTYPE
from gemmtune.tuner.timing import l2_bytes, time_graphs

TWO_PASS = 16  # a one_pass_max no row fits under: the two-pass kernel


def main() -> None:
    dev = torch.device("cuda")
    for m in (1, 16, 1024, 2048, 4096):
        for k in (4096, 8192, 14336, 25600):
            n_sets = max(2, min(32, int(2 * l2_bytes(dev) / (m * k * 3)) + 1))  # > 2x L2: cold
            sets = [
                (
                    torch.randn(m, k, device=dev, dtype=torch.bfloat16),
                    torch.empty(m, k, device=dev, dtype=torch.float8_e4m3fn),
                    torch.empty(m, 1, device=dev, dtype=SCALE_DTYPE),
                )
                for _ in range(n_sets)
            ]

            def run(one_pass_max, sets=sets):
                def all_sets():
                    for x, q, s in sets:
                        kq.launch_per_token(x, q, s, one_pass_max=one_pass_max)

                return all_sets

            ms = time_graphs({"two": run(TWO_PASS), "one": run(kq.ONE_PASS_MAX)}, reps=20, calls_per_graph=n_sets)
            two, one = ms["two"] * 1e3, ms["one"] * 1e3
            gbs = m * k * 3 / (one * 1e-6) / 1e9  # bf16 read + fp8 written
            speed = f"{two / one:.2f}x, {gbs:.0f} GB/s"
            print(f"M={m:5d} K={k:6d}: two-pass {two:7.2f} us, one-pass {one:7.2f} us ({speed})")


if __name__ == "__main__":
    main()
