"""Tuning speed and search quality: tune the same keys with several search modes, then time every
mode's winner against the default and an A/A copy of the reference's winner, interleaved, in
--compare-rounds runs on fresh inputs and graphs (docs/benchmarking.md), to see how often and by how
much a faster search loses the winner.

    python benchmarks/experiments/exp_tune_speed.py --models llama-3-8b:1 --ms 1..8192 --modes exhaustive,fast \
        --out OUT_DIR
    python benchmarks/experiments/exp_tune_speed.py --family fmoe --models qwen3-30b-a3b,olmoe-1b-7b --ms 1,16,256 \
        --modes fast,exhaustive --out OUT_DIR

A mode is `fast` or `exhaustive`, optionally with TuneOptions fields: `fast:seed=1:min_gain=0.01`.
Writes OUT/tune_speed.json (per key and mode: seconds, seconds per phase, candidates by status, winner,
its us) and OUT/tune_speed.md (per-mode totals, the A/A spread, the comparison, every miss beyond 1%)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: suites, bench_skinny

from suites import find_models_dir  # noqa: E402

from gemmtune import backends, families  # noqa: E402
from gemmtune.tuner.model_shapes import gemm_keys, load_model_config, model_gemms, moe_keys, parse_nsets  # noqa: E402
from gemmtune.tuner.runner import range_floors  # noqa: E402
from gemmtune.tuner.search import TuneOptions, precompile_all, shape_seed, tune_shape  # noqa: E402
from gemmtune.tuner.timing import bench_gemm, make_inputs  # noqa: E402

MODES = {
    # The search as it was: every candidate checked and screened, top 4 timed.
    "exhaustive": dict(search="exhaustive"),
    # The default search (tuner/search.py: pruned, neighbour-seeded, fewer replays).
    "fast": dict(search="fast"),
}


def model_keys(models_dir, specs: list[str], ms: list[int], layers: set[str] | None, family: str = "a16w16"):
    """The models' keys of `family`: a16w16 (their linears, or `layers` of them) or fmoe (their expert
    blocks, one key per token count in `ms`)."""
    keys = []
    for spec in specs:
        name, _, tp = spec.partition(":")
        path = models_dir / f"{name}.json"
        cfg, _ = load_model_config(str(path) if path.is_file() else name)
        if family == "fmoe":
            keys += moe_keys(cfg, int(tp or 1), tokens=ms)
            continue
        shapes = [s for s in model_gemms(cfg, int(tp or 1)) if layers is None or s.name in layers]
        keys += gemm_keys(shapes, ms)
    return list(dict.fromkeys(keys))


def tune_all(keys, device, opts: TuneOptions, fam) -> dict:
    floors = range_floors(fam, keys, [])
    out = {}
    t0 = time.perf_counter()
    for key in keys:
        r = tune_shape(key, device, opts, family=fam, m_lo=floors[key])
        status = Counter(c.status for c in r.candidates)
        out[key] = {
            "key": fam.describe(key),
            "seconds": r.seconds,
            "phases": r.phases,
            "candidates": dict(status),
            "by_backend": dict(Counter(c.libtype for c in r.candidates)),
            "winner": r.winner.name,
            "solution": (r.winner.libtype, r.winner.kernel_name, r.winner.solidx, r.winner.splitk),
            "us": r.us,
            "default_us": r.default_us,
            "kept_default": r.kept_default,
            "m_lo": r.m_lo,
        }
        print(f"{fam.describe(key):36s} {r.seconds:6.1f}s  {r.winner.name[:60]:60s} {r.speedup:.3f}x  "
              + " ".join(f"{k}={v:.1f}" for k, v in r.phases.items()), flush=True)  # fmt: skip
    return {"seconds": time.perf_counter() - t0, "keys": out}


def compare(keys, device, runs: dict, fam, reps: int, rounds: int, ref: str) -> list[dict]:
    """Each mode's winner, the default, and a second copy of the reference's winner (an A/A control:
    the spread this comparison cannot resolve), interleaved; `rounds` runs on fresh inputs and fresh
    graphs, the mean of their medians counts (one run's graphs carry a bias of their own)."""
    torch_backend = backends.get("torch", fam.name)
    rows = []
    for key in keys:
        runners, names = {}, {}
        for mode, run in runs.items():
            libtype, kname, solidx, splitk = run["keys"][key]["solution"]
            offered = _solutions(key, device, libtype, fam)
            sol = next((s for s in offered if (s.kernel_name, s.solidx) == (kname, solidx)), None)
            if sol is None:
                sol = torch_backend.default_solution(key, device)
            names[mode] = f"{libtype}:{kname}"
            runners[mode] = backends.get(sol.libtype, fam.name).make_runner(sol, key, device)
            if mode == ref:
                runners[f"{ref}#2"] = backends.get(sol.libtype, fam.name).make_runner(sol, key, device)
        runners["default"] = torch_backend.make_runner(torch_backend.default_solution(key, device), key, device)
        per_round = []
        for r in range(rounds):
            inputs = make_inputs(key, device, seed=shape_seed(key, 7 + r, fam) + 1, family=fam)
            per_round.append(bench_gemm(key, runners, device, reps=reps, inputs=inputs, family=fam))
            del inputs
        t = {n: statistics.fmean(x[n] for x in per_round) for n in runners}
        rows.append({"key": fam.describe(key), "M": fam.m_of(key), **{f"{m}_us": t[m] for m in runners},
                     **{f"{m}_winner": names[m] for m in runs}})  # fmt: skip
    return rows


def _solutions(key, device, libtype, fam):
    b = backends.get(libtype, fam.name)
    if b is None:
        return []
    default = b.default_solution(key, device)
    return [*b.candidates(key, device), *([default] if default else [])]


def report(runs: dict, rows: list[dict], out: pathlib.Path, args) -> str:
    lines = [f"# Tuning speed and search quality ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"Models {args.models}, Ms {args.ms}; command: `python benchmarks/experiments/exp_tune_speed.py "
             f"{' '.join(sys.argv[1:])}`", "",
             "| mode | keys | total s | s per key | " + " | ".join(_phase_names(runs)) + " |",
             "|---|---|---|---|" + "---|" * len(_phase_names(runs))]  # fmt: skip
    for mode, run in runs.items():
        ks = run["keys"].values()
        ph = {p: sum(k["phases"].get(p, 0.0) for k in ks) for p in _phase_names(runs)}
        lines.append(f"| {mode} | {len(ks)} | {run['seconds']:.0f} | {run['seconds'] / max(len(ks), 1):.2f} | "
                     + " | ".join(f"{v:.0f}" for v in ph.values()) + " |")  # fmt: skip
    modes = list(runs)
    if len(modes) >= 2 and rows:
        ref = reference_mode(runs)
        aa = [max(r[f"{ref}_us"], r[f"{ref}#2_us"]) / min(r[f"{ref}_us"], r[f"{ref}#2_us"]) - 1 for r in rows]
        lines += [
            "",
            f"A/A control (the reference's winner timed twice as two contenders, {args.compare_rounds} "
            f"rounds): spread median {100 * statistics.median(aa):.2f}%, max {100 * max(aa):.2f}%",
        ]
        for mode in [m for m in modes if m != ref]:
            ratios = [r[f"{mode}_us"] / r[f"{ref}_us"] for r in rows]
            # The same kernel picked by both is the same winner, whatever this run's noise says.
            same = [r[f"{mode}_winner"] == r[f"{ref}_winner"] for r in rows]
            within = sum(x <= 1.01 or s for x, s in zip(ratios, same, strict=True))
            lines += ["", f"## {mode} vs {ref}: winner within 1% on {within}/{len(rows)} keys "
                      f"({100 * within / len(rows):.1f}%), geomean time ratio "
                      f"{math.exp(statistics.fmean(math.log(x) for x in ratios)):.4f}", "",
                      "| key | ref us | mode us | ratio | ref winner | mode winner |",
                      "|---|---|---|---|---|---|"]  # fmt: skip
            for r, x, s in zip(rows, ratios, same, strict=True):
                if x > 1.01 and not s:
                    lines.append(f"| {r['key']} | {r[f'{ref}_us']:.2f} | {r[f'{mode}_us']:.2f} | {x:.3f} | "
                                 f"{r[f'{ref}_winner']} | {r[f'{mode}_winner']} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "tune_speed.md").write_text(text)
    return text


def reference_mode(runs) -> str:
    return "exhaustive" if "exhaustive" in runs else next(iter(runs))


def parse_mode(spec: str) -> dict:
    """`fast`, `exhaustive`, or one of them with options: `fast:seed=1:min_gain=0.01`."""
    name, *opts = spec.split(":")
    out = dict(MODES[name])
    for o in opts:
        k, _, v = o.partition("=")
        out[k] = type(getattr(TuneOptions(), k))(v)
    return out


def _phase_names(runs) -> list[str]:
    names: dict[str, None] = {}
    for run in runs.values():
        for k in run["keys"].values():
            names.update(dict.fromkeys(k["phases"]))
    return list(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3-8b:1", help="comma list of MODEL:TP")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--ms", default="1..8192")
    ap.add_argument("--layers", default=None, help="comma list (default: every linear, lm_head too)")
    ap.add_argument("--modes", default="fast,exhaustive", help="the first pays the cold compiles")
    ap.add_argument("--libtype", default=None)
    ap.add_argument("--family", default="a16w16", choices=["a16w16", "fmoe"], help="fmoe: the models' expert blocks")
    ap.add_argument("--no-verify-range", action="store_true")
    ap.add_argument("--compare-reps", type=int, default=30)
    ap.add_argument("--compare-rounds", type=int, default=3)
    ap.add_argument("--out", default="tune_speed_out")
    args = ap.parse_args()
    device = torch.device("cuda")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fam = families.get(args.family)
    layers = set(args.layers.split(",")) if args.layers else None
    keys = model_keys(find_models_dir(args.models_dir), args.models.split(","), parse_nsets(args.ms), layers,
                      args.family)  # fmt: skip
    print(f"{len(keys)} keys", flush=True)
    runs = {}
    for mode in args.modes.split(","):
        opts = TuneOptions(libtypes=args.libtype.split(",") if args.libtype else None,
                           verify_range=not args.no_verify_range, **parse_mode(mode))  # fmt: skip
        tp = time.perf_counter()
        fails = precompile_all(keys, device, opts, workers=16, family=fam.name, floors=range_floors(fam, keys, []))
        pre = time.perf_counter() - tp
        print(f"== {mode}: precompiled in {pre:.1f}s ({len(fails)} failed)", flush=True)
        runs[mode] = tune_all(keys, device, opts, fam)
        runs[mode]["precompile_s"] = pre
        runs[mode]["seconds"] += pre
    rows = compare(keys, device, runs, fam, args.compare_reps, args.compare_rounds, reference_mode(runs)) \
        if len(runs) > 1 else []  # fmt: skip
    (out / "tune_speed.json").write_text(json.dumps({"runs": {m: {**r, "keys": list(r["keys"].values())}
                                                              for m, r in runs.items()}, "compare": rows},
                                                    indent=1, default=str))  # fmt: skip
    print(report(runs, rows, out, args))


if __name__ == "__main__":
    main()
