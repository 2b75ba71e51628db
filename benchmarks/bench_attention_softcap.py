"""Softcapped attention (Gemma-2) per call: gemmtune's eager tier vs flex_attention vs gemmtune's Triton
kernel (kernels/attention_softcap.py), with SDPA without the softcap (what stock transformers 5.17 runs for
Gemma-2: another function) as the floor.

Gemma-2-9B's attention (16 query heads, 8 KV heads, head dim 256, softcap 50, bf16) at prefill sizes
(B x L tokens, causal, no mask: the BlockMask is cached, as optimize() does) and at decode-like sizes (L
query tokens against a 1024-token cache through transformers' boolean mask; flex's BlockMask is built
once outside the timing, as one forward shares it over its layers). Each contender's calls over rotating
input sets (more than 2x the L2 in all) are captured in a CUDA graph and replayed, contenders
interleaved, median of rounds (docs/benchmarking.md). The decode rows say where flex starts to beat the
eager tier: flex.FLEX_MIN_Q. The Triton kernel runs mask-free ("triton", what eager prefill runs) and
with transformers' boolean mask ("triton, mask": what torch.compile'd prefill runs, transformers then
materializing even the plain causal mask; and the decode rows). --sweep adds one contender per kernel
config at the prefill rows (default list: SWEEP, those that fit 227 KB of shared memory), each checked
against the fp32 reference first, to pick attention_softcap.CONFIGS[256].

    python benchmarks/bench_attention_softcap.py --sweep --out benchmarks/results/h100/attention_softcap.md
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

from gemmtune.kernels import attention_softcap as kattn
from gemmtune.models import attention as attn_mod
from gemmtune.models import flex
from gemmtune.profiling.bench_model import interleaved, raise_recompile_limits

HQ, HKV, D, SOFTCAP = 16, 8, 256, 50.0
SWEEP = ("128x64w8s2", "128x64w8s1", "128x32w8s2", "128x32w8s3", "64x64w4s2", "64x64w4s3", "64x32w4s3",
         "64x64w8s2", "128x128w8s1")  # fmt: skip


def fits(cfg: kattn.Config) -> bool:
    """Q plus num_stages K and V tiles (bf16) within Hopper's 227 KB of shared memory per block."""
    return 2 * D * (cfg.block_m + 2 * cfg.num_stages * cfg.block_n) <= 227 * 1024


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


