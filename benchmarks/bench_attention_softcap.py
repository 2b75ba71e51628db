"""Flash attention per call, Gemma-2-9B and Llama-3-8B shapes: gemmtune's Triton kernel
(kernels/attention_softcap.py) with and without transformers' boolean mask, against SDPA (and, for
Gemma-2's softcap, the eager tier and flex_attention).

Gemma-2-9B (16 query heads, 8 KV heads, head dim 256, softcap 50, bf16) at prefill sizes (B x L tokens,
causal; flex's BlockMask cached, as optimize() does): eager tier, flex, "triton" (mask-free causal: eager
prefill), "triton, mask" (transformers' materialized causal mask, the mask alone deciding: compiled
prefill, where transformers materializes even the plain causal mask), and SDPA without the softcap
(another function, what stock transformers 5.17 runs for Gemma-2: a floor) with is_causal ("sdpa, no
softcap") and with the boolean mask ("sdpa, no softcap, mask": compiled stock). Llama-3-8B (32 / 8 heads,
head dim 128, no softcap) at --llama sizes: triton and triton with the mask against SDPA is_causal
(flash) and SDPA with the mask (what compiled prefill runs: GEMMTUNE_MASKED_PREFILL decides between
the two masked ones). "... edge-sN" contenders run the kernel's edge-block loop with N pipeline stages
instead of attention_softcap.EDGE_STAGES. Each contender's calls over rotating input sets (more than 2x
the L2 in all) are captured in a CUDA graph and replayed, contenders interleaved, median of rounds
(docs/benchmarking.md); the Triton contenders are checked against the fp32 reference first.

--decode adds Gemma-2 rows of L query tokens against a --ctx cache through transformers' boolean mask
(where flex starts to beat the eager tier: flex.FLEX_MIN_Q); --sweep adds one contender per kernel
config at the Gemma-2 prefill rows (default list: SWEEP, those that fit 227 KB of shared memory).

    python benchmarks/bench_attention_softcap.py --out OUT_DIR/attention_softcap.md
    python benchmarks/bench_attention_softcap.py --sweep --decode 1,16,17,64 --prefill 1x2048
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import torch
from bench_compile_ops import capture

from gemmtune.kernels import attention_softcap as kattn
from gemmtune.models import attention as attn_mod
from gemmtune.models import flex
from gemmtune.profiling.bench_model import interleaved, raise_recompile_limits


class Shape(NamedTuple):
    name: str
    hq: int
    hkv: int
    d: int
    softcap: float | None


GEMMA2 = Shape("Gemma-2-9B", 16, 8, 256, 50.0)
LLAMA3 = Shape("Llama-3-8B", 32, 8, 128, None)
SWEEP = ("128x64w8s2", "128x64w8s1", "128x32w8s2", "128x32w8s3", "64x64w4s2", "64x64w4s3", "64x32w4s3",
         "64x64w8s2", "128x128w8s1")  # fmt: skip


def fits(cfg: kattn.Config, d: int = GEMMA2.d) -> bool:
    """Q plus num_stages K and V tiles (bf16) within Hopper's 227 KB of shared memory per block."""
    return 2 * d * (cfg.block_m + 2 * cfg.num_stages * cfg.block_n) <= 227 * 1024


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


@contextlib.contextmanager
def edge_stages(n: int | None):
    """The kernel's edge-block loop at n pipeline stages inside (None: EDGE_STAGES as set)."""
    old = kattn.EDGE_STAGES
    kattn.EDGE_STAGES = old if n is None else n
    try:
        yield
    finally:
        kattn.EDGE_STAGES = old


