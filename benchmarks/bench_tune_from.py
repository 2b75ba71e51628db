"""A tune from a donor table against a full tune, on this GPU: the same shape list tuned by `gemmtune tune`
(full.csv) and by `gemmtune tune --from DONOR` (from.csv), each with a Triton cache of its own (both
start cold, as a fresh host does), their wall seconds timed. Then every key of the list is timed in ONE
interleaved run (tuner/timing.py bench_gemm: CUDA graphs over rotating cold inputs, median of --reps)
of the family's default, what each table dispatches, and the default again (their spread is the noise,
at least 1%); a table slower than the default beyond the noise is timed again on fresh inputs and
counts as slower only if that agrees (as `gemmtune bench` does). Writes <out>/tune_from.json and
<out>/tune_from.md: both wall times and their ratio, each table's geomean speed over the default, the
--from tune's verdict per key (carried over, neighbour won, default kept, full search) and every key
where a table is slower than the default beyond the noise.

The GPU acceptance run (an H200; the donor holds H100 rows for Llama-3-8B and Qwen3-32B at M 1, 8, 2048,
which seed the other Ms of the default ladder; --steps splits the run over device calls that keep OUT):

    for m in llama-3-8b qwen3-32b; do
      gemmtune shapes --model $m --family a8w8 --no-lm-head -o /tmp/shapes.$m.csv; done
    (head -1 /tmp/shapes.llama-3-8b.csv; tail -qn +2 /tmp/shapes.*.csv | sort -u) > /tmp/a8w8_shapes.csv
    python benchmarks/bench_tune_from.py /tmp/a8w8_shapes.csv \\
        benchmarks/results/h100/optimize_fp8/a8w8_tuned.csv -o /tmp/tune_from_h200 --steps full,from
    python benchmarks/bench_tune_from.py /tmp/a8w8_shapes.csv \\
        benchmarks/results/h100/optimize_fp8/a8w8_tuned.csv -o /tmp/tune_from_h200 --steps measure

A dry run on the CPU (a tiny a16w16 list, a donor tuned on the CPU first):

    printf 'M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\\n4,64,64,False,torch.float32,torch.float32,False,False\\n' \\
        > /tmp/tiny.csv
    gemmtune tune /tmp/tiny.csv -o /tmp/tiny_donor.csv --device cpu --no-progress
    python benchmarks/bench_tune_from.py /tmp/tiny.csv /tmp/tiny_donor.csv -o /tmp/tune_from_cpu --device cpu
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile

import torch
from bench_tune_fleet import run  # the same wall-time runner: one command, its log, exit on failure

from gemmtune.tuner.donor import VERDICTS

STEPS = ("full", "from", "measure")


def profile_verdicts(path: str) -> dict[str, str]:
    """key text -> the --from tune's verdict, from its profile file (the `donor` column)."""
    with open(path, newline="") as fh:
        return {row["key"]: row["donor"] for row in csv.DictReader(fh)}


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def measure(shapes: str, family: str | None, tables: dict[str, str], device: torch.device, reps: int) -> list[dict]:
    """Per key: the default's and each table's us in one interleaved run, the noise, and each table's
    speed over the default (1.0 where the table dispatches the default itself)."""
    import gemmtune
    from gemmtune import backends
    from gemmtune.tuner.runner import load_keys
    from gemmtune.tuner.search import NOISE_FLOOR, shape_seed
    from gemmtune.tuner.timing import bench_gemm

    fam, keys = load_keys(shapes, family)
    out = []
    try:
        for key in keys:
            default_backend, default_sol = backends.default(fam.name, key, device)
            default = default_backend.make_runner(default_sol, key, device)
            runners, solutions = {"default": default}, {}
            for name, table in tables.items():
                gemmtune.set_config(table)
                res = gemmtune.resolve(key, device, fam.name)
                runners[name], solutions[name] = res.runner, res.solution
            runners["default#2"] = default
            gemmtune.set_config(None)
            seed = shape_seed(key, 0, fam)
            t = bench_gemm(key, runners, device=device, reps=reps, seed=seed, family=fam)
            d1, d2 = t["default"], t["default#2"]
            noise = max(abs(d1 - d2) / min(d1, d2), NOISE_FLOOR)
            d = (d1 + d2) / 2
            entry = {"key": fam.describe(key), "default_us": d, "noise": noise}
            for name in tables:
                same = solutions[name] == default_sol  # one kernel timed twice: its ratio is noise
                speed = 1.0 if same else d / t[name]
                slower = not same and speed < 1 / (1 + noise)
                if slower:  # time it again on fresh inputs before calling it a regression
                    t2 = bench_gemm(key, runners, device=device, reps=reps, seed=seed + 1, family=fam)
                    slower = (t2["default"] + t2["default#2"]) / 2 / t2[name] < 1 / (1 + noise)
                entry[name] = {"solution": solutions[name].describe(), "us": t[name], "speed": speed,
                               "slower": slower}  # fmt: skip
            out.append(entry)
            print(f"{entry['key']}: default {d:.2f} us, " + ", ".join(
                f"{n} {entry[n]['us']:.2f} us ({entry[n]['speed']:.3f}x)" for n in tables), flush=True)  # fmt: skip
    finally:
        gemmtune.set_config(None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", help="the shape list (aiter's untuned CSV of any family)")
    ap.add_argument("donor", help="a tuned table of the list's family from another GPU")
    ap.add_argument("-o", "--out", required=True, help="folder for the tables, logs and the report")
    ap.add_argument("--family", default=None, help="the list's family (default: from its header)")
    ap.add_argument("--reps", type=int, default=50, help="graph replays of the final measurement (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--steps", default="full,from,measure",
                    help="which steps to run, in order: the two tunes (each writes its wall seconds to "
                         "<out>/wall.json) and the measurement, which reads them; split them over runs that "
                         "keep <out>")  # fmt: skip
    args = ap.parse_args()
    steps = args.steps.split(",")
    if not steps or any(s not in STEPS for s in steps):
        ap.error(f"--steps {args.steps!r}: a comma list of {', '.join(STEPS)}")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    tables = {"full": os.path.join(args.out, "full.csv"), "from": os.path.join(args.out, "from.csv")}
    profiles = {n: os.path.join(args.out, f"{n}_profile.csv") for n in tables}
    wall_file = os.path.join(args.out, "wall.json")
    wall = {}
    if os.path.exists(wall_file):
        with open(wall_file) as fh:
            wall = json.load(fh)
    tune = [sys.executable, "-m", "gemmtune.cli.main", "tune", args.shapes, "--no-progress", "--device", args.device]
    tune += ["--family", args.family] if args.family else []
    for name, extra in (("full", []), ("from", ["--from", args.donor])):
        if name not in steps:
            continue
        for path in (tables[name], profiles[name]):  # this benchmark's own files: each tune starts afresh
            if os.path.exists(path):
                os.remove(path)
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"triton_cache_{name}_"))
        cmd = [*tune, *extra, "-o", tables[name], "--profile-file", profiles[name]]
        wall[name] = run(cmd, env, os.path.join(args.out, f"tune_{name}.log"))
        with open(wall_file, "w") as fh:
            json.dump(wall, fh)
        print(f"{name}: tuned in {wall[name]:.1f} s", flush=True)
    if "measure" not in steps:
        return
    missing = [n for n in tables if n not in wall or not os.path.exists(tables[n])]
    if missing:
        need = ",".join(missing)
        sys.exit(f"bench_tune_from: no {need} tune in {args.out}: run --steps {need} first")
    verdict_of = profile_verdicts(profiles["from"])
    keys = measure(args.shapes, args.family, tables, device, args.reps)
    for e in keys:
        e["verdict"] = verdict_of.get(e["key"], "")
    counts = {v: sum(e["verdict"] == v for e in keys) for v in VERDICTS}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": gpu, "shapes": args.shapes, "donor": args.donor, "keys": len(keys), "reps": args.reps,
        "wall_s_full": wall["full"], "wall_s_from": wall["from"], "wall_ratio": wall["full"] / wall["from"],
        "geomean_speed_full": geomean([e["full"]["speed"] for e in keys]),
        "geomean_speed_from": geomean([e["from"]["speed"] for e in keys]),
        "verdicts": counts,
        "slower": [{"key": e["key"], "table": n, "speed": e[n]["speed"]} for e in keys for n in tables
                   if e[n]["slower"]],
        "per_key": keys,
    }  # fmt: skip
    with open(os.path.join(args.out, "tune_from.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    lines = [
        f"# Tune --from a donor vs a full tune ({gpu})", "",
        f"{len(keys)} keys of {args.shapes}, donor {args.donor}.", "",
        f"Wall: full {wall['full']:.1f} s, --from {wall['from']:.1f} s: full / --from **{report['wall_ratio']:.2f}x**.",
        f"Geomean speed over the default (one interleaved run, {args.reps} replays): full "
        f"{report['geomean_speed_full']:.3f}x, --from {report['geomean_speed_from']:.3f}x.",
        "Verdicts: " + ", ".join(f"{v} {c}" for v, c in counts.items()) + ".",
        "Slower than the default beyond the noise (rechecked): "
        + (", ".join(f"{s['key']} ({s['table']}, {s['speed']:.3f}x)" for s in report["slower"]) or "none") + ".",
        "", "| key | verdict | default us | full | speed | --from | speed | noise |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for e in keys:
        lines.append(f"| {e['key']} | {e['verdict']} | {e['default_us']:.2f} | {e['full']['solution']} | "
                     f"{e['full']['speed']:.3f}x | {e['from']['solution']} | {e['from']['speed']:.3f}x | "
                     f"{e['noise']:.1%} |")  # fmt: skip
    with open(os.path.join(args.out, "tune_from.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
