"""Does cuBLASLt's fp8 fast accumulation (the untuned fp8 default above M = 32 where cuBLASLt runs) move a
trained model's fp8 logits? SmolLM2-135M-Instruct (tests/trained_model.py) under `optimize(quantize="fp8")`,
once with the default policy and once with every cuBLASLt row on its plain accumulation
(policy.FAST_ACCUM_MIN_M past any M), each against stock bf16 and against the plain-PyTorch fp8 reference's own
run (the figures tests/test_trained_weights.py asserts on). With GEMMTUNE_LOG=1 the keys each run resolves
are logged on stderr.

    GEMMTUNE_LOG=1 python benchmarks/experiments/exp_trained_fp8_accum.py 2> resolutions.log
"""

from __future__ import annotations

import pathlib
import sys

import torch

import gemmtune
from gemmtune.backends.quantized import policy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from trained_model import FakeQuantFP8, load, parity, stock_runs  # noqa: E402

NEW_TOKENS = 24


def main() -> None:
    model, tokenizer = load(torch.bfloat16, "cuda")
    stock = stock_runs(model, tokenizer, NEW_TOKENS)
    with FakeQuantFP8(model):
        reference = stock_runs(model, tokenizer, NEW_TOKENS)
        print(parity(model, tokenizer, stock, "plain fp8 reference vs stock"), flush=True)
    default_min_m = policy.FAST_ACCUM_MIN_M
    for label, min_m in (("default policy", default_min_m), ("plain accumulation", 1 << 30)):
        policy.FAST_ACCUM_MIN_M = min_m
        gemmtune.set_config(None)  # forget the resolutions of the run before
        print(f"--- {label} (FAST_ACCUM_MIN_M {min_m})", file=sys.stderr, flush=True)
        gemmtune.optimize(model, quantize="fp8")
        try:
            print(parity(model, tokenizer, stock, f"fp8, {label}, vs stock"), flush=True)
            print(parity(model, tokenizer, reference, f"fp8, {label}, vs the reference"), flush=True)
        finally:
            gemmtune.restore(model)
    policy.FAST_ACCUM_MIN_M = default_min_m


if __name__ == "__main__":
    main()
