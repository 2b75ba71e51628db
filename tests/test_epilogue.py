"""The epilogue family (families/epilogue.py), its ops (gemm_bias, gemm_gelu, gemm_relu, cutlass_gemm,
gemm_epilogue) and backends (torch unfused / _addmm_activation, Triton fused epilogue).

CPU: every op against an fp32 reference on odd shapes, every act, bias / no bias, alpha, beta with a C
of each broadcast kind, both weight layouts; beta == 0 ignores a NaN C; bad input errors; tables of the
family load, are detected by header and dispatch; the custom op under opcheck. Interpreter (subprocess,
TRITON_INTERPRET=1): the Triton epilogue in every kernel path (direct, split-K reduce / fix-up,
persistent, TMA) with NaN-poisoned outputs. GPU (marked gpu): bf16 vs fp32, CUDA-graph replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiers import SWEEP_TIERS, tiered

ACTS = ("none", "relu", "gelu", "gelu_tanh")
C_SHAPES = {"full": lambda s: s, "row": lambda s: s[-1:], "col": lambda s: (*s[:-1], 1), "scalar": lambda s: ()}


def _rel_err(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _ref(x, w_nk, bias, c, alpha, beta, act):
    y = x.double() @ w_nk.double().t() * alpha
    if c is not None and beta != 0:
        y = y + beta * c.double()
    if bias is not None:
        y = y + bias.double()
    return {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act](y)  # fmt: skip


def _data(lead, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b, g


# ---- the ops on the CPU -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("lead", [(37,), (2, 5), ()])
def test_gemm_epilogue_every_act_and_c_kind(act, lead, dtype):
    from gemmtune import gemm_epilogue

    x, w, b, g = _data(lead, 45, 70, dtype, seed=len(lead))
    out_shape = (*lead, 45)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for bias in (None, b):
        for alpha in (1.0, 0.75):
            y = gemm_epilogue(x, w, bias, act=act, alpha=alpha)
            assert y.shape == out_shape and y.dtype == dtype
            assert _rel_err(y, _ref(x, w, bias, None, alpha, 0, act)) < tol, (act, bias is None, alpha)
            for kind, shape_of in C_SHAPES.items():
                c = torch.randn(shape_of(out_shape), generator=g).to(dtype)
                y = gemm_epilogue(x, w, bias, act=act, alpha=alpha, beta=-0.5, c=c)
                assert y.shape == out_shape
                assert _rel_err(y, _ref(x, w, bias, c, alpha, -0.5, act)) < tol, (act, kind, alpha)


def test_aiter_spellings():
    from gemmtune import cutlass_gemm, gemm_bias, gemm_gelu, gemm_relu
    from gemmtune import tuned_gemm as tg

    x, w, b, g = _data((3, 7), 33, 50, torch.float32)
    ref = x.double() @ w.double().t() + b.double()
    assert _rel_err(gemm_bias(x, w, b), ref) < 1e-6
    assert _rel_err(gemm_bias(x, w.t().contiguous(), b, transpose_weight=False), ref) < 1e-6
    assert _rel_err(gemm_gelu(x, w, b), F.gelu(ref)) < 1e-6
    assert _rel_err(gemm_gelu(x, w, b, approximate="tanh"), F.gelu(ref, approximate="tanh")) < 1e-6
    assert _rel_err(gemm_gelu(x, w), F.gelu(ref - b.double())) < 1e-6
    assert _rel_err(gemm_relu(x, w, b), torch.relu(ref)) < 1e-6
    a2, bmat = x.reshape(21, 50), w.t().contiguous()  # cutlass_gemm: a [M, K] @ b [K, N]
    c = torch.randn(21, 33, generator=g)
    assert _rel_err(cutlass_gemm(a2, bmat), a2.double() @ bmat.double()) < 1e-6
    assert _rel_err(cutlass_gemm(a2, bmat, 2.0, 0.5, c), 2 * a2.double() @ bmat.double() + 0.5 * c.double()) < 1e-6
    assert tg.gemm_bias is gemm_bias and tg.cutlass_gemm is cutlass_gemm and tg.gemm_gelu is gemm_gelu
    assert tg.gemm_relu is gemm_relu and callable(tg.sparse_gemm)


def test_beta_zero_ignores_c_even_nan():
    from gemmtune import cutlass_gemm

    x, w, _, _ = _data((9,), 12, 16, torch.float32)
    c = torch.full((9, 12), float("nan"))
    y = cutlass_gemm(x, w.t(), 1.0, 0.0, c)
    assert not torch.isnan(y).any()
    assert _rel_err(y, x.double() @ w.double().t()) < 1e-6


def test_out_dtype_and_empty_sizes():
    from gemmtune import gemm_epilogue

    x, w, b, _ = _data((5,), 12, 16, torch.bfloat16)
    y = gemm_epilogue(x, w, b, act="gelu", out_dtype=torch.float32)
    assert y.dtype == torch.float32 and _rel_err(y, _ref(x, w, b, None, 1, 0, "gelu")) < 1e-5
    assert gemm_epilogue(x[:0], w, b, act="relu").shape == (0, 12)
    y0 = gemm_epilogue(x[:, :0], w[:, :0], b, act="relu")  # K == 0: act(bias)
    assert torch.equal(y0, torch.relu(b).expand(5, 12))


def test_grad_flows_through_unfused_path():
    from gemmtune import gemm_gelu

    x, w, b, _ = _data((4,), 6, 8, torch.float32)
    w.requires_grad_(True)
    b.requires_grad_(True)
    gemm_gelu(x, w, b).sum().backward()
    w2, b2 = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    F.gelu(F.linear(x, w2, b2)).sum().backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-6) and torch.allclose(b.grad, b2.grad, atol=1e-6)


def test_custom_op_opcheck():
    x, w, b, g = _data((5,), 12, 16, torch.float32)
    c = torch.randn(5, 1, generator=g)
    op = torch.ops.gemmtune.gemm_epilogue.default
    torch.library.opcheck(op, (x, w, b, c, "gelu_tanh", 0.5, 2.0, None, "nk"))
    torch.library.opcheck(op, (x, w.t().contiguous(), None, None, "relu", 1.0, 0.0, None, "kn"))


def test_compiled_call_matches_eager():
    from gemmtune import gemm_gelu

    x, w, b, _ = _data((7,), 12, 16, torch.float32)
    fn = torch.compile(lambda x: gemm_gelu(x, w, b, approximate="tanh"), backend="eager", fullgraph=True)
    assert torch.allclose(fn(x), gemm_gelu(x, w, b, approximate="tanh"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(act="swish"), "act must be one of none, relu, gelu, gelu_tanh, got 'swish'"),
        (dict(alpha=torch.tensor(2.0)), r"alpha must be a number, got a tensor \(\) torch.float32"),
        (dict(beta=float("nan"), c="full"), "beta must be a finite number, got nan"),
        (dict(beta=1.0), r"beta=1.0 needs a C"),
        (dict(beta=1.0, c=(3, 12)), r"C of shape \(3, 12\) is not a supported broadcast over the output \(5, 12\)"),
        (dict(beta=1.0, c=(5, 13)), r"C of shape \(5, 13\)"),
        (dict(beta=1.0, c="f16"), "c dtype torch.float16 must be x's"),
        (dict(bias=(11,)), "bias must be 1-D of length N=12"),
        (dict(w_layout="kn"), r"x\[..., K=16\] does not match w \[K, N\] with K=12"),
        (dict(w_layout="tn"), "w_layout must be one of nk, kn, got 'tn'"),
        (dict(out_dtype=torch.int8), "unsupported out_dtype"),
    ],
)
def test_bad_input_errors(kwargs, match):
    from gemmtune import gemm_epilogue

    x, w, b, _ = _data((5,), 12, 16, torch.float32)
    kwargs = dict(kwargs)
    c = kwargs.pop("c", None)
    if c == "full":
        kwargs["c"] = torch.zeros(5, 12)
    elif c == "f16":
        kwargs["c"] = torch.zeros(5, 12, dtype=torch.float16)
    elif c is not None:
        kwargs["c"] = torch.zeros(c)
    bias = torch.zeros(kwargs.pop("bias")) if "bias" in kwargs else None
    with pytest.raises((ValueError, TypeError), match=match):
        gemm_epilogue(x, w, bias, **kwargs)


def test_bad_input_errors_of_aiter_spellings():
    from gemmtune import gemm_bias, gemm_gelu

    x, w, b, _ = _data((5,), 12, 16, torch.float32)
    with pytest.raises(ValueError, match="approximate must be"):
        gemm_gelu(x, w, b, approximate="fast")
    with pytest.raises(ValueError, match=r"x\[..., K=16\] does not match w \[K, N\]"):
        gemm_bias(x, w, b, transpose_weight=False)
    with pytest.raises(ValueError, match="dtype mismatch"):
        gemm_bias(x, w.double(), b)
    with pytest.raises(ValueError, match="sparse weights go to gemmtune.sparse_gemm"):
        gemm_bias(x, w.to_sparse(), b)


# ---- the family: keys, tables, dispatch ---------------------------------------------------------
def _table(tmp_path, rows, name="epilogue_tuned.csv"):
    from gemmtune.families import get

    cols = list(get("epilogue").tuned_columns)
    p = tmp_path / name
    lines = [",".join(cols)] + [",".join(str(r.get(c, "")) for c in cols) for r in rows]
    p.write_text("\n".join(lines) + "\n")
    return p


def _row(**kw):
    from gemmtune.device import identity

    ident = identity("cpu")
    base = dict(gfx=ident.gfx, cu_num=ident.cu_num, M=64, N=45, K=70, bias="True", dtype="torch.float32",
                outdtype="torch.float32", scaleAB="False", bpreshuffle="False", libtype="torch",
                solidx=0, splitK=0, us=1.0, kernelName="addmm_activation", err_ratio=0, tflops=0, bw=0,
                act="relu", alpha="False", beta="False", c="none", w_layout="nk")  # fmt: skip
    return {**base, **kw}


def test_table_detected_loaded_and_dispatched(tmp_path, monkeypatch):
    import gemmtune
    from gemmtune.configs.table import ConfigStore
    from gemmtune.families import detect, get
    from gemmtune.families.epilogue import EpilogueKey

    p = _table(tmp_path, [_row(M=37), _row(act="gelu_tanh", M=16)])
    fam = get("epilogue")
    assert detect(list(fam.tuned_columns), str(p)).name == "epilogue"
    assert detect(list(fam.untuned_columns), "shapes.csv").name == "epilogue"
    monkeypatch.setenv("GEMMTUNE_CONFIG_EPILOGUE", str(p))
    store = ConfigStore.from_env(os.environ)
    assert len(store.table("epilogue")) == 2
    gemmtune.set_config(str(p))
    key = EpilogueKey(37, 45, 70, True, torch.float32, torch.float32, "relu")
    res = gemmtune.resolve(key, "cpu", family="epilogue")
    assert res.solution.kernel_name == "addmm_activation" and res.row is not None
    x, w, b, _ = _data((37,), 45, 70, torch.float32)
    y = gemmtune.gemm_relu(x, w, b)
    assert _rel_err(y, _ref(x, w, b, None, 1, 0, "relu")) < 1e-6
    # A row the torch backend cannot run (the CPU's addmm_activation has no tanh GELU) falls back.
    gemmtune.set_config(str(_table(tmp_path, [_row(act="gelu_tanh", M=37)], "bad_epilogue.csv")))
    res = gemmtune.resolve(key._replace(act="gelu_tanh"), "cpu", family="epilogue")
    assert res.solution.kernel_name == "native" and "fallback" in res.note


def test_table_rejects_inconsistent_rows(tmp_path):
    from gemmtune.configs.table import ConfigTable
    from gemmtune.errors import ConfigError

    for bad, col in ((dict(beta="True", c="none"), "'c'"), (dict(c="row"), "'c'"), (dict(act="tanh"), "'act'"),
                     (dict(scaleAB="True"), "'scaleAB'")):  # fmt: skip
        p = _table(tmp_path, [_row(**bad)], "bad.csv")
        with pytest.raises(ConfigError, match=col):
            ConfigTable.load(str(p), "epilogue")


def test_key_round_trips_through_a_written_table(tmp_path):
    from gemmtune.configs.table import ConfigTable

    p = _table(tmp_path, [_row(alpha="True", beta="True", c="col", act="gelu", w_layout="kn", kernelName="native")])
    t = ConfigTable.load(str(p), "epilogue")
    out = tmp_path / "out.csv"
    t.write(str(out))
    t2 = ConfigTable.load(str(out), "epilogue")
    assert [r.key for r in t2.rows] == [r.key for r in t.rows]
    k = t2.rows[0].key
    assert (k.alpha, k.beta, k.c, k.act, k.w_layout) == (True, True, "col", "gelu", "kn")


@pytest.mark.parametrize("c", ["none", "full", "row", "col", "scalar"])
def test_family_inputs_reference_and_torch_candidates(c):
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get
    from gemmtune.families.epilogue import EpilogueKey

    fam = get("epilogue")
    be = get_backend("torch", "epilogue")
    cpu = torch.device("cpu")
    for act in ("relu", "gelu_tanh", "gelu"):
        for bias in (False, True):
            key = EpilogueKey(37, 45, 70, bias, torch.float32, torch.float32, act, True, c != "none", c, "kn")
            inputs = fam.make_inputs(key, cpu, 2, 0)[1]
            ref = fam.reference(key, inputs)
            assert tuple(ref.shape) == fam.output_shape(key)
            sols = be.candidates(key, cpu)
            assert sols[0].kernel_name == "native"
            fused = act != "gelu_tanh" and bias != (c != "none")  # the CPU's _addmm_activation GELU is erf
            assert ("addmm_activation" in [s.kernel_name for s in sols]) == fused
            for sol in sols:
                run = be.make_runner(sol, key, cpu)
                for what, variant, shape in [("main", inputs, fam.output_shape(key)), *fam.check_variants(key, inputs)]:
                    y = run(*variant)
                    assert tuple(y.shape) == shape, what
                    assert _rel_err(y, fam.reference(key, variant)) < 1e-5, (sol.kernel_name, what)
            assert fam.bytes(key) > fam.set_bytes(key) - 1 and fam.flops(key) == 2 * 37 * 45 * 70


def test_tuner_check_judges_other_alpha_beta_values_against_their_own_reference():
    """The family's check variant with other alpha / beta values computes another result: the tuner's
    check compares it with that result's reference, so a correct runner passes (and a runner that
    ignores the values fails)."""
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get
    from gemmtune.families.epilogue import EpilogueKey
    from gemmtune.tuner.check import check_runner

    fam, tb = get("epilogue"), get_backend("torch", "epilogue")
    cpu = torch.device("cpu")
    for c in ("none", "full", "row", "col", "scalar"):
        key = EpilogueKey(37, 45, 70, True, torch.float32, torch.float32, "relu", True, c != "none", c)
        inputs = fam.make_inputs(key, cpu, 1, 0)[0]
        run = tb.make_runner(tb.default_solution(key, cpu), key, cpu)
        verdict = check_runner(run, key, inputs, fam.reference(key, inputs), family=fam)
        assert verdict.ok, (c, verdict.reason)
        stuck = lambda x, w, b, cc, alpha, beta, r=run, inp=inputs: r(x, w, b, cc, inp[4], inp[5])  # noqa: E731
        verdict = check_runner(stuck, key, inputs, fam.reference(key, inputs), family=fam)
        assert not verdict.ok and "other alpha / beta values" in verdict.reason, c


# ---- a tanh GELU standing in for the erf one ------------------------------------------------------
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
def test_tanh_gelu_for_erf_keys_only_where_the_check_passes_it(out):
    """GPUs' fused GELUs (cuBLASLt, torch._addmm_activation) are the tanh approximation. For an erf-GELU
    key they are offered only with a 16-bit output, where the tuner's check against the fp32 erf
    reference passes a tanh result on random data (bias and pre-activation as a model's, std ~1.4);
    with an fp32 output the same substitution fails that check, and no backend offers it."""
    from gemmtune.backends import get as get_backend
    from gemmtune.backends.epilogue.blaslt import BlasLtEpilogueBackend
    from gemmtune.backends.epilogue.pytorch import UNFUSED
    from gemmtune.families import get
    from gemmtune.families.epilogue import EpilogueKey, tanh_for_erf
    from gemmtune.tuner.check import check_runner

    fam, tb = get("epilogue"), get_backend("torch", "epilogue")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # supports() reads only the device's type
    key = EpilogueKey(257, 384, 520, True, out, out, "gelu")
    offered = out != torch.float32
    assert tanh_for_erf(key) == offered
    # A tanh-GELU result computed unfused (pre-activation rounded to the out dtype, then GELU: one
    # rounding more than a fused kernel), judged as the tuner judges the erf key's candidates.
    inputs = fam.make_inputs(key, cpu, 1, seed=5)[0]
    tanh_run = tb.make_runner(UNFUSED, key._replace(act="gelu_tanh"), cpu)
    verdict = check_runner(tanh_run, key, inputs, fam.reference(key, inputs), family=fam)
    assert verdict.ok == offered, (verdict.err, verdict.reason)
    if offered:
        assert verdict.err < fam.error_threshold(key) / 4
    on_gpu = [s.kernel_name for s in tb.candidates(key, cuda)]
    assert on_gpu == (["native", "addmm_activation_tanh"] if offered else ["native"])
    assert "addmm_activation_tanh" not in [s.kernel_name for s in tb.candidates(key, cpu)]  # the CPU's GELU is erf
    assert BlasLtEpilogueBackend().key_ok(key) == offered
    # The tanh name never answers a key whose GELU is tanh anyway, nor another act.
    for act in ("gelu_tanh", "relu", "none"):
        names = [s.kernel_name for s in tb.candidates(key._replace(act=act), cuda)]
        assert "addmm_activation_tanh" not in names
        assert ("addmm_activation" in names) == (act != "none")
    sol = tb.solution_from_row(0, "addmm_activation_tanh", 0)
    assert sol is not None and sol.kernel_name == "addmm_activation_tanh" and sol.solidx != 0


# ---- Triton under the interpreter ---------------------------------------------------------------
INTERP_CONFIGS = [
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1",
    "tg_bm32_bn16_bk32_g2_w4_s2_sk3r",
    "tg_bm16_bn16_bk16_g1_w4_s2_sk4f",
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1_p",
    "tg_bm16_bn32_bk16_g8_w4_s2_sk1_tma",
]


def _interp_cases() -> list:
    """(config, act, c kind, dtype) of the interpreter sweep: every kind in fp32, fp16 spot checks."""
    return [(name, act, kind, dt) for name in INTERP_CONFIGS for act in ACTS
            for kind in ("none", "full", "row", "col", "scalar") for dt in ("fp32", "fp16")
            if dt == "fp32" or kind in ("none", "col")]  # fmt: skip


def _interp_in_default(case) -> bool:
    """The default tier: each config with one act (the acts in turn), every c kind and dtype of it."""
    name, act = case[:2]
    return ACTS.index(act) == INTERP_CONFIGS.index(name) % len(ACTS)


def _interp_tier(tier: str) -> list:
    return [c for c in _interp_cases() if _interp_in_default(c) == (tier == "default")]


def _interp_main(tier: str) -> dict:
    from gemmtune.families.epilogue import expand_c
    from gemmtune.kernels.triton_gemm import TGKernel, parse_config, triton_epilogue_ref

    res = {}
    M, N, K = 37, 45, 72
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / 8
    b = torch.randn(N, generator=g)
    cs = {kind: expand_c(torch.randn(C_SHAPES[kind]((M, N)), generator=g), kind, M, N) for kind in C_SHAPES}
    cs["none"] = None
    for name, act, kind, dt in _interp_tier(tier):
        t = torch.float32 if dt == "fp32" else torch.float16
        kn = kind == "row" and "_tma" not in name  # a [K, N]-stored weight (TMA needs unit K stride)
        xx, ww, bb = x.to(t), (w.t().contiguous().t() if kn else w).to(t), b.to(t)
        c = None if cs[kind] is None else cs[kind].to(t)
        alpha, beta = (0.75, -0.5) if kind != "none" else (1.0, 0.0)
        kern = TGKernel(parse_config(name), torch.device("cpu"), lock_tiles=1)
        y = torch.full((M, N), float("nan"), dtype=t)
        kern(xx, ww, None if kind == "scalar" else bb, y, c, alpha, beta, act)
        bias = None if kind == "scalar" else bb
        b64 = None if bias is None else bias.double()
        c64 = None if c is None else c.double()
        ref = triton_epilogue_ref(xx.double(), ww.double(), b64, c64, alpha, beta, act, torch.float64)
        res[f"{name}|{act}|{kind}|{dt}"] = {"err": _rel_err(y, ref), "nan": bool(torch.isnan(y).any())}
    return res


@pytest.fixture(scope="module")
def interp(request):
    """The interpreter sweep's results of one tier: (tier, {case: result})."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, __file__, "--interp", request.param]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return request.param, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("interp", SWEEP_TIERS, indirect=True)
def test_interpreter_triton_epilogue_matches_reference(interp):
    tier, results = interp
    assert len(_interp_cases()) == len(INTERP_CONFIGS) * len(ACTS) * (5 + 2)
    assert set(results) == {"|".join(c) for c in _interp_tier(tier)}
    for case, r in results.items():
        assert not r["nan"], f"{case}: output left unwritten (NaN)"
        tol = 1e-5 if case.endswith("fp32") else 3e-3
        assert r["err"] < tol, f"{case}: rel err {r['err']:.2e}"


def test_triton_backend_offers_the_a16w16_space():
    from gemmtune.backends import get as get_backend
    from gemmtune.backends.a16w16.triton import TritonGemmBackend
    from gemmtune.families.epilogue import EpilogueKey
    from gemmtune.keys import GemmKey

    be = get_backend("triton", "epilogue")
    assert be is not None
    key = EpilogueKey(64, 1280, 1024, True, act="gelu")
    sol = be.solution_from_row(0, "tg_bm64_bn64_bk64_g8_w4_s3_sk1", 0)
    cpu = torch.device("cpu")
    assert be.supports(sol, key, cpu)
    assert be.solution_from_row(0, "native", 0) is None
    plain = TritonGemmBackend().supports(sol, GemmKey(64, 1280, 1024, True), cpu)
    assert plain


# ---- GPU -----------------------------------------------------------------------------------------
GPU_CONFIGS = [
    "tg_bm64_bn128_bk64_g8_w4_s4_sk1",
    "tg_bm128_bn128_bk64_g8_w8_s4_sk1_p",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3f",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3r",
    "tg_bm128_bn256_bk64_g8_w8_s3_sk1_tma",
    "tg_bm64_bn64_bk128_g8_w4_s4_sk3f_pdl2",
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("act", tiered(ACTS, lambda a: a == "gelu_tanh"))
def test_gpu_every_solution_matches_fp32(gpu, act, dtype):
    from gemmtune.backends import get as get_backend
    from gemmtune.backends.lib.triton_tiles import hardware
    from gemmtune.families import get
    from gemmtune.families.epilogue import EpilogueKey

    fam = get("epilogue")
    hw = hardware(gpu)
    for c, bias in (("none", True), ("full", False), ("col", True)):
        key = EpilogueKey(300, 1000, 1032, bias, dtype, dtype, act, c != "none", c != "none", c)
        inputs = fam.make_inputs(key, gpu, 1, 1)[0]
        ref = fam.reference(key, inputs)
        x, w, b, cc, alpha, beta = inputs
        floor = _rel_err(F.linear(x, w, b) if c == "none" else ref.to(dtype), ref)
        sols = [("torch", s) for s in get_backend("torch", "epilogue").candidates(key, gpu)]
        tb = get_backend("triton", "epilogue")
        for name in GPU_CONFIGS:
            sol = tb.solution_from_row(0, name, 0)
            if tb.supports(sol, key, gpu) and (not name.endswith("_tma") or hw.tma):
                sols.append(("triton", sol))
        for lib, sol in sols:
            run = get_backend(lib, "epilogue").make_runner(sol, key, gpu)
            y = run(*inputs)
            assert not torch.isnan(y).any(), sol.kernel_name
            assert _rel_err(y, ref) <= 2 * floor + 2e-3, (sol.kernel_name, c, _rel_err(y, ref), floor)


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager(gpu):
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get
    from gemmtune.families.epilogue import EpilogueKey

    key = EpilogueKey(200, 1280, 2048, True, torch.bfloat16, torch.bfloat16, "gelu_tanh", True, True, "row")
    inputs = get("epilogue").make_inputs(key, gpu, 1, 0)[0]
    tb, lt = get_backend("triton", "epilogue"), get_backend("blaslt", "epilogue")
    sols = [get_backend("torch", "epilogue").default_solution(key, gpu)]
    sols += [tb.solution_from_row(0, n, 0) for n in ("tg_bm64_bn64_bk128_g8_w4_s4_sk3f",
                                                     "tg_bm64_bn128_bk64_g8_w4_s4_sk1")]  # fmt: skip
    if lt.is_available(gpu):  # the heuristic's first picks and split-K ones (the row C: folded into the bias)
        lt_sols = lt.candidates(key, gpu)
        sols += lt_sols[:3] + [s for s in lt_sols if s.splitk > 1][:2]
    for sol in sols:
        name = sol.describe()
        run = get_backend(sol.libtype, "epilogue").make_runner(sol, key, gpu)
        eager = run(*inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(*inputs)
        for _ in range(2):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), name


@pytest.mark.gpu
def test_gpu_op_under_graph_capture(gpu):
    from gemmtune import gemm_gelu

    x = torch.randn(64, 512, device=gpu, dtype=torch.bfloat16)
    w = torch.randn(768, 512, device=gpu, dtype=torch.bfloat16) / 23
    b = torch.randn(768, device=gpu, dtype=torch.bfloat16)
    eager = gemm_gelu(x, w, b, approximate="tanh")  # the miss (resolution) happens outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_gelu(x, w, b, approximate="tanh")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


if __name__ == "__main__" and "--interp" in sys.argv:
    print(json.dumps(_interp_main(sys.argv[sys.argv.index("--interp") + 1])))
