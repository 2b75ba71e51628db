"""Which way each fused op should run under torch.compile: "ref" (inductor fuses the PyTorch formula
with its neighbours) or "op" (gemmtune's Triton kernel as an opaque custom op), per op.

One decoder layer of an optimize()d model (random weights, bf16) is compiled once per compile-ops
variant: all ref, all op, and ref with one op switched to op (for each op); plus the eager layer.
Each compiled layer is captured in a CUDA graph and all variants are replayed interleaved (median of
rounds), at a prefill shape (1 x 2048 tokens, causal) and a decode-like one (8 sequences x 1 token).
An op whose "ref,OP=op" row beats "ref" is faster as a custom op in that shape.

    python benchmarks/bench_compile_ops.py --model llama-3-8b --out OUT_DIR/compile_ops.md
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch

import gemmtune
from gemmtune.kernels.compile_mode import OPS, compile_ops
from gemmtune.profiling.bench_model import interleaved, raise_recompile_limits
from gemmtune.profiling.build import build_model


def log(*a):
    print(*a, flush=True)


def layer_call(model, shape, device):
    """A call of decoder layer 0 on random hidden states of `shape` [batch, seq]."""
    stack = model.model
    layer = stack.layers[0]
    b, s = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(b, s, model.config.hidden_size, generator=g).to(device=device, dtype=model.dtype)
    pos = torch.arange(s, device=device)[None].expand(b, s)
    cos, sin = stack.rotary_emb(h, position_ids=pos)

    def fn(h=h, cos=cos, sin=sin, pos=pos):
        return layer(h, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin), use_cache=False)

    return fn


def capture(fn, mode: str | None):
    """A CUDA graph of one call of `fn` (compiled under compile-ops `mode` when given)."""
    ctx = compile_ops(mode) if mode else torch.no_grad()
    with torch.no_grad(), ctx:
        for _ in range(2):  # compile and warm up outside the capture
            fn()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    return g


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="preset or config.json")
    p.add_argument("--shapes", default="1x2048,8x1", help="BATCHxSEQ list")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None, help="markdown file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        log("bench_compile_ops needs a CUDA GPU")
        return 1
    t0 = time.perf_counter()
    device = torch.device("cuda")
    stock, desc = build_model(args.model, 1, device)
    model = copy.deepcopy(stock)
    del stock
    gemmtune.optimize(model)
    variants = ["ref", "op", *[f"ref,{op}=op" for op in OPS]]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    raise_recompile_limits()  # one compiled graph per variant and shape, all kept alive
    results: dict[tuple, dict[str, float]] = {}
    for shape in shapes:
        fn = layer_call(model, shape, device)
        graphs = {"eager": capture(fn, None)}
        for v in variants:  # the compiled graphs are guarded on the compile-ops modes they were traced with
            graphs[v] = capture(torch.compile(fn), v)
            log(f"{shape}: captured {v}")
        times = interleaved({k: g.replay for k, g in graphs.items()}, 20, args.reps, True)
        results[shape] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        for k, v in results[shape].items():
            log(f"{shape} {k:<22} {v:9.1f} us")
    lines = ["# torch.compile: gemmtune's fused ops as inductor-fused references vs custom ops", "",
             f"- model: {desc} (decoder layer 0 of the optimize()d model)",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
             "- one compiled layer per variant, CUDA-graph replays interleaved, median of "
             f"{args.reps} rounds of 20 replays; us per layer call (ratio vs all-ref: < 1 is faster)", ""]  # fmt: skip
    heads = [f"{b}x{s} us (vs ref)" for b, s in shapes]
    lines += ["| variant | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for v in ["eager", *variants]:
        cells = [f"{results[sh][v]:.1f} ({results[sh][v] / results[sh]['ref']:.3f})" for sh in shapes]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += ["", "Per op, custom op vs reference under compile (time change of the layer when only that op is "
              "a custom op; negative = the custom op is faster):", ""]  # fmt: skip
    for op in OPS:
        deltas = [f"{b}x{s}: {100 * (results[(b, s)][f'ref,{op}=op'] / results[(b, s)]['ref'] - 1):+.1f}%"
                  for b, s in shapes]  # fmt: skip
        lines.append(f"- {op}: " + ", ".join(deltas))
    lines += ["", f"Run time {time.perf_counter() - t0:.0f} s. Command: `python benchmarks/bench_compile_ops.py "
              + " ".join(argv or sys.argv[1:]) + "`", ""]  # fmt: skip
    text = "\n".join(lines)
    log(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