def contenders(shape: Shape, b, q_len, kv_len, masked, device, l2_bytes, sweep=(), edge=()):
    """{name: fn} where fn runs one call on each of R rotating input sets; {name: max |out - fp32 ref|}
    of the Triton contenders on the first set. masked: decode rows (every contender gets the mask)."""
    hq, hkv, d, cap = shape.hq, shape.hkv, shape.d, shape.softcap
    set_bytes = 2 * (b * hq * q_len * d + 2 * b * hkv * kv_len * d)
    reps = max(2, math.ceil(2 * l2_bytes / set_bytes) + 1)
    g = torch.Generator(device="cpu").manual_seed(q_len * 1000 + kv_len + b + d)
    sets = [
        [(torch.randn(b, h, n, d, generator=g) * s).to(device, torch.bfloat16)
         for h, n, s in ((hq, q_len, 2.0), (hkv, kv_len, 2.0), (hkv, kv_len, 1.0))]
        for _ in range(reps)
    ]  # fmt: skip
    hf_mask = _mask(b, q_len, kv_len, device)
    mask = hf_mask if masked else None
    scale, mod = d**-0.5, _Module()

    def over_sets(call):
        def run():
            for q, k, v in sets:
                call(q, k, v)

        return run

    fns = {}
    if cap is not None:
        bm = flex.tensor_block_mask(mask, b, kv_len) if masked else flex.causal_block_mask(q_len, kv_len, None, device)
        run_flex, sm = flex.compiled(), flex.score_mod(cap)
        fns["eager tier"] = over_sets(lambda q, k, v: attn_mod.eager_attention(mod, q, k, v, mask, scaling=scale,
                                                                               softcap=cap))  # fmt: skip
        fns["flex"] = over_sets(lambda q, k, v: run_flex(q, k, v, score_mod=sm, block_mask=bm, scale=scale,
                                                         enable_gqa=True))  # fmt: skip
    sdpa = "sdpa, no softcap" if cap is not None else "sdpa"
    if not masked:
        fns[sdpa] = over_sets(lambda q, k, v: attn_mod.sdpa_attention(mod, q, k, v, None, scaling=scale))
    fns[f"{sdpa}, mask"] = over_sets(lambda q, k, v: attn_mod.sdpa_attention(mod, q, k, v, hf_mask, scaling=scale))

    def triton(cfg=None, with_mask=None, edge=None):  # with a mask, the mask alone decides (as routed)
        kw = {"scaling": scale, "softcap": cap, "causal": with_mask is None, "config": cfg, "mask": with_mask}

        def run():
            with edge_stages(edge):
                for q, k, v in sets:
                    kattn.softcap_attention(q, k, v, **kw)

        return run, kw, edge

    checks = {}
    if not masked:
        checks["triton"] = triton()
        checks.update({f"triton edge-s{n}": triton(edge=n) for n in edge})
        checks.update({f"triton {c}": triton(c) for c in sweep})
    checks["triton, mask"] = triton(None, hf_mask)
    checks.update({f"triton, mask edge-s{n}": triton(None, hf_mask, n) for n in edge})
    errors = {}
    q, k, v = sets[0]
    ref = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), scaling=scale, softcap=cap, causal=True,
                                      mask=mask)  # fmt: skip
    for name, (run, kw, n) in checks.items():
        try:
            with edge_stages(n):
                out = kattn.softcap_attention(q, k, v, **kw)
        except Exception as exc:  # noqa: BLE001 - a config that does not build here: left out, said so
            log(f"  {name} left out: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        errors[name] = (out.float() - ref).abs().max().item()
        fns[name] = run
    return fns, reps, errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", default="1x2048,1x4096", help="Gemma-2 BATCHxSEQ list (causal)")
    p.add_argument("--llama", default="1x2048", help="Llama-3-8B BATCHxSEQ list (causal; empty: none)")
    p.add_argument("--decode", default="", help="Gemma-2 query tokens against the cache (e.g. 1,16,17,64)")
    p.add_argument("--batches", default="1,8", help="batches of the decode rows")
    p.add_argument("--ctx", type=int, default=1024, help="cache length of the decode rows")
    p.add_argument("--edge-stages", default="2", help="extra pipeline stages of the edge loop to time (empty: none)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument(
        "--sweep",
        nargs="?",
        const=",".join(SWEEP),
        default="",
        help="kernel configs (BMxBNwWARPSsSTAGES list; default list without a value) at the Gemma-2 prefill rows",
    )
    p.add_argument("--out", default=None, help="markdown file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or flex.unavailable_reason("cuda"):
        log(f"bench_attention_softcap needs a CUDA GPU with flex_attention: {flex.unavailable_reason('cuda')}")
        return 1
    t0 = time.perf_counter()
    device = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)

    def sizes(text):
        return [tuple(int(v) for v in x.split("x")) for x in text.split(",") if x.strip()]

    cases = [(GEMMA2, b, s, s, False) for b, s in sizes(args.prefill)]
    cases += [(LLAMA3, b, s, s, False) for b, s in sizes(args.llama)]
    cases += [(GEMMA2, b, int(q), args.ctx, True) for b in (int(x) for x in args.batches.split(","))
              for q in args.decode.split(",") if q.strip()]  # fmt: skip
    sweep = [c for c in (kattn.parse_config(x) for x in args.sweep.split(",") if x.strip()) if fits(c)]
    edge = [int(x) for x in args.edge_stages.split(",") if x.strip() and int(x) != kattn.EDGE_STAGES]
    rows = []
    raise_recompile_limits()
    with torch.no_grad():
        for shape, b, q_len, kv_len, masked in cases:
            torch._dynamo.reset()  # flex compiled for this shape alone (static), as a first prefill is
            swept = sweep if shape is GEMMA2 and not masked else ()
            fns, reps, errors = contenders(shape, b, q_len, kv_len, masked, device, l2, swept, edge)
            graphs = {k: capture(fn, None) for k, fn in fns.items()}
            times = interleaved({k: g.replay for k, g in graphs.items()}, 5, args.reps, True)
            us = {k: statistics.median(v) * 1e3 / reps for k, v in times.items()}
            rows.append((shape, b, q_len, kv_len, masked, us, errors))
            log(f"{shape.name} B={b} L={q_len} S={kv_len} decode={masked}: "
                + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))  # fmt: skip
            log("  max |triton - fp32 ref|: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
            del graphs, fns
    text = report(rows, args.reps, time.perf_counter() - t0, argv or sys.argv[1:])
    log(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    return 0


def causal_tflops(shape: Shape, b: int, q_len: int, kv_len: int, us: float) -> float:
    """TFLOP/s of the two products over the visible (causal) pairs."""
    pairs = sum(min(kv_len, kv_len - q_len + i + 1) for i in range(q_len))
    return 4 * b * shape.hq * shape.d * pairs / (us * 1e-6) / 1e12


def _ratio(us: dict, a: str, b: str) -> str:
    return f"{us[a] / us[b]:.3f}" if a in us and b in us else "-"


def report(rows, reps: int, seconds: float, argv) -> str:
    lines = ["# Flash attention per call: the Triton kernel with and without transformers' mask vs SDPA", "",
             f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16, us per call, CUDA-graph "
             f"replays interleaved, median of {reps} rounds; flex.FLEX_MIN_Q = {flex.FLEX_MIN_Q}",
             f"- triton: kernel configs {kattn.CONFIGS[256]} (D=256), {kattn.CONFIGS[128]} (D=128); edge loop "
             f"at EDGE_STAGES = {kattn.EDGE_STAGES} unless 'edge-sN'; ', mask': transformers' boolean causal mask "
             "(materialized: compiled prefill), the mask alone deciding",
             "- 'sdpa, no softcap' is another function for Gemma-2 (stock transformers 5.17): a floor"]  # fmt: skip
    for shape in (GEMMA2, LLAMA3):
        mine = [r for r in rows if r[0] is shape]
        if not mine:
            continue
        sdpa = "sdpa, no softcap" if shape.softcap is not None else "sdpa"
        names = list(dict.fromkeys(k for r in mine for k in r[5] if not _swept(k)))
        cap = f"softcap {shape.softcap}" if shape.softcap is not None else "no softcap"
        lines += ["", f"## {shape.name}: {shape.hq} query heads, {shape.hkv} KV heads, head dim {shape.d}, {cap}", "",
                  "| B | L | S | rows | " + " | ".join(f"{n} us" for n in names) +
                  " | triton TFLOP/s | mask / no mask (triton) | triton, mask / sdpa, mask | triton / sdpa |",
                  "|---" * (len(names) + 8) + "|"]  # fmt: skip
        for _, b, q_len, kv_len, masked, us, _ in mine:
            cells = " | ".join(f"{us[n]:.1f}" if n in us else "-" for n in names)
            best = min((v for k, v in us.items() if k.startswith("triton") and "mask" not in k), default=float("nan"))
            lines.append(f"| {b} | {q_len} | {kv_len} | {'decode' if masked else 'prefill'} | {cells} | "
                         f"{causal_tflops(shape, b, q_len, kv_len, best):.0f} | "
                         f"{_ratio(us, 'triton, mask', 'triton')} | {_ratio(us, 'triton, mask', f'{sdpa}, mask')} | "
                         f"{_ratio(us, 'triton', sdpa)} |")  # fmt: skip
    sweeps = [r for r in rows if any(_swept(k) for k in r[5])]
    if sweeps:
        lines += ["", "## Kernel configs (Gemma-2 prefill rows): us per call (max |out - fp32 ref|)", ""]
        names = sorted({k for r in sweeps for k in r[5] if _swept(k)})
        lines += ["| B | L | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
        for _, b, q_len, _, _, us, err in sweeps:
            cells = [f"{us[n]:.1f} ({err[n]:.3f})" if n in us else "-" for n in names]
            lines.append(f"| {b} | {q_len} | " + " | ".join(cells) + " |")
    cmd = " ".join(["python benchmarks/bench_attention_softcap.py", *argv])
    return "\n".join([*lines, "", f"Run time {seconds:.0f} s. Command: `{cmd}`", ""])


def _swept(name: str) -> bool:
    return name.startswith("triton ") and "x" in name.split()[-1] and "edge" not in name


if __name__ == "__main__":
    sys.exit(main())
