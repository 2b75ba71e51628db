"""gemmtune.profile / `gemmtune profile` / `gemmtune bench-model`: categories that sum to the total,
the GEMM table with its dispatch status, the outputs on disk; categorization rules; the fused ops as
custom ops under torch.compile (CPU here, inductor on a GPU)."""

from __future__ import annotations

import copy
import json
import os
import sys
import textwrap

import pytest
import torch
from cli_cases import TINY_BENCH_MODEL, bench_model_report
from click.testing import CliRunner

pytest.importorskip("transformers")

import gemmtune  # noqa: E402
from gemmtune.cli.main import cli  # noqa: E402
from gemmtune.configs import TUNED_COLUMNS  # noqa: E402
from gemmtune.device import identity  # noqa: E402
from gemmtune.kernels import activations, norms, rope  # noqa: E402
from gemmtune.kernels.compile_mode import compile_ops, parse  # noqa: E402
from gemmtune.profiling import breakdown, gemms  # noqa: E402
from gemmtune.profiling.build import build_model  # noqa: E402
from gemmtune.profiling.categorize import Frame, chain_category, kernel_name_category  # noqa: E402

SEQ = 8
# tiny-llama: hidden 64, 4 heads x 16, 2 KV heads, intermediate 128, vocab 256
STOCK_SHAPES = {(SEQ, 64, 64), (SEQ, 32, 64), (SEQ, 128, 64), (SEQ, 64, 128), (1, 256, 64)}
FUSED_SHAPES = {(SEQ, 128, 64), (SEQ, 64, 64), (SEQ, 256, 64), (SEQ, 64, 128), (1, 256, 64)}


@pytest.fixture(scope="module")
def models():
    stock, _ = build_model("tiny-llama", layers=2)
    opt = copy.deepcopy(stock)
    gemmtune.optimize(opt)
    return stock, opt


def prefill(model):
    ids = torch.arange(SEQ).remainder(256)[None]

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return run


def shapes_of(prof):
    """(M, N, K) of the linear layers' GEMMs (the rotary embedding's K=1 outer product left out)."""
    return {(r.call.M, r.call.N, r.call.K) for r in prof.breakdown.gemms if r.call is not None and r.call.K > 1}


def check_outputs(out_dir, data):
    total = data["total_ms"]
    assert total > 0
    assert abs(sum(c["ms"] for c in data["categories"].values()) - total) <= 0.01 * total
    assert (out_dir / "profile.png").stat().st_size > 0
    assert (out_dir / "trace.json").stat().st_size > 0


# ---- gemmtune.profile ---------------------------------------------------------------------------
def test_profile_categories_sum_outputs_and_gemm_table(models, tmp_path):
    stock, _ = models
    prof = gemmtune.profile(prefill(stock), warmup=1, iters=2, device="cpu", trace=str(tmp_path / "trace.json"))
    prof.save(str(tmp_path))
    data = json.loads((tmp_path / "profile.json").read_text())
    check_outputs(tmp_path, data)
    assert data["mode"] == "cpu" and data["steps"] == 2
    assert shapes_of(prof) == STOCK_SHAPES
    assert all(r.status == "default" for r in prof.breakdown.gemms if r.call is not None and r.call.K > 1)
    assert prof.categories["gemm"] > 0 and prof.categories["attention"] > 0
    calls = {(r.call.M, r.call.N): r.calls for r in prof.breakdown.gemms if r.call is not None}
    assert calls[(SEQ, 32)] == 4  # k and v of 2 layers
    assert calls[(1, 256)] == 1  # lm_head on the last token
    text = prof.table()
    assert "GEMM" in text and "host (outside ops)" in text and "default" in text


