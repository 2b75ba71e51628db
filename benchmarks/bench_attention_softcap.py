"""Softcapped attention (Gemma-2) per call: gemmtune's eager tier vs flex_attention, with SDPA without the
softcap (what stock transformers 5.17 runs for Gemma-2: another function) as the floor.

Gemma-2-9B's attention (16 query heads, 8 KV heads, head dim 256, softcap 50, bf16) at prefill sizes
(B x L tokens, causal, no mask: the BlockMask is cached, as optimize() does) and at decode-like sizes (L
query tokens against a 1024-token cache through transformers' boolean mask; flex's BlockMask is built
once outside the timing, as one forward shares it over its layers). Each contender's calls over rotating
input sets (more than 2x the L2 in all) are captured in a CUDA graph and replayed, contenders
interleaved, median of rounds (docs/benchmarking.md). The decode rows say where flex starts to beat the
eager tier: flex.FLEX_MIN_Q.

    python benchmarks/bench_attention_softcap.py --out benchmarks/results/h100/attention_softcap.md
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

import torch
from bench_compile_ops import capture

from gemmtune.models import attention as attn_mod
from gemmtune.models import flex
from gemmtune.profiling.bench_model import interleaved, raise_recompile_limits

HQ, HKV, D, SOFTCAP = 16, 8, 256, 50.0


def log(*a):
    print(*a, flush=True)


class _Module:  # what the tier functions read from the attention module
    training = False
    is_causal = True


def _mask(b, q_len, kv_len, device):
    """transformers' boolean causal mask of the last q_len of kv_len positions (a static-cache step)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=b, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len,
                     allow_is_causal_skip=False, device=device)  # fmt: skip


def contenders(b, q_len, kv_len, masked, device, l2_bytes):
    """{name: fn} where fn runs one call on each of R rotating input sets."""
    set_bytes = 2 * (b * HQ * q_len * D + 2 * b * HKV * kv_len * D)
    reps = max(2, math.ceil(2 * l2_bytes / set_bytes) + 1)
    g = torch.Generator(device="cpu").manual_seed(q_len * 1000 + kv_len + b)
    sets = [
        [(torch.randn(b, h, n, D, generator=g) * s).to(device, torch.bfloat16)
         for h, n, s in ((HQ, q_len, 2.0), (HKV, kv_len, 2.0), (HKV, kv_len, 1.0))]
        for _ in range(reps)
    ]  # fmt: skip
    mask = _mask(b, q_len, kv_len, device) if masked else None
    scale, mod = D**-0.5, _Module()
    bm = flex.tensor_block_mask(mask, b, kv_len) if masked else flex.causal_block_mask(q_len, kv_len, None, device)
    run_flex = flex.compiled()
    sm = flex.score_mod(SOFTCAP)

    def eager():
        for q, k, v in sets:
            attn_mod.eager_attention(mod, q, k, v, mask, scaling=scale, softcap=SOFTCAP)

    def flex_call():
        for q, k, v in sets:
            run_flex(q, k, v, score_mod=sm, block_mask=bm, scale=scale, enable_gqa=True)

    def sdpa_no_softcap():
        for q, k, v in sets:
            attn_mod.sdpa_attention(mod, q, k, v, mask, scaling=scale)

    return {"eager tier": eager, "flex": flex_call, "sdpa, no softcap": sdpa_no_softcap}, reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", default="1x2048,1x4096", help="BATCHxSEQ list (causal, no mask)")
    p.add_argument("--decode", default="1,16,17,64", help="query tokens against the cache")
    p.add_argument("--batches", default="1,8", help="batches of the decode rows")
    p.add_argument("--ctx", type=int, default=1024, help="cache length of the decode rows")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None, help="markdown file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or flex.unavailable_reason("cuda"):
        log(f"bench_attention_softcap needs a CUDA GPU with flex_attention: {flex.unavailable_reason('cuda')}")
        return 1
    t0 = time.perf_counter()
    device = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    cases = [(b, s, s, False) for b, s in (tuple(int(v) for v in x.split("x")) for x in args.prefill.split(","))]
    cases += [(b, int(q), args.ctx, True) for b in (int(x) for x in args.batches.split(",")) for q in
              args.decode.split(",")]  # fmt: skip
    rows = []
    raise_recompile_limits()
    with torch.no_grad():
        for b, q_len, kv_len, masked in cases:
            torch._dynamo.reset()  # flex compiled for this shape alone (static), as a first prefill is
            fns, reps = contenders(b, q_len, kv_len, masked, device, l2)
            graphs = {k: capture(fn, None) for k, fn in fns.items()}
            times = interleaved({k: g.replay for k, g in graphs.items()}, 5, args.reps, True)
            us = {k: statistics.median(v) * 1e3 / reps for k, v in times.items()}
            rows.append((b, q_len, kv_len, masked, us))
            log(f"B={b} L={q_len} S={kv_len} mask={masked}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))
            del graphs, fns
    text = report(rows, args.reps, time.perf_counter() - t0, argv or sys.argv[1:])
    log(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    return 0


def report(rows, reps: int, seconds: float, argv) -> str:
    names = list(rows[0][4])
    lines = ["# Softcapped attention per call: eager tier vs flex_attention (Gemma-2-9B shapes)", "",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
             f"- {HQ} query heads, {HKV} KV heads, head dim {D}, softcap {SOFTCAP}, bf16; us per call, CUDA-graph "
             f"replays interleaved, median of {reps} rounds; flex.FLEX_MIN_Q = {flex.FLEX_MIN_Q}",
             "- 'sdpa, no softcap' computes another function (stock transformers 5.17 on Gemma-2): a floor", "",
             "| B | L | S | mask | " + " | ".join(f"{n} us" for n in names) + " | flex / eager |",
             "|---" * (len(names) + 5) + "|"]  # fmt: skip
    for b, q_len, kv_len, masked, us in rows:
        cells = " | ".join(f"{us[n]:.1f}" for n in names)
        lines.append(f"| {b} | {q_len} | {kv_len} | {'bool' if masked else 'causal'} | {cells} | "
                     f"{us['flex'] / us['eager tier']:.3f} |")  # fmt: skip
    cmd = " ".join(["python benchmarks/bench_attention_softcap.py", *argv])
    return "\n".join([*lines, "", f"Run time {seconds:.0f} s. Command: `{cmd}`", ""])


if __name__ == "__main__":
    sys.exit(main())
