"""Tuning over torch.distributed against one rank, on one host: the same shape list (two models' GEMMs) tuned
by `gemmtune tune` on one GPU, then by `torchrun --nproc-per-node N ... tune` on N GPUs, each run with a
Triton cache of its own (both start cold, as a fresh host does). Prints both wall times and the speedup,
then compares the two tables key by key: where the winners differ, both winners are timed again
interleaved on cuda:0 (CUDA graphs, cold rotating inputs, median of --reps; a pair --noise or more apart
again with 5x the replays) and the pair is "within noise" when they are less than --noise apart. Writes
<out>/fleet.json and <out>/fleet.md.

The 1-rank run also writes <out>/one_rank.json (its wall seconds); --reuse-one takes that and
<out>/one_rank.csv instead of running it again, so the two sides can run in two calls (same GPU kind).

    python benchmarks/bench_tune_fleet.py --models llama-3-8b,qwen3-32b --nsets 1..8192 --nproc 2 -o out
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def run(cmd: list[str], env: dict, log: str) -> float:
    """Wall seconds of one command; its output goes to `log`, and a failure ends the benchmark."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        p = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}); see {log}")
    return took


def merged_shapes(models: list[str], nsets: str, out: str) -> str:
    """One untuned list with every model's GEMMs (a key two models share is listed once)."""
    path = os.path.join(out, "shapes.csv")
    header, seen = None, {}
    for model in models:
        # a config path names its file by its folder and stem: "models/x/config.json" -> "x_config"
        stem = "_".join(os.path.normpath(os.path.splitext(model)[0]).split(os.sep)[-2:])
        part = os.path.join(out, f"shapes.{stem}.csv")
        subprocess.run([sys.executable, "-m", "gemmtune.cli.main", "shapes", "--model", model, "--nsets", nsets,
                        "-o", part], check=True)  # fmt: skip
        with open(part, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader)
            for row in reader:
                seen.setdefault(tuple(row), None)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(seen)
    return path


def reused_one_rank(path: str, table: str, run_facts: dict) -> float | None:
    """The 1-rank run's wall seconds from an earlier call (`path`, beside its `table`), None when either is
    missing; an earlier run of other keys ends the benchmark."""
    if not (os.path.exists(path) and os.path.exists(table)):
        return None
    with open(path) as fh:
        earlier = json.load(fh)
    differs = {k: (earlier.get(k), v) for k, v in run_facts.items() if earlier.get(k) != v}
    if differs:
        sys.exit(f"{path} is from another run ({differs}: earlier, now); drop --reuse-one to run it again")
    return float(earlier["wall_s"])


