"""benchmarks/bench_moe.py on the CPU with tiny sizes: the script's logic (contenders, the eager-timed HF
loop, the tuned column from a table, the e2e model variants and parity), not its speed."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_op_and_e2e_parts_run_on_the_cpu(bench, tmp_path):
    args = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--tokens", "1,16", "--reps", "2", "--layers", "1",
            "--e2e-reps", "1", "--sweep", "2"]  # fmt: skip
    bench.main(args)
    rows = json.loads((tmp_path / "moe_op.json").read_text())
    assert [(r["model"], r["T"]) for r in rows] == [(m, t) for m in bench.TINY_MODELS for t in (1, 16)]
    for r in rows:
        for col in ("gemmtune_us", "tuned_us", "grouped_mm_base_us", "hf_best_us", "hf_eager_us_eager_timed"):
            assert r[col] > 0, (col, r)
        assert r["err_gemmtune"] < 1e-4 and r["tuned_solution"]
    e2e = json.loads((tmp_path / "moe_e2e.json").read_text())
    assert e2e["meta"]["hf_default_experts"] in ("grouped_mm", "eager")
    assert [r["what"].split(" ctx")[0] for r in e2e["rows"]] == ["decode b=1", "decode b=8", "prefill 48 tokens"]
    for r in e2e["rows"]:
        assert {f"{n}_ms" for n in ("hf_eager", "hf_grouped_mm", "hf_batched_mm", "gemmtune")} <= set(r)
        assert r["x_hf_best"] > 0 and r["x_hf_default"] > 0 and r["hf_best"].startswith("hf_")
    diff = float(e2e["meta"]["parity"].split("max |diff| ")[1].split()[0])
    assert diff < 1e-4  # fp32 on the CPU: optimize() computes the same logits as the HF eager loop
    md = (tmp_path / "moe.md").read_text()
    assert "HF eager loop us (eager)" in md and "not a speed claim" in md


def test_tuned_column_comes_from_the_table(bench, tmp_path):
    from gemmtune.device import identity
    from gemmtune.families import fmoe
    from gemmtune.tuner.output import result_row, write_row
    from gemmtune.tuner.search import TuneOptions, tune_shape

    H, inter, E, topk = bench.TINY_MODELS["tiny-mixtral"]
    key = fmoe.MoeKey(1, H, inter, E, topk, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    cpu = torch.device("cpu")
    res = tune_shape(key, cpu, TuneOptions(reps=5, screen_reps=5, verify_range=False), family="fmoe")
    table = tmp_path / "tuned_fmoe.csv"
    write_row(str(table), result_row(res, identity(cpu), fmoe.FAMILY))
    out = tmp_path / "out"
    bench.main(["--device", "cpu", "--tiny", "--part", "op", "--models", "tiny-mixtral", "--tokens", "1,16",
                "--reps", "2", "--table", str(table), "--out", str(out)])  # fmt: skip
    (one, sixteen) = json.loads((out / "moe_op.json").read_text())
    assert one["tuned_solution"] == res.winner.name  # the row's solution
    assert sixteen["tuned_solution"].startswith("no row")  # T=16 has no row: the default runs


def test_stage1_split_ab_contender_is_the_default_with_stage1_unsplit(bench):
    from gemmtune.backends.fmoe import triton as mtr
    from gemmtune.families.fmoe import MoeKey, split_name

    c1, c2 = mtr.heuristic_configs(MoeKey(1, 7168, 256, 256, 8))
    assert c1.split_k > 1
    ab = bench.unsplit_stage1(mtr.solution_of(c1, c2))
    n1, n2 = split_name(ab.kernel_name)
    assert n1 == c1.name.replace(f"_sk{c1.split_k}_", "_sk1_") and n2 == c2.name and ab.libtype == "triton"
    unsplit = mtr.heuristic_configs(MoeKey(16, 7168, 256, 256, 8))
    assert unsplit[0].split_k == 1 and bench.unsplit_stage1(mtr.solution_of(*unsplit)) is None
    assert bench.unsplit_stage1(mtr.GROUPED_MM_GLUED) is None
    row = {"model": "E256", "T": 1, "gemmtune_us": 40.0, "unsplit1_us": 60.0, "roof_us": 30.0, "default_solution": "x"}
    md = bench.summarize_stage1_split([row, {**row, "unsplit1_us": None}])
    assert "| E256 | 1 | 40.0 | 60.0 | 1.50 | 75% | 50% | x |" in md and bench.summarize_stage1_split([]) == []
