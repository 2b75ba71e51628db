"""batched_gemm_a8w8 on DeepSeek-V3-style MLA absorbed matmuls: tune a table, then bench it against the default.

Shapes: per head (B = 128 heads at tp 1, 16 at tp 8), q_nope @ W_UK (K = 128 -> N = 512, kv_lora_rank) and
attn @ W_UV (K = 512 -> N = 128, v_head_dim), at M = 1 .. 4096 tokens, fp8 e4m3 and int8 operands, bf16 out.
Writes OUT/shapes.csv, tunes it into OUT/tuned.csv (`gemmtune tune`: torch and Triton candidates, the
default kept unless a candidate wins beyond noise) and runs `gemmtune bench` on the table (tuned vs default
per shape, with roof) into OUT/bench.csv / .json / .png. GPU only.

    python benchmarks/bench_batched_a8w8.py -o OUT_DIR [--ms 1,4,16] [--q-dtypes torch.float8_e4m3fn]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
HEADS = (128, 16)  # DeepSeek-V3 at tp 1 and tp 8
MATMULS = ((512, 128), (128, 512))  # (N, K): W_UK absorbed into q, W_UV applied to the attention output


def write_shapes(path: str, q_dtypes: list[str], ms=MS) -> int:
    rows = [(b, m, n, k, q, "torch.bfloat16") for q in q_dtypes for b in HEADS for n, k in MATMULS for m in ms]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["B", "M", "N", "K", "q_dtype_w", "outdtype"])
        w.writerows(rows)
    return len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", default="batched_a8w8_out", help="output folder")
    p.add_argument("--q-dtypes", default="torch.float8_e4m3fn,torch.int8", help="8-bit operand dtypes")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="token counts (default: 1 .. 4096)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shapes, tuned = os.path.join(args.out, "shapes.csv"), os.path.join(args.out, "tuned.csv")
    n = write_shapes(shapes, args.q_dtypes.split(","), [int(m) for m in args.ms.split(",")])
    print(f"{n} keys -> {shapes}", flush=True)
    gemmtune = [sys.executable, "-m", "gemmtune.cli.main"]
    subprocess.run([*gemmtune, "tune", shapes, "-o", tuned, "--family", "batched_a8w8"], check=True)
    subprocess.run([*gemmtune, "bench", tuned, "-o", os.path.join(args.out, "bench")], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