def contenders(b, q_len, kv_len, masked, device, l2_bytes, sweep=()):
    """{name: fn} where fn runs one call on each of R rotating input sets; {name: max |out - fp32 ref|}
    of the Triton contenders on the first set."""
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

    def triton(cfg=None, with_mask=None):  # with a mask, the mask alone decides (as the routing calls it)
        kw = {"scaling": scale, "softcap": SOFTCAP, "causal": with_mask is None, "config": cfg, "mask": with_mask}

        def run():
            for q, k, v in sets:
                kattn.softcap_attention(q, k, v, **kw)

        return run, kw

    fns = {"eager tier": eager, "flex": flex_call, "sdpa, no softcap": sdpa_no_softcap}
    checks = {}
    if masked:
        checks["triton, mask"] = triton(None, mask)
    else:
        checks["triton"] = triton()
        checks["triton, mask"] = triton(None, _mask(b, q_len, kv_len, device))
        checks.update({f"triton {c}": triton(c) for c in sweep})
    errors = {}
    q, k, v = sets[0]
    ref_kw = {"scaling": scale, "softcap": SOFTCAP, "causal": True, "mask": mask}
    ref = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **ref_kw)
    for name, (run, kw) in checks.items():
        try:
            out = kattn.softcap_attention(q, k, v, **kw)
        except Exception as exc:  # noqa: BLE001 - a config that does not build here: left out, said so
            log(f"  {name} left out: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        errors[name] = (out.float() - ref).abs().max().item()
        fns[name] = run
    return fns, reps, errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", default="1x2048,1x4096", help="BATCHxSEQ list (causal, no mask)")
    p.add_argument("--decode", default="1,16,17,64", help="query tokens against the cache")
    p.add_argument("--batches", default="1,8", help="batches of the decode rows")
    p.add_argument("--ctx", type=int, default=1024, help="cache length of the decode rows")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument(
        "--sweep",
        nargs="?",
        const=",".join(SWEEP),
        default="",
        help="kernel configs (BMxBNwWARPSsSTAGES list; default list without a value) at the prefill rows",
    )
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
    sweep = [c for c in (kattn.parse_config(x) for x in args.sweep.split(",") if x.strip()) if fits(c)]
    rows = []
    raise_recompile_limits()
    with torch.no_grad():
        for b, q_len, kv_len, masked in cases:
            torch._dynamo.reset()  # flex compiled for this shape alone (static), as a first prefill is
            fns, reps, errors = contenders(b, q_len, kv_len, masked, device, l2, sweep)
            graphs = {k: capture(fn, None) for k, fn in fns.items()}
            times = interleaved({k: g.replay for k, g in graphs.items()}, 5, args.reps, True)
            us = {k: statistics.median(v) * 1e3 / reps for k, v in times.items()}
            rows.append((b, q_len, kv_len, masked, us, errors))
            log(f"B={b} L={q_len} S={kv_len} mask={masked}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))
            log("  max |triton - fp32 ref|: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
            del graphs, fns
    text = report(rows, args.reps, time.perf_counter() - t0, argv or sys.argv[1:])
    log(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    return 0


def causal_tflops(b: int, q_len: int, kv_len: int, us: float) -> float:
    """TFLOP/s of the two products over the visible (causal) pairs."""
    pairs = sum(min(kv_len, kv_len - q_len + i + 1) for i in range(q_len))
    return 4 * b * HQ * D * pairs / (us * 1e-6) / 1e12


def report(rows, reps: int, seconds: float, argv) -> str:
    main_names = ["eager tier", "flex", "triton", "triton, mask", "sdpa, no softcap"]
    lines = ["# Softcapped attention per call: eager tier, flex_attention, the Triton kernel (Gemma-2-9B shapes)", "",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
             f"- {HQ} query heads, {HKV} KV heads, head dim {D}, softcap {SOFTCAP}, bf16; us per call, CUDA-graph "
             f"replays interleaved, median of {reps} rounds; flex.FLEX_MIN_Q = {flex.FLEX_MIN_Q}",
             f"- triton: kernel config {kattn.CONFIGS[256]} (CONFIGS[256]); 'triton, mask' reads transformers' "
             "boolean mask (compiled prefill, decode rows)",
             "- 'sdpa, no softcap' computes another function (stock transformers 5.17 on Gemma-2): a floor", "",
             "| B | L | S | mask | " + " | ".join(f"{n} us" for n in main_names) +
             " | triton TFLOP/s | flex / eager | best triton / flex | best triton / sdpa |",
             "|---" * (len(main_names) + 8) + "|"]  # fmt: skip
    for b, q_len, kv_len, masked, us, _ in rows:
        cells = " | ".join(f"{us[n]:.1f}" if n in us else "-" for n in main_names)
        best = min((v for k, v in us.items() if k.startswith("triton")), default=float("nan"))
        lines.append(f"| {b} | {q_len} | {kv_len} | {'bool' if masked else 'causal'} | {cells} | "
                     f"{causal_tflops(b, q_len, kv_len, best):.0f} | {us['flex'] / us['eager tier']:.3f} | "
                     f"{best / us['flex']:.3f} | {best / us['sdpa, no softcap']:.3f} |")  # fmt: skip
    sweeps = [r for r in rows if any(k.startswith("triton ") and k != "triton, mask" for k in r[4])]
    if sweeps:
        lines += ["", "## Kernel configs (prefill rows): us per call (max |out - fp32 ref|)", ""]
        names = sorted({k for r in sweeps for k in r[4] if k.startswith("triton") and k != "triton, mask"})
        lines += ["| B | L | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
        for b, q_len, _, _, us, err in sweeps:
            cells = [f"{us[n]:.1f} ({err[n]:.3f})" if n in us else "-" for n in names]
            lines.append(f"| {b} | {q_len} | " + " | ".join(cells) + " |")
    cmd = " ".join(["python benchmarks/bench_attention_softcap.py", *argv])
    return "\n".join([*lines, "", f"Run time {seconds:.0f} s. Command: `{cmd}`", ""])


if __name__ == "__main__":
    sys.exit(main())