def _table(tmp_path, rows):
    ident = identity(torch.device("cpu"))
    lines = [",".join([*TUNED_COLUMNS, "M_lo", "M_hi"])]
    for m, n, k in rows:  # each row verified on M 1..m: it answers the smaller Ms too
        lines.append(f"{ident.gfx},{ident.cu_num},{m},{n},{k},False,torch.float32,torch.float32,False,False,"
                     f"torch,0,0,1.0,native,0.0,1.0,1.0,1,{m}")  # fmt: skip
    path = tmp_path / "tuned.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_gemm_status_tuned_untuned_m_and_default(models, tmp_path):
    _, opt = models
    gemmtune.set_config(_table(tmp_path, [(SEQ, 256, 64), (4 * SEQ, 128, 64)]))
    prof = gemmtune.profile(prefill(opt), warmup=1, iters=1, device="cpu")
    assert shapes_of(prof) == FUSED_SHAPES
    status = {(r.call.M, r.call.N, r.call.K): r for r in prof.breakdown.gemms if r.call is not None}
    assert status[(SEQ, 256, 64)].status == "tuned"
    assert status[(SEQ, 128, 64)].status == "untuned-M" and f"M={4 * SEQ}" in status[(SEQ, 128, 64)].detail
    assert status[(SEQ, 64, 128)].status == "default"
    # eager gemmtune.gemm calls are annotated with their key, and the runner cache is put back after
    assert {r.call.op for r in prof.breakdown.gemms if r.call is not None and r.call.K > 1} == {"gemmtune.gemm"}
    assert "runner_for" not in gemmtune.get_dispatcher().__dict__


def test_profile_rejects_bad_arguments():
    with pytest.raises(ValueError, match="iters"):
        gemmtune.profile(lambda: None, iters=0)


# ---- the CLI ------------------------------------------------------------------------------------
SCRIPT = """
    import sys
    import torch
    import gemmtune.profiling
    from gemmtune.profiling.build import build_model

    model, _ = build_model("tiny-llama", layers=1)
    ids = torch.arange(8)[None]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # warm-up, outside the steps
        for _ in range(2):
            with {step}:
                model(input_ids=ids, use_cache=False)
    sys.exit({code})
"""


@pytest.mark.parametrize("marked", [True, False])
def test_cli_profile_runs_a_script(tmp_path, marked):
    script = tmp_path / "tiny_script.py"
    step = "gemmtune.profiling.step()" if marked else "torch.no_grad()"
    script.write_text(textwrap.dedent(SCRIPT.format(step=step, code=3 if marked else 0)))
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", "-o", str(out), "--device", "cpu", "--", sys.executable, str(script)])
    assert res.exit_code == (3 if marked else 0), res.output
    data = json.loads((out / "profile.json").read_text())
    check_outputs(out, data)
    assert data["steps"] == (2 if marked else 1)
    assert "GEMMs" in res.output and data["gemms"]


