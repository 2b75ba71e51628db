"""A few forward passes of a small built-in model, each marked as a step for `gemmtune profile`.

gemmtune profile -o prof -- python examples/tiny_llama_steps.py --optimize
"""

import argparse

import torch

import gemmtune
from gemmtune.profiling import step
from gemmtune.profiling.build import build_model

p = argparse.ArgumentParser()
p.add_argument("--optimize", action="store_true", help="run gemmtune.optimize(model) first")
p.add_argument("--tokens", type=int, default=128)
args = p.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model, _ = build_model("tiny-llama", device=device)  # random weights, nothing downloaded
if args.optimize:
    gemmtune.optimize(model)
ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)
with torch.no_grad():
    model(input_ids=ids, use_cache=False)  # warm-up, not a step
    for _ in range(3):
        with step():  # what `gemmtune profile` measures (without steps: the whole script)
            model(input_ids=ids, use_cache=False)