def retime_differences(one: str, many: str, reps: int, device: str, noise: float = float("inf")) -> list[dict]:
    """Every key of the two tables: its winners, and for keys whose winners differ both timed again; a pair
    `noise` or more apart is timed once more with 5x the replays, and that time is its verdict's
    (`apart_first` keeps the first)."""
    import gemmtune
    from gemmtune.configs import read_table_file
    from gemmtune.tuner.timing import bench_gemm

    rows_one = {r.key: r for r in read_table_file(one).rows}
    rows_many = {r.key: r for r in read_table_file(many).rows}
    out = []
    for key in sorted(set(rows_one) | set(rows_many), key=str):
        a, b = rows_one.get(key), rows_many.get(key)
        entry = {"key": a.describe_key() if a else b.describe_key(), "one": a and f"{a.libtype}:{a.kernel_name}",
                 "many": b and f"{b.libtype}:{b.kernel_name}"}  # fmt: skip
        if a is None or b is None:
            entry["verdict"] = "missing"
        elif (a.libtype, a.kernel_name, a.splitk) == (b.libtype, b.kernel_name, b.splitk):
            entry["verdict"] = "same"
        else:
            runners = {}
            for name, table in (("one", one), ("many", many)):
                gemmtune.set_config(table)
                runners[name] = gemmtune.resolve(key, device).runner
            gemmtune.set_config(None)
            us = bench_gemm(key, runners, device, reps=reps)
            apart = abs(us["one"] - us["many"]) / min(us.values())
            if apart >= noise:
                entry["apart_first"] = apart
                us = bench_gemm(key, runners, device, reps=5 * reps)
                apart = abs(us["one"] - us["many"]) / min(us.values())
            entry.update(us_one=us["one"], us_many=us["many"], apart=apart)
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3-8b,qwen3-32b", help="presets (or config paths), comma list")
    ap.add_argument("--nsets", default="1..8192", help="token counts M (default: gemmtune shapes' own ladder)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the distributed run (one GPU each)")
    ap.add_argument("--reps", type=int, default=50, help="graph replays when timing differing winners again")
    ap.add_argument("--noise", type=float, default=0.02, help="winners closer than this fraction agree")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (gloo ranks: a dry run of the benchmark)")
    ap.add_argument("-o", "--out", required=True, help="folder for the tables, logs and the report")
    ap.add_argument("--reuse-one", action="store_true",
                    help="take the 1-rank run from <out>/one_rank.csv and one_rank.json when both exist")  # fmt: skip
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shapes = merged_shapes(args.models.split(","), args.nsets, args.out)
    keys = sum(1 for _ in open(shapes)) - 1
    tables = {"one": os.path.join(args.out, "one_rank.csv"), "many": os.path.join(args.out, f"{args.nproc}_ranks.csv")}
    one_json = os.path.join(args.out, "one_rank.json")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    run_facts = {"models": args.models, "nsets": args.nsets, "keys": keys, "device": gpu}  # both sides' must match
    wall = {}
    reused = reused_one_rank(one_json, tables["one"], run_facts) if args.reuse_one else None
    if reused is not None:
        wall["one"] = reused
        print(f"one: {keys} keys in {reused:.1f} s (reused from {one_json})", flush=True)
    for name in ("one", "many"):
        if name not in wall and os.path.exists(tables[name]):
            os.remove(tables[name])
    tune = ["-m", "gemmtune.cli.main", "tune", shapes, "--no-progress", "--device", args.device]
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    for name, launcher in (("one", []), ("many", torchrun)):
        if name in wall:
            continue
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"triton_cache_{name}_"))
        cmd = [sys.executable, *launcher, *tune, "-o", tables[name]]
        wall[name] = run(cmd, env, os.path.join(args.out, f"tune_{name}.log"))
        print(f"{name}: {keys} keys in {wall[name]:.1f} s", flush=True)
        if name == "one":
            with open(one_json, "w") as fh:
                json.dump({**run_facts, "wall_s": wall["one"]}, fh, indent=1)
    compared = retime_differences(tables["one"], tables["many"], args.reps, args.device, args.noise)
    verdicts = {}
    for e in compared:
        if "apart" in e:
            e["verdict"] = "within noise" if e["apart"] < args.noise else "differ"
        verdicts[e["verdict"]] = verdicts.get(e["verdict"], 0) + 1
    report = {
        "device": gpu, "ranks": args.nproc,
        "models": args.models, "nsets": args.nsets,
        "keys": keys, "wall_s_one_rank": wall["one"], f"wall_s_{args.nproc}_ranks": wall["many"],
        "speedup": wall["one"] / wall["many"], "one_rank_reused": reused is not None, "noise": args.noise,
        "verdicts": verdicts, "keys_compared": compared,
    }  # fmt: skip
    with open(os.path.join(args.out, "fleet.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    lines = [f"# Tuning on {args.nproc} ranks vs 1 ({report['device']})", "",
             f"{keys} keys ({args.models}, M in {args.nsets}): 1 rank {wall['one']:.1f} s, {args.nproc} ranks "
             f"{wall['many']:.1f} s, **{report['speedup']:.2f}x**.", "",
             "Winners: " + ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items())) + f" (noise {args.noise:.0%}).",
             "", "| key | 1 rank | N ranks | verdict | us (1) | us (N) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for e in compared:
        if e["verdict"] != "same":
            us = [f"{e[k]:.2f}" if k in e else "" for k in ("us_one", "us_many")]
            lines.append(f"| {e['key']} | {e['one']} | {e['many']} | {e['verdict']} | {us[0]} | {us[1]} |")
    with open(os.path.join(args.out, "fleet.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