def test_cli_profile_writes_the_profile_of_a_failing_script(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\ntorch.ones(4, 4) @ torch.ones(4, 4)\nraise RuntimeError('boom')\n")
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", "-o", str(out), "--device", "cpu", "--", "python", str(script)])
    assert res.exit_code == 1
    data = json.loads((out / "profile.json").read_text())
    assert [(g["M"], g["N"], g["K"]) for g in data["gemms"]] == [(4, 4, 4)]
    assert "the script exited with status 1: this profile covers what ran before" in data["notes"]


def test_cli_profile_writes_nothing_for_a_script_that_raised_before_any_op(tmp_path):
    script = tmp_path / "fails_at_once.py"
    script.write_text("raise RuntimeError('boom')\n")
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", "-o", str(out), "--device", "cpu", "--", "python", str(script)])
    assert res.exit_code == 1 and "before running any op: no profile written" in res.output, res.output
    assert not out.exists() or not list(out.iterdir())  # not even the trace


def test_cli_profile_says_a_missing_script_is_missing(tmp_path):
    res = CliRunner().invoke(cli, ["profile", "-o", str(tmp_path / "p"), "--", "python", str(tmp_path / "nope.py")])
    assert res.exit_code != 0 and "no such file" in res.output and "nope.py" in res.output, res.output
    assert "expected `python script.py" not in res.output


def test_profiler_start_and_stop_lines_are_dropped_and_others_kept(capfd):
    from gemmtune.profiling import collect

    with collect._without_kineto_chatter():
        os.write(2, b"USDT:2026-12-02 01:23:44 13346:13346 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-12-02 01:25:05 15049:15049 SyncActivityProfilerHandler.cpp:51] Completed\n")
        os.write(2, b"a warning worth reading\n")
    gemmtune.profile(lambda: torch.ones(8, 8) @ torch.ones(8, 8), warmup=0, iters=1, device="cpu")
    err = capfd.readouterr().err
    assert "a warning worth reading" in err
    assert "USDT:" not in err and "STAGE:" not in err and "SyncActivityProfilerHandler" not in err, err


def test_cli_profile_needs_a_python_script(tmp_path):
    res = CliRunner().invoke(cli, ["profile", "-o", str(tmp_path), "--", "ls", "-l"])
    assert res.exit_code != 0 and "Python script" in res.output


# The default contenders compile the model twice: the default tier runs the two eager ones.
@pytest.mark.parametrize(
    "contenders",
    [("stock", "optimize"), pytest.param(None, marks=pytest.mark.slow)],
    ids=["eager", "default-contenders"],
)
def test_cli_bench_model_cpu_end_to_end(tmp_path, contenders):
    out = tmp_path / "bm"
    flags = ("--contenders", ",".join(contenders)) if contenders else ()
    data = bench_model_report(out, "--reps", "2", *flags)
    assert [s["name"] for s in data["scenarios"]] == ["prefill 1x16", "decode b=1 ctx=16 (eager, CPU)"]
    for sc in data["scenarios"]:
        assert set(sc["contenders"]) == set(contenders or ("stock", "optimize", "compile", "compile+optimize"))
        for name, cell in sc["contenders"].items():
            assert cell["ms"] > 0, (sc["name"], name)
            cats = cell["profile"]["categories"]
            assert (
                abs(sum(c["ms"] for c in cats.values()) - cell["profile"]["total_ms"])
                <= 0.01 * cell["profile"]["total_ms"]
            )
    assert "argmax equal" in data["parity"]["optimize"]
    for name, p in data["decode_parity"].items():  # teacher-forced decode, 16 steps by default
        assert p["ok"] and len(p["step_rel_err"]) == 17 and all(p["greedy_equal"]), (name, p)
    md = (out / "report.md").read_text()
    assert "| prefill 1x16 |" in md and "Time by category" in md and "Decode parity" in md
    # the CPU report says what its times are and does not describe CUDA-graph replays
    assert "measures the harness, not a speedup" in md and "Decode rows profile eager steps" in md
    assert "CUDA-graph" not in md
    assert (out / "report.png").stat().st_size > 0


def test_cli_bench_model_quantize_cpu(tmp_path):
    """--quantize adds the quantized copy to the same interleaved run and reports what runs 8-bit, each
    8-bit GEMM's error vs the 16-bit GEMM and the logits' error vs stock."""
    out = tmp_path / "bmq"
    data = bench_model_report(out, "--reps", "2", "--contenders", "stock,optimize", "--quantize", "fp8", "--no-profile")
    for sc in data["scenarios"]:
        assert set(sc["contenders"]) == {"stock", "optimize", "quantize"} and sc["contenders"]["quantize"]["ms"] > 0
    q = data["quantize"]
    assert q["mode"] == "fp8" and q["logits_ref"] == "stock"
    # one layer: qkv, o, gate_up, down; e4m3 on both operands: ~3.5% a GEMM (measured 3.4-3.7%)
    assert [p.rsplit(".", 1)[1] for p, _, _ in q["gemm_errors"]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert all(0 < e < 0.06 for _, _, e in q["gemm_errors"])
    # the logits carry the 16-bit embedding through the residual and one layer's 8-bit error: measured 0.017
    assert 0 < q["logits_rel_err"] < 0.06
    md = (out / "report.md").read_text()
    assert "## optimize(quantize='fp8'): what runs 8-bit" in md and "lm_head stays 16-bit" in md
    assert "| model.layers.*.self_attn.qkv_proj | 128x64 | 1 |" in md and "relative error vs stock" in md
    assert "rel err" in data["parity"]["quantize"] and "vs optimize() (16-bit) rel err" in data["parity"]["quantize"]


def test_cli_bench_model_decode_parity_failure_exits_nonzero(tmp_path):
    """A contender whose decode ignores its KV cache (the test hook) fails parity: the run stops before
    timing and exits 1; --keep-going times it anyway, marks its rows and exits 0."""
    base = [*TINY_BENCH_MODEL, "--reps", "1", "--contenders", "stock,optimize", "--no-profile",
            "--decode-steps", "4", "--test-break", "optimize"]  # fmt: skip
    res = CliRunner().invoke(cli, [*base, "-o", str(tmp_path / "stop")])
    assert res.exit_code == 1, res.output
    data = json.loads((tmp_path / "stop" / "report.json").read_text())
    assert data["decode_parity"]["stock"]["ok"] and not data["decode_parity"]["optimize"]["ok"]
    assert data["scenarios"] == [] and any("decode parity optimize" in e for e in data["errors"])
    md = (tmp_path / "stop" / "report.md").read_text()
    assert "Nothing was timed: the run stopped before timing" in md and "| scenario |" not in md
    assert not (tmp_path / "stop" / "report.png").exists() and "no report.png: nothing was timed" in res.output
    res = CliRunner().invoke(cli, [*base, "--keep-going", "-o", str(tmp_path / "go")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "go" / "report.md").read_text()
    assert "PARITY FAIL" in md and "| optimize | stock | FAILED |" in md


def test_cli_bench_model_judges_the_8bit_contender_against_its_quantized_reference(tmp_path):
    """The 8-bit contender's decode is compared with the same quantized model on its reference linears
    (error vs stock reported beside it); one that ignores its KV cache fails that comparison."""
    base = [*TINY_BENCH_MODEL, "--reps", "1", "--contenders", "stock,quantize", "--quantize", "fp8",
            "--no-profile", "--decode-steps", "4"]  # fmt: skip
    res = CliRunner().invoke(cli, [*base, "--keep-going", "-o", str(tmp_path / "ok")])
    assert res.exit_code == 0, res.output
    q = json.loads((tmp_path / "ok" / "report.json").read_text())["decode_parity"]["quantize"]
    assert q["ok"] and q["reference"] == "quantized reference" and max(q["step_rel_err"]) < 1e-4
    assert max(q["step_rel_err_vs_stock"]) > max(q["step_rel_err"])  # the quantization's own error, reported
    assert q["floor"] == 0 and q["tolerance"] == 0.05  # fp32: the bf16-matmul twin is the fp32 math itself
    res = CliRunner().invoke(cli, [*base, "--dtype", "bfloat16", "-o", str(tmp_path / "bf16")])
    assert res.exit_code == 0, res.output
    q = json.loads((tmp_path / "bf16" / "report.json").read_text())["decode_parity"]["quantize"]
    assert q["floor"] > 0 and q["tolerance"] == max(0.05, 1.5 * q["floor"])  # the twin rounds differently
    assert "(floor " in (tmp_path / "bf16" / "report.md").read_text()
    res = CliRunner().invoke(cli, [*base, "--test-break", "quantize", "-o", str(tmp_path / "broken")])
    assert res.exit_code == 1, res.output
    q = json.loads((tmp_path / "broken" / "report.json").read_text())["decode_parity"]["quantize"]
    assert not q["ok"] and (q["failure"] or max(q["step_rel_err"]) > q["tolerance"])


def test_cli_bench_model_rejects_bad_input(tmp_path):
    res = CliRunner().invoke(cli, ["bench-model", "--device", "cpu", "--model", "no-such-model", "-o", str(tmp_path)])
    assert res.exit_code != 0 and "no-such-model" in res.output
    res = CliRunner().invoke(cli, ["bench-model", "--device", "cpu", "--model", "tiny-llama", "--contenders", "fast"])
    assert res.exit_code != 0 and "fast" in res.output
    res = CliRunner().invoke(cli, ["bench-model", "--device", "cpu", "--model", "tiny-llama", "--contenders",
                                   "stock,quantize"])  # fmt: skip
    assert res.exit_code != 0 and "need a quantize mode" in res.output
    res = CliRunner().invoke(cli, ["bench-model", "--device", "cpu", "--model", "tiny-llama", "--quantize", "fp4"])
    assert res.exit_code != 0 and "fp4" in res.output


# ---- categorization -----------------------------------------------------------------------------
def F(name, *shapes):
    return Frame(name, tuple(shapes))


@pytest.mark.parametrize(
    "chain, want",
    [
        ([F("aten::mm"), F("aten::linear"), F("gemmtune.step")], "gemm"),
        ([F("aten::bmm"), F("aten::_scaled_dot_product_attention_math"), F("aten::scaled_dot_product_attention")],
         "attention"),
        ([F("aten::bmm"), F("aten::matmul", (2, 4, 8, 16), (2, 4, 16, 8))], "attention"),  # eager q @ k^T
        ([F("aten::bmm"), F("aten::matmul", (1, 8, 1), (1, 1, 16))], "gemm"),  # rotary inv_freq x positions
        ([F("aten::copy_"), F("aten::_to_copy"), F("aten::to")], "elementwise"),  # a dtype cast
        ([F("aten::copy_"), F("aten::contiguous")], "memory"),
        ([F("aten::index_copy_")], "memory"),
        ([F("aten::empty"), F("gemmtune::rmsnorm")], "elementwise"),
        ([F("aten::view"), F("gemmtune.step")], None),
        ([F("aten::mm"), F("gemmtune.gemm M=1 N=2 K=3 bias=0 torch.float32->torch.float32")], "gemm"),
    ],
)  # fmt: skip
def test_chain_category(chain, want):
    assert chain_category(chain) == want


@pytest.mark.parametrize(
    "name, want",
    [
        ("triton_poi_fused_add_mul_silu_0", "elementwise"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "elementwise"),
        ("triton_poi_fused_clone_2", "memory"),
        ("triton_tem_fused_mm_3", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("_rmsnorm_kernel", "elementwise"),
        ("_skinny_kernel", "gemm"),
        ("Memcpy DtoD (Device -> Device)", "memory"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "memory"),
        ("some_custom_thing", None),
    ],
)
def test_kernel_name_category(name, want):
    assert kernel_name_category(name) == want


@pytest.mark.parametrize(
    "frame, want",
    [
        (Frame("aten::linear", ((2, 8, 64), (32, 64), (32,)), ("float", "float", "float")), (16, 32, 64, True, 1)),
        (Frame("aten::linear", ((8, 64), (32, 64), ()), ("c10::BFloat16", "c10::BFloat16", "")), (8, 32, 64, False, 1)),
        (Frame("aten::addmm", ((32,), (8, 64), (64, 32)), ("float",) * 3), (8, 32, 64, True, 1)),
        (Frame("aten::mm", ((8, 64), (64, 32)), ("float",) * 2), (8, 32, 64, False, 1)),
        (Frame("aten::matmul", ((2, 4, 8, 16), (2, 4, 16, 8)), ("float",) * 2), (8, 8, 16, False, 8)),
        (Frame("aten::bmm", ((3, 8, 64), (3, 64, 32)), ("float",) * 2), (8, 32, 64, False, 3)),
        (Frame("gemmtune::gemm", ((5, 64), (32, 64), (), ()), ("c10::Half",) * 2), (5, 32, 64, False, 1)),
    ],
)  # fmt: skip
def test_gemm_call_from_recorded_shapes(frame, want):
    c = gemms.call_of(frame)
    assert (c.M, c.N, c.K, c.bias, c.batch) == want


def test_gemm_label_round_trips():
    key = gemmtune.GemmKey(7, 96, 64, True, torch.bfloat16, torch.float32)
    c = gemms.call_of(Frame(gemms.label(key)))
    assert (c.M, c.N, c.K, c.bias, c.dtype, c.outdtype) == (7, 96, 64, True, torch.bfloat16, torch.float32)
    assert gemms.status(c, "cpu")[0] == "default"


class _Ev:
    """A Kineto event as torch.profiler hands them out (times in us here, ns there)."""

    def __init__(self, name, start, end, *, cuda=False, corr=0, linked=0, thread=1, shapes=(), dtypes=(), ann=False):
        times = dict(start=int(start * 1000), end=int(end * 1000))
        self._v = dict(name=name, cuda=cuda, corr=corr, linked=linked, thread=thread, ann=ann, **times,
                       shapes=[list(x) for x in shapes], dtypes=list(dtypes))  # fmt: skip

    def name(self):
        return self._v["name"]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._v["cuda"] else torch.autograd.DeviceType.CPU

    def start_ns(self):
        return self._v["start"]

    def end_ns(self):
        return self._v["end"]

    def correlation_id(self):
        return self._v["corr"]

    def linked_correlation_id(self):
        return self._v["linked"]

    def start_thread_id(self):
        return self._v["thread"]

    def shapes(self):
        return self._v["shapes"]

    def dtypes(self):
        return self._v["dtypes"]

    def is_async(self):
        return False

    def is_user_annotation(self):
        return self._v["ann"]


class _Prof:
    def __init__(self, events):
        results = type("R", (), {"events": lambda self: events, "trace_start_ns": lambda self: 0})()
        self.profiler = type("P", (), {"kineto_results": results})()


def test_cuda_timeline_from_kineto_events():
    """The CUDA path without a GPU: launch sites through runtime calls, graph kernels by hint and
    name, overlapping streams counted once, GPU-side annotation copies ignored, idle = the rest."""
    from gemmtune.profiling.timeline import build

    bf = ("c10::BFloat16",) * 3
    ev = [
        _Ev("gemmtune.step", 0, 100, corr=1, ann=True),
        _Ev("aten::linear", 5, 20, corr=2, shapes=((4, 64), (128, 64), (128,)), dtypes=bf),
        _Ev("aten::addmm", 6, 19, corr=3, shapes=((128,), (4, 64), (64, 128)), dtypes=bf),
        _Ev("cudaLaunchKernel", 10, 12, corr=900, linked=3, thread=77),  # the runtime call: another tid
        _Ev("nvjet_tst_x", 30, 50, cuda=True, corr=900, linked=3),  # GEMM kernel, site aten::addmm
        _Ev("aten::add", 21, 25, corr=4),
        _Ev("cuLaunchKernel", 22, 23, corr=901, linked=4, thread=77),
        _Ev("my_fused_kernel", 50, 60, cuda=True, corr=901, linked=4),  # unknown name, site aten::add
        _Ev("my_fused_kernel", 55, 65, cuda=True, corr=902),  # overlaps; no site: hint from the one above
        _Ev("cudaGraphLaunch", 26, 27, corr=903, linked=0, thread=77),
        _Ev("_rmsnorm_kernel", 70, 80, cuda=True, corr=903),  # graph replay: by name
        _Ev("mystery", 80, 85, cuda=True, corr=903),  # unknown: other, listed
        _Ev("Memcpy DtoD (Device -> Device)", 85, 90, cuda=True, corr=904),
        _Ev("gemmtune.step", 0, 100, cuda=True, ann=True),  # GPU-side copy of the range
    ]
    bd = breakdown.analyze(build(_Prof(ev)))
    assert bd.mode == "cuda" and bd.total_ms == pytest.approx(0.1)
    c = {k: v * 1e3 for k, v in bd.categories.items()}  # us
    assert c["gemm"] == pytest.approx(20) and c["elementwise"] == pytest.approx(15 + 10)
    assert c["other"] == pytest.approx(5) and c["memory"] == pytest.approx(5)
    assert c["idle"] == pytest.approx(100 - 20 - 15 - 10 - 5 - 5)
    how = {(i.name, i.category): i.how for i in bd.items}
    assert how[("my_fused_kernel", "elementwise")] == "site"  # the site-less one joined it as "hint"
    assert how[("_rmsnorm_kernel", "elementwise")] == "name" and how[("mystery", "other")] == "unknown"
    (row,) = bd.gemms
    assert (row.call.op, row.call.M, row.call.N, row.call.K, row.call.bias) == ("aten::linear", 4, 128, 64, True)
    assert row.call.dtype == torch.bfloat16 and row.calls == 1 and row.ms == pytest.approx(0.02)


def test_overlapping_kernels_split_their_time():
    shares = breakdown._split_busy([(0.0, 10.0), (5.0, 15.0), (20.0, 21.0)])
    assert shares == pytest.approx([7.5, 7.5, 1.0])


# ---- custom ops under torch.compile --------------------------------------------------------------
def test_compile_ops_spec():
    assert parse("op") == dict.fromkeys(("rmsnorm", "add_rmsnorm", "act_mul", "rope"), "op")
    assert parse("ref,rope=op")["rope"] == "op" and parse("ref,rope=op")["rmsnorm"] == "ref"
    with pytest.raises(ValueError, match="fast"):
        parse("fast")
    with pytest.raises(ValueError, match="norm=op"):
        parse("norm=op")


def _inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    qkv = r(2, 3, 8 * 16)
    return dict(
        x=r(2, 3, 64), res=r(2, 3, 64), w=r(64), gu=r(2, 3, 96),
        q=qkv[..., :64].view(2, 3, 4, 16), k=qkv[..., 64:96].view(2, 3, 2, 16), cos=r(1, 3, 16), sin=r(1, 3, 16),
    )  # fmt: skip


def _fused(x, res, w, gu, q, k, cos, sin):
    a = norms.rmsnorm(x, w, 1e-6)
    b, s = norms.add_rmsnorm(x, res, w, 1e-6, offset=1.0, cast_before_weight=False)
    c = activations.silu_mul(gu)
    qo, ko = rope.rope(q, k, cos, sin)
    return a, b, s, c, qo, ko


def test_custom_ops_pass_opcheck():
    t = _inputs()
    torch.library.opcheck(torch.ops.gemmtune.rmsnorm.default, (t["x"], t["w"], 1e-6, 0.0, True))
    torch.library.opcheck(torch.ops.gemmtune.add_rmsnorm.default, (t["x"], t["res"], t["w"], 1e-6, 1.0, False))
    torch.library.opcheck(torch.ops.gemmtune.act_mul.default, (t["gu"], "gelu_tanh"))
    torch.library.opcheck(torch.ops.gemmtune.rope.default, (t["q"], t["k"], t["cos"], t["sin"]))


@pytest.mark.parametrize("mode", ["ref", "op"])
def test_fused_ops_compile_fullgraph_in_both_modes(mode):
    t = _inputs()
    want = _fused(**t)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with compile_ops(mode):
        got = torch.compile(_fused, fullgraph=True, backend=backend)(**t)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert graphs[0].code.count("gemmtune.") == (4 if mode == "op" else 0)


@pytest.fixture(scope="module")
def gpu_models():
    """The tiny stock model and its optimized twin on the GPU, built once for the module's GPU tests
    (torch.compile wraps the model, and profiling only runs it: neither changes it)."""
    stock, _ = build_model("tiny-llama", layers=2, device="cuda")
    opt = copy.deepcopy(stock)
    gemmtune.optimize(opt)
    return stock, opt


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ref", "op"])
def test_fused_ops_under_inductor_match_eager_gpu(gpu, mode):
    t = _inputs("cuda", torch.bfloat16)
    want = _fused(**t)
    torch._dynamo.reset()
    with compile_ops(mode):
        got = torch.compile(_fused, fullgraph=True)(**t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        if mode == "op":  # the same kernel runs inside the custom op
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [pytest.param("ref", marks=pytest.mark.slow), "op"])
def test_optimized_model_compiles_fullgraph_gpu(gpu_models, mode):
    stock, opt = gpu_models
    ids = torch.arange(16, device="cuda")[None]
    with torch.no_grad():
        want = stock(input_ids=ids, use_cache=False).logits.float()
        torch._dynamo.reset()
        with compile_ops(mode):
            got = torch.compile(opt, fullgraph=True)(input_ids=ids, use_cache=False).logits.float()
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_profile_on_gpu_sites_and_graph_hints(gpu_models):
    _, opt = gpu_models
    ids = torch.arange(SEQ, device="cuda")[None]

    def step():
        with torch.no_grad():
            opt(input_ids=ids, use_cache=False, logits_to_keep=1)

    eager = gemmtune.profile(step, warmup=2, iters=3)
    assert eager.mode == "cuda"
    assert abs(sum(eager.categories.values()) - eager.total_ms) <= 0.01 * eager.total_ms
    assert shapes_of(eager) == FUSED_SHAPES
    assert any(i.name == "_rmsnorm_kernel" and i.category == "elementwise" for i in eager.breakdown.items)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        step()
    replay = gemmtune.profile(g.replay, iters=3, hints=eager.kernel_categories(), annotate=False)
    assert replay.categories["gemm"] > 0 and replay.categories["elementwise"] > 0


def test_a_gemm_custom_op_without_readable_shapes_gives_way_to_the_gemm_inside():
    from gemmtune.profiling.breakdown import _outer_gemm
    from gemmtune.profiling.timeline import Node

    inner = Node("aten::addmm", 0, 1, 0, 0, ((32,), (8, 64), (64, 32)), ("float",) * 3)
    outer = Node("gemmtune::fused_moe", 0, 1, 0, 0, ((8, 64),), ("float",))
    assert _outer_gemm([inner, outer]) is inner  # innermost first, as launch chains are
    assert _outer_gemm([outer]) is outer  # nothing readable: still attributed to the GEMM op


@pytest.mark.parametrize(("layers", "dense"), [(None, 3), (61, 3), (8, 1), (4, 1), (2, 1), (1, 1)])
def test_a_cut_deepseek_keeps_its_share_of_dense_layers(layers, dense):
    """DeepSeek-V3 (3 dense, 58 MoE layers) cut to a few layers stays mostly MoE: its first 4 layers alone
    would be 3 dense and 1 MoE."""
    from gemmtune.profiling.build import architecture

    cfg, _ = architecture("deepseek-v3", layers)
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (layers or 61, dense)


def test_a_cut_model_names_its_dense_and_moe_layers():
    from gemmtune.profiling.build import architecture

    cfg, _ = architecture("deepseek-v3", 4)
    small = {**cfg, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_attention_heads": 4,
             "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
             "qk_nope_head_dim": 8, "v_head_dim": 8, "vocab_size": 128}  # fmt: skip
    model, desc = build_model(small)
    assert "4 layers (1 dense, 3 MoE)" in desc, desc
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["DeepseekV3MLP", "DeepseekV3MoE", "DeepseekV3MoE", "DeepseekV3MoE"], kinds


def test_bench_model_times_again_while_rounds_disagree_and_marks_what_stays_busy():
    from gemmtune.profiling import bench_model

    quiet = {"stock": [10.0, 10.2, 10.1], "optimize": [5.0, 5.1, 5.0]}
    noisy = {"stock": [10.0, 30.0, 10.1], "optimize": [5.0, 5.1, 5.0]}
    runs = iter([noisy, quiet, noisy])
    times, busy = bench_model.quietest_rounds(lambda: next(runs))
    assert times is quiet and busy == {}  # re-measured once, the quiet run kept whole
    worse = {"stock": [10.0, 50.0, 10.1], "optimize": [5.0, 5.1, 5.0]}
    runs = iter([worse, noisy, worse])
    times, busy = bench_model.quietest_rounds(lambda: next(runs))
    assert times is noisy and list(busy) == ["stock"] and "10-30 ms" in busy["stock"], busy
    assert next(runs, None) is None  # 1 + REMEASURE runs, no more


def test_model_description_counts_parameters_in_a_readable_unit():
    from gemmtune.profiling.build import parameter_count

    assert [parameter_count(n) for n in (1_912_345_678, 8_450_000, 37_100, 999_999, 12)] == [
        "1.91 B", "8.45 M", "37.1 k", "1 M", "12"]  # fmt: skip
