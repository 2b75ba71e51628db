"""Eager prefill with a tuned table against no table, both in ONE process: an eager prefill is host-bound, and
processes of one configuration differ by up to 40% (benchmarks/results/h200/serving_band), so `bench-model`
(one table a process) cannot judge a table's effect there.

Per preset: build it with random weights (--layers decoder layers), `optimize(quantize=...)` it, then --rounds
rounds; a round puts each condition in effect (`set_config`: no table, then the table, the order flipping
each round), runs --warmup prefills and times --iters prefills (BATCHxSEQ tokens, last-token logits, no
cache), each between two synchronizes (what a serving step that reads its logits pays). Per condition: the
median and minimum of all its timed prefills, and the host's share: the milliseconds one prefill takes to
queue behind a long GPU sleep (the GPU never waits on the host there; a forward that synchronizes inside
shows as `syncs`). Writes OUT/eager_prefill.json and .md.

    python benchmarks/bench_eager_prefill.py TABLE.csv --models llama-3-8b,qwen3-32b --quantize fp8 -o OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import gemmtune
from gemmtune.profiling.build import build_model

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU sleep: longer than the host takes to queue one prefill


def prefill(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1)


def synced_ms(model, ids) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill(model, ids)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def host_ms(model, ids) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    prefill(model, ids)
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return host


def measure(model, ids, table: str, rounds: int, warmup: int, iters: int) -> dict:
    conditions = {"none": None, "table": table}
    ms = {c: [] for c in conditions}
    host = {c: [] for c in conditions}
    for r in range(rounds):
        for c in list(conditions)[:: 1 if r % 2 == 0 else -1]:
            gemmtune.set_config(conditions[c])
            for _ in range(warmup):
                prefill(model, ids)
            ms[c] += [synced_ms(model, ids) for _ in range(iters)]
            host[c].append(host_ms(model, ids))
    gemmtune.set_config(None)
    sleep_ms = 0.25 * SLEEP_CYCLES / 1e6  # a quarter of the sleep's nominal length: far above any queueing
    out = {}
    for c in conditions:
        h = statistics.median(host[c])
        out[c] = {"median_ms": statistics.median(ms[c]), "min_ms": min(ms[c]), "host_ms": h if h < sleep_ms else None,
                  "samples": len(ms[c])}  # fmt: skip
    out["table_over_none"] = out["table"]["median_ms"] / out["none"]["median_ms"]
    return out


def markdown(results: dict, args) -> str:
    lines = [
        f"Eager prefill {args.prefill}, `optimize(quantize={args.quantize!r})`, {args.layers} layers, random weights; "
        f"{args.rounds} rounds x {args.iters} synced prefills per condition, one process.",
        "",
        "| model | no table: median ms (min) | table: median ms (min) | table / none | host ms: none / table |",
        "|---|---|---|---|---|",
    ]
    for model, r in results.items():
        n, t = r["none"], r["table"]
        host = " / ".join("syncs" if v["host_ms"] is None else f"{v['host_ms']:.2f}" for v in (n, t))
        lines.append(f"| {model} | {n['median_ms']:.3f} ({n['min_ms']:.3f}) | {t['median_ms']:.3f} ({t['min_ms']:.3f}) "
                     f"| {r['table_over_none']:.3f} | {host} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="the tuned table(s), ':'-joined")
    ap.add_argument("--models", default="llama-3-8b,qwen3-32b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quantize", default="fp8", help="fp8, fp8-block, int8 or none")
    ap.add_argument("--prefill", default="1x2048", help="BATCHxSEQ")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    batch, seq = (int(v) for v in args.prefill.split("x"))
    device = torch.device("cuda")
    results = {}
    for name in args.models.split(","):
        model, desc = build_model(name, args.layers, device)
        quantize = None if args.quantize == "none" else args.quantize
        print(gemmtune.optimize(model, quantize=quantize), flush=True)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(device)
        results[name] = measure(model, ids, args.table, args.rounds, args.warmup, args.iters)
        print(f"{desc}: {json.dumps(results[name])}", flush=True)
        del model
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eager_prefill.json"), "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=1)
    text = markdown(results, args)
    with open(os.path.join(args.out, "eager_prefill.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
