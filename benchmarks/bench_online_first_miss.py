"""What background online tuning costs the serving thread: the first gemmtune call of a process for a
missing key (the miss hook's queue and the default's run; the tuner is set up at import and its worker
starts in the background thread), the later misses' calls, and the seconds until each key's row is in
the table file. The same calls with online tuning off are the baseline, so the hook's own cost is the
difference. Per key it also reports its tune alone: its row's time less the wait before the worker took
it (the worker's start for the first key, the key before it for the others), which the budget bounds;
the worker's start is reported on its own line.

Each run is a fresh process (a first call is once per process): --runs of each, medians reported.
Runs on a GPU (bf16) or the CPU (fp32).

    PYTHONPATH=src python benchmarks/bench_online_first_miss.py --out OUT_DIR [--shape 4096x4096] [--ms 1,7,13]

Writes online_first_miss.md / .json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROW_WAIT_S = 600.0  # how long one process waits for its rows before it reports them missing


def _now_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def measure(shape: str, ms: list[int], table: str | None) -> dict:
    """One process's figures (run as the child of main)."""
    import torch

    import gemmtune
    from gemmtune.configs import read_table_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n, k = (int(v) for v in shape.split("x"))
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    xs = [torch.randn(m, k, device=device, dtype=dtype) for m in ms]
    torch.nn.functional.linear(xs[0][:, :-1], w[:, :-1])  # the BLAS start-up any first GEMM pays
    sync()
    calls = []
    t_miss = []
    for x in xs:
        t0 = time.perf_counter()
        gemmtune.gemm(x, w)
        sync()
        calls.append(_now_ms(t0))
        t_miss.append(time.perf_counter())
    t0 = time.perf_counter()
    gemmtune.gemm(xs[0], w)
    sync()
    hit_ms = _now_ms(t0)
    rows_s, tune_s, start_s = [], [], None
    if table is not None:  # poll the file: when each key's row is readable there
        left = set(ms)
        seen: dict[int, float] = {}
        deadline = time.monotonic() + ROW_WAIT_S
        while left and time.monotonic() < deadline:
            if os.path.exists(table):
                now = time.perf_counter()
                for r in read_table_file(table).rows:
                    if r.key.M in left:
                        seen[r.key.M] = now
                        left.discard(r.key.M)
            time.sleep(0.05)
        rows_s = [seen[m] - t_miss[i] if m in seen else None for i, m in enumerate(ms)]
        starts = [s for w in gemmtune.get_dispatcher().miss_hook().device_workers() for s in w.start_s.values()]
        start_s = starts[0] if starts else None
        # A key's tune begins when the worker is free: after its start (first key) or the key before.
        began = t_miss[0] + start_s if start_s is not None else None
        for i, m in enumerate(ms):
            began = None if began is None else max(began, t_miss[i])
            tune_s.append(seen[m] - began if m in seen and began is not None else None)
            began = seen.get(m)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "calls_ms": calls,
            "hit_ms": hit_ms, "row_s": rows_s, "tune_s": tune_s, "worker_start_s": start_s}  # fmt: skip


def _run_child(args, online: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMTUNE_TUNE_ONLINE")}
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "online.csv")
        if online:
            env.update(GEMMTUNE_TUNE_ONLINE=table, GEMMTUNE_TUNE_ONLINE_BUDGET=str(args.budget))
        cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--ms", args.ms,
               "--table", table if online else ""]  # fmt: skip
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=ROW_WAIT_S + 300)
        if p.returncode != 0:
            raise SystemExit(f"child failed ({p.returncode}):\n{p.stderr}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v, unit):
    return "missing" if v is None else f"{v:.1f} {unit}" if unit == "ms" else f"{v:.2f} {unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for online_first_miss.md / .json")
    ap.add_argument("--shape", default="4096x4096", help="N x K of the GEMM")
    ap.add_argument("--ms", default="1,7,13", help="the missing Ms, one after another")
    ap.add_argument("--budget", type=float, default=20.0, help="GEMMTUNE_TUNE_ONLINE_BUDGET per key")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per setting")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.child:
        print(json.dumps(measure(args.shape, ms, args.table or None)))
        return
    if not args.out:
        ap.error("--out is required")
    runs = {name: [_run_child(args, online) for _ in range(args.runs)] for name, online in
            (("off", False), ("online", True))}  # fmt: skip
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            "first_call_ms": _median([r["calls_ms"][0] for r in results]),
            "later_miss_ms": _median([c for r in results for c in r["calls_ms"][1:]]),
            "hit_ms": _median([r["hit_ms"] for r in results]),
            "row_s": [_median([r["row_s"][i] for r in results]) for i in range(len(ms))] if name == "online" else [],
            "tune_s": [_median([r["tune_s"][i] for r in results]) for i in range(len(ms))] if name == "online" else [],
            "worker_start_s": _median([r["worker_start_s"] for r in results]),
        }
    device = runs["online"][0]["device"]
    on, off = summary["online"], summary["off"]
    lines = [
        f"# Online tuning's first miss: {device}, N x K = {args.shape}, Ms {args.ms}, budget {args.budget:g} s",
        "",
        f"Medians of {args.runs} fresh processes per setting (`benchmarks/bench_online_first_miss.py`).",
        "",
        "| call | online tuning off | background online tuning |",
        "|---|---|---|",
        f"| first call (a miss) | {_fmt(off['first_call_ms'], 'ms')} | {_fmt(on['first_call_ms'], 'ms')} |",
        f"| later misses | {_fmt(off['later_miss_ms'], 'ms')} | {_fmt(on['later_miss_ms'], 'ms')} |",
        f"| a hit | {_fmt(off['hit_ms'], 'ms')} | {_fmt(on['hit_ms'], 'ms')} |",
        "",
        "| M | from its miss until its row is in the table | its tune (bounded by the budget) |",
        "|---|---|---|",
        *[f"| {m} | {_fmt(s, 's')} | {_fmt(t, 's')} |" for m, s, t in zip(ms, on["row_s"], on["tune_s"], strict=True)],
        "",
        f"The tuning worker's start (paid once, by the first key): {_fmt(on['worker_start_s'], 's')}.",
    ]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online_first_miss.md").write_text(text + "\n")
    (out / "online_first_miss.json").write_text(json.dumps({"device": device, "shape": args.shape, "ms": ms,
                                                            "budget_s": args.budget, "summary": summary,
                                                            "runs": runs}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
