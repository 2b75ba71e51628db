"""How far an fp8 model's logits can be from its quantized reference when nothing is wrong: the kernels'
model against the reference (each 8-bit linear on models/quantize.reference_forward), producers on and off,
every 8-bit GEMM against its reference on the model's own activations, and the floor: the reference
against its twin with the matmul in bf16 (another valid rounding). 1 and 4 layers, random weights.

    python benchmarks/experiments/exp_quant_parity_floor.py llama-3-8b
"""

from __future__ import annotations

import copy
import functools
import sys

import torch

from gemmtune.models import optimize
from gemmtune.models import quantize as mq
from gemmtune.profiling import bench_model as bm
from gemmtune.profiling.build import build_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
    dev = torch.device("cuda")
    for layers in (1, 4):
        stock, _ = build_model(model, layers, dev, torch.bfloat16, 0)
        vocab = stock.config.vocab_size
        ids = torch.randint(0, vocab, (1, 64), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        for producers in (False, True):
            q = copy.deepcopy(stock)
            optimize(q, quantize="fp8", quantize_producers=producers)
            with torch.no_grad():
                got = q(input_ids=ids, use_cache=False).logits
                with mq.reference_linears(q):
                    want = q(input_ids=ids, use_cache=False).logits
                # the linears see their 16-bit input only without the producers
                run = functools.partial(q, input_ids=ids, use_cache=False)
                errs = [] if producers else mq.gemm_errors(q, run, against=mq.reference_forward)
            worst = max((e for _, _, e in errs), default=float("nan"))
            print(f"layers={layers} producers={producers}: prefill logits vs the quantized reference "
                  f"{rel(got, want):.4f}; worst 8-bit GEMM vs its reference {worst:.2e}", flush=True)  # fmt: skip
            s = bm.Settings(model=model, layers=layers, contenders=("stock", "quantize"), quantize="fp8")
            cont = [bm.Contender("stock", stock, stock), bm.Contender("quantize", q, q)]
            dp = bm.decode_parity(cont, stock, s, vocab, dev, q)["quantize"]
            print(f"   decode: {dp.verdict()}", flush=True)
        q = copy.deepcopy(stock)
        optimize(q, quantize="fp8", quantize_producers=False)
        with torch.no_grad():
            with mq.reference_linears(q):
                a = q(input_ids=ids, use_cache=False).logits
            with mq.reference_linears(q, matmul_dtype=torch.bfloat16):
                b = q(input_ids=ids, use_cache=False).logits
        print(f"layers={layers}: floor, the reference vs its bf16-matmul twin: {rel(b, a):.4f}", flush=True)


if __name__ == "__main__":
    main()
