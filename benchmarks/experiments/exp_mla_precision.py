"""Experiment: how far stock MLA and the absorbed form (models/mla.py) each are from an fp64 evaluation (issue 29).

One DeepSeek-V3 attention layer (the preset's sizes: 128 heads, latent 512, rope 64, hidden 7168; transformers'
init, normal(0, 0.02) linears), its weights and input rounded to bf16 once, so all runs hold the same numbers.
A prefill of P tokens, then 3 cached decode steps (DynamicCache); each decode step's output against the same
layer run in fp64 (stock forward), relative L2 error. Runs on the CPU: the absorbed path there is its fp32
PyTorch form (absorbed_attention_ref); the GPU's kernel path also rounds q_lat and the latent output to bf16.

    PYTHONPATH=src python benchmarks/experiments/exp_mla_precision.py 64 256 1024
"""

from __future__ import annotations

import copy
import sys

import torch
import transformers
from transformers import DynamicCache
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from gemmtune.models import mla
from gemmtune.profiling.build import architecture

STEPS = 3


def layer():
    cfg, _ = architecture("deepseek-v3", 1)
    cfg.pop("model_type")
    config = transformers.DeepseekV3Config(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(config, 0)
    for mod in attn.modules():
        if isinstance(mod, torch.nn.Linear):
            torch.nn.init.normal_(mod.weight, std=config.initializer_range)
    return config, attn.to(torch.bfloat16).to(torch.float64).eval()  # the weights bf16 holds


def decode_outputs(attn, config, x, dtype, absorb: bool) -> list[torch.Tensor]:
    mod = copy.deepcopy(attn).to(dtype)
    if absorb:
        mla.apply(mod, mla.plan(mod))
    rotary = ds.DeepseekV3RotaryEmbedding(config)
    xx = x.to(dtype)
    cos, sin = rotary(xx, torch.arange(x.shape[1])[None])
    cache, outs, prompt = DynamicCache(config=config), [], x.shape[1] - STEPS
    with torch.no_grad():
        mod(xx[:, :prompt], (cos[:, :prompt], sin[:, :prompt]), None, cache=cache)
        for i in range(prompt, x.shape[1]):
            y, _ = mod(xx[:, i : i + 1], (cos[:, i : i + 1], sin[:, i : i + 1]), None, cache=cache)
            outs.append(y.double())
    return outs


def main(prompts: list[int]) -> None:
    config, attn = layer()
    for prompt in prompts:
        g = torch.Generator().manual_seed(prompt)
        x = torch.randn(1, prompt + STEPS, config.hidden_size, generator=g).bfloat16().double()
        ref = decode_outputs(attn, config, x, torch.float64, absorb=False)
        for name, dtype, absorb in (("stock bf16", torch.bfloat16, False), ("absorbed bf16", torch.bfloat16, True)):
            outs = decode_outputs(attn, config, x, dtype, absorb)
            errs = [((o - r).norm() / r.norm()).item() for o, r in zip(outs, ref)]
            print(f"{prompt:5d} cached  {name:14s} " + " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 256, 1024])
