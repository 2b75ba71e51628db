"""How precise is one timing run (tuner/timing.py)? A/A runs: the same kernel captured as several
contenders of one run, and the same pair re-timed in fresh runs (fresh inputs, fresh graphs).

    python benchmarks/experiments/exp_timing_noise.py --models llama-3-8b:1 --ms 1,16,128,1024 --runs 3 --copies 4

For each key, each run times `copies` separately captured graphs of the vendor default (F.linear) on
the same inputs. The spread between copies of one run is what a run cannot resolve; if it changes from
run to run but more reps do not shrink it, it belongs to the capture, not to the replays. Writes
OUT/timing_noise.json and prints per-key spreads (max/min - 1 over the copies of a run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: suites, bench_skinny

from exp_tune_speed import model_keys  # noqa: E402
from suites import find_models_dir  # noqa: E402

from gemmtune import backends, families  # noqa: E402
from gemmtune.tuner.model_shapes import parse_nsets  # noqa: E402
from gemmtune.tuner.search import shape_seed  # noqa: E402
from gemmtune.tuner.timing import bench_gemm, make_inputs  # noqa: E402


def spread(times: list[float]) -> float:
    return max(times) / min(times) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3-8b:1")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--ms", default="1,16,128,1024")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", default="20,60")
    ap.add_argument("--out", default="timing_noise_out")
    args = ap.parse_args()
    device = torch.device("cuda")
    fam = families.get("a16w16")
    torch_backend = backends.get("torch", fam.name)
    layers = set(args.layers.split(",")) if args.layers else None
    keys = model_keys(find_models_dir(args.models_dir), args.models.split(","), parse_nsets(args.ms), layers)
    rows = []
    for key in keys:
        sol = torch_backend.default_solution(key, device)
        for reps in [int(r) for r in args.reps.split(",")]:
            runs = []
            for run in range(args.runs):
                inputs = make_inputs(key, device, seed=shape_seed(key, 100 + run, fam), family=fam)
                runners = {f"copy{i}": torch_backend.make_runner(sol, key, device) for i in range(args.copies)}
                t = bench_gemm(key, runners, device, reps=reps, inputs=inputs, family=fam)
                runs.append([t[n] for n in runners])
                del inputs
            within = [spread(r) for r in runs]
            means = [statistics.fmean(r) for r in runs]
            rows.append({"key": fam.describe(key), "reps": reps, "runs": runs, "within_spread": within,
                         "between_runs_spread": spread(means)})  # fmt: skip
            print(f"{fam.describe(key):40s} reps={reps:3d} within-run spread "
                  + " ".join(f"{100 * w:.2f}%" for w in within)
                  + f"  run means spread {100 * spread(means):.2f}%", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timing_noise.json").write_text(json.dumps(rows, indent=1))
    for reps in sorted({r["reps"] for r in rows}):
        w = [x for r in rows if r["reps"] == reps for x in r["within_spread"]]
        print(f"reps={reps}: within-run A/A spread over {len(w)} runs: median {100 * statistics.median(w):.2f}%, "
              f"max {100 * max(w):.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
