"""The epilogue family's `blaslt` backend (backends/epilogue/blaslt.py): cuBLASLt with the epilogue set.

CPU: the cuBLASLt epilogue chosen for every act x bias x C kind (none where cuBLASLt has no form: a
column C, an erf GELU with an fp32 output), kernel names with and without the `_tanh` tag round-trip
through a table row and are refused under another cuBLASLt version, layouts of x / w / C strides, the
backend says why it is unavailable. GPU (marked gpu, skipped without nvmath-python): every act x bias x
alpha / beta / C kind through the backend's candidates against the fp32 reference on odd shapes (the
tuner's check: NaN-poisoned outputs, padded x, the other weight storage order, other alpha / beta
values, CUDA-graph replay), another M and misaligned operands, a tuned row dispatched by gemm_gelu, and
the tuner checking and timing blaslt candidates. Graph replay == eager: tests/test_epilogue.py, which
runs it for every epilogue backend.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_tagged_names_round_trip, sample_candidates

from gemmtune.backends.epilogue import blaslt as be
from gemmtune.backends.lib import blaslt as bl
from gemmtune.families.epilogue import EpilogueKey

NAME = "lt130200_a66_t20_s35_k1_r0_w0_c0_i0_cl2"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _key(act="none", bias=False, c="none", out=BF16, dtype=BF16, alpha=False, w_layout="nk", m=77, n=1000, k=1032):
    return EpilogueKey(m, n, k, bias, dtype, out, act, alpha, c != "none", c, w_layout)


@pytest.mark.parametrize(
    ("act", "bias", "c", "out", "want"),
    [
        ("none", False, "none", BF16, "DEFAULT"),
        ("none", True, "none", BF16, "BIAS"),
        ("relu", False, "none", BF16, "RELU"),
        ("relu", True, "none", FP16, "RELU_BIAS"),
        ("gelu_tanh", False, "none", FP32, "GELU"),
        ("gelu_tanh", True, "none", BF16, "GELU_BIAS"),
        ("gelu", True, "none", BF16, "GELU_BIAS"),
        ("gelu", False, "none", FP16, "GELU"),
        ("gelu", True, "none", FP32, None),  # tanh for erf only with a 16-bit output
        ("none", False, "full", BF16, "DEFAULT"),  # a full C is cuBLASLt's C matrix
        ("relu", True, "full", BF16, "RELU_BIAS"),
        ("none", False, "row", BF16, "BIAS"),  # a row / scalar C is folded into the bias vector
        ("gelu_tanh", False, "scalar", BF16, "GELU_BIAS"),
        ("relu", True, "row", BF16, "RELU_BIAS"),
        ("none", True, "col", BF16, None),  # a column C has no cuBLASLt form
    ],
)
def test_epilogue_for_each_act_bias_and_c(act, bias, c, out, want):
    key = _key(act, bias, c, out, dtype=BF16 if out == FP32 else out)
    assert be.lt_epilogue(key) == want
    assert be.BlasLtEpilogueBackend().key_ok(key) == (want is not None)
    assert be.name_tag(key) == ("_tanh" if act == "gelu" else "")


def test_key_dtypes():
    ok = be.BlasLtEpilogueBackend().key_ok
    assert ok(_key("relu", dtype=BF16, out=FP32)) and ok(_key(dtype=FP32, out=FP32)) and ok(_key(dtype=FP16, out=FP16))
    assert not ok(_key(dtype=FP16, out=BF16)) and not ok(_key(dtype=FP32, out=BF16))
    assert not ok(_key("gelu", dtype=BF16, out=FP32)) and not ok(_key("gelu", dtype=FP32, out=FP32))


def test_names_round_trip_with_and_without_the_tanh_tag(monkeypatch, caplog):
    bad = (NAME + "_tanhx", NAME + "_erf", "_tanh", "addmm_activation_tanh", "tg_bm64_bn64_bk64_g8_w4_s3_sk1")
    assert_tagged_names_round_trip(be.BlasLtEpilogueBackend(), be.split_name, NAME, "_tanh", bad, monkeypatch, caplog)


def test_a_name_answers_only_keys_with_its_tag(monkeypatch):
    """A `_tanh` kernel never answers a gelu_tanh (or relu) key, a plain one never an erf-GELU key: the
    tag is compared before anything needs cuBLASLt."""
    lt = be.BlasLtEpilogueBackend()
    monkeypatch.setattr(type(lt), "is_available", lambda self, device: True)
    gpu = torch.device("cuda")
    tanh = bl.AlgoSpec.parse(NAME)
    assert not lt.supports(lt.solution(tanh, "_tanh"), _key("gelu_tanh", True), gpu)
    assert not lt.supports(lt.solution(tanh, "_tanh"), _key("relu", True), gpu)
    assert not lt.supports(lt.solution(tanh), _key("gelu", True), gpu)
    assert not lt.supports(lt.solution(tanh, "_tanh"), _key("gelu", True, out=FP32, dtype=FP32), gpu)


def test_layouts_of_x_w_and_c():
    from gemmtune.backends.lib.blaslt import OP_N, OP_T

    key = _key("relu", True, "full", m=5, n=48, k=64)
    # x [5, 64] with padded rows, w [N, K] stored [N, K] and [K, N], C [5, 48] with padded rows.
    (wa, xb, ldc) = be.lt_layout(key, 5, (72, 1), (64, 1), (56, 1))
    assert wa == (OP_T, 64, 48, 64) and xb == (OP_N, 64, 5, 72) and ldc == 56
    (wa, _, _) = be.lt_layout(key, 5, (64, 1), (1, 48), (48, 1))
    assert wa == (OP_N, 48, 64, 48)
    assert be.lt_layout(key, 5, (64, 1), (64, 1), (1, 5)) is None  # a transposed C is copied
    assert be.lt_layout(key, 5, (64, 1), (64, 1), (0, 1)) is None  # a row-broadcast "full" C is copied
    assert be.lt_layout(key, 5, (128, 2), (64, 1), None) is None  # no unit stride in x
    assert be.lt_layout(key, 1, (64, 1), (64, 1), (48, 1))[2] == 48
    assert be.key_strides(_key(w_layout="kn", n=48, k=64)) == ((64, 1), (1, 48), None)
    assert be.key_strides(_key(c="full", n=48, k=64)) == ((64, 1), (64, 1), (48, 1))


def test_unavailable_says_why():
    from gemmtune.backends import get

    lt = get("blaslt", "epilogue")
    assert isinstance(lt, be.BlasLtEpilogueBackend)
    cpu = torch.device("cpu")
    why = lt.unavailable_reason(cpu)
    assert not lt.is_available(cpu) and why.startswith("blaslt (epilogue): ") and ("NVIDIA" in why or "nvmath" in why)
    assert lt.candidates(_key("gelu_tanh", True), cpu) == []
    if not torch.cuda.is_available():
        assert lt.unavailable_reason(torch.device("cuda")).startswith("blaslt (epilogue): ")


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.fixture
def lt(usable):
    return usable(be.BlasLtEpilogueBackend())


# (alpha, C kind): the alpha / beta forms of the key; act and bias are crossed with each.
SCALINGS = [(False, "none"), (True, "none"), (True, "full"), (False, "row"), (True, "scalar")]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("alpha", "c"), [s if s == (True, "full") else pytest.param(*s, marks=pytest.mark.slow) for s in SCALINGS]
)
@pytest.mark.parametrize("bias", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("act", ["none", "relu", "gelu", "gelu_tanh"])
def test_gpu_every_epilogue_matches_fp32(lt, gpu, act, bias, alpha, c):
    from gemmtune.families import get
    from gemmtune.tuner.check import check_runner

    fam = get("epilogue")
    shapes = [(BF16, BF16, 77, 1000, 1032, "nk"), (FP16, FP16, 45, 72, 136, "kn")]
    if act == "gelu_tanh" and c == "full":
        shapes.append((BF16, FP32, 33, 200, 264, "nk"))  # widening output
    for dtype, out, m, n, k, lay in shapes:
        key = _key(act, bias, c, out, dtype, alpha, lay, m, n, k)
        sols = lt.candidates(key, gpu)
        assert sols, f"cuBLASLt offered no algorithm for {key.describe()}"
        assert all(s.kernel_name.endswith("_tanh") == (act == "gelu") for s in sols)
        inputs = fam.make_inputs(key, gpu, 1, seed=m + n)[0]
        ref = fam.reference(key, inputs)
        for sol in sample_candidates(sols):
            run = lt.make_runner(sol, key, gpu)
            verdict = check_runner(run, key, inputs, ref, family=fam)
            assert verdict.ok, (sol.kernel_name, key.describe(), verdict.reason)


@pytest.mark.gpu
def test_gpu_nothing_offered_where_cublaslt_has_no_form(lt, gpu):
    assert lt.candidates(_key("relu", True, "col"), gpu) == []
    assert lt.candidates(_key("gelu", True, out=FP32), gpu) == []
    assert lt.candidates(_key("gelu", True, out=FP32, dtype=FP32), gpu) == []


@pytest.mark.gpu
def test_gpu_other_m_strides_and_misaligned_operands(lt, gpu):
    """One runner serves every M of its shape; a C with padded rows is read in place (its own leading
    dimension), views it cannot read in place (a misaligned x, a transposed C, a non-contiguous bias)
    through copies; the same result as the reference each time."""
    from gemmtune.families.epilogue import epilogue_ref

    key = _key("relu", True, "full", alpha=True, m=64, n=1000, k=1032)
    run = lt.make_runner(lt.candidates(key, gpu)[0], key, gpu)
    g = torch.Generator(device=gpu).manual_seed(3)
    for m in (1, 64, 300):
        x_off = torch.randn(m, 1033, device=gpu, generator=g).to(BF16)[:, 1:]  # 2 bytes off its allocation
        w = (torch.randn(1000, 1032, device=gpu, generator=g) / 32).to(BF16)
        bias = torch.randn(2000, device=gpu, generator=g).to(BF16)[::2]
        padded_c = torch.randn(m, 1008, device=gpu, generator=g).to(BF16)[:, :1000]
        transposed_c = torch.randn(1000, m, device=gpu, generator=g).to(BF16).t()
        for x, c in ((x_off.contiguous(), padded_c), (x_off, transposed_c)):
            y = run(x, w, bias, c, 0.75, -0.5)
            ref = epilogue_ref(x, w, bias, c, 0.75, -0.5, "relu")
            assert y.shape == (m, 1000) and not torch.isnan(y).any()
            assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2, (m, c.stride())


@pytest.mark.gpu
def test_gpu_tuned_row_dispatches_the_tanh_kernel_for_gelu(lt, gpu, tmp_path):
    import gemmtune
    from gemmtune.configs import ConfigTable, TunedRow
    from gemmtune.device import identity
    from gemmtune.families import get

    fam = get("epilogue")
    key = _key("gelu", True, m=64, n=4096, k=1024)
    sol = lt.candidates(key, gpu)[0]
    ident = identity(gpu)
    row = TunedRow(ident.gfx, ident.cu_num, key, "blaslt", sol.solidx, sol.splitk, 10.0, sol.kernel_name, family=fam)
    path = tmp_path / "epilogue_tuned.csv"
    ConfigTable([row], family=fam).write(str(path))
    back = ConfigTable.load(str(path), "epilogue").rows[0]
    assert back.kernel_name == sol.kernel_name and back.kernel_name.endswith("_tanh")
    gemmtune.set_config(str(path))
    res = gemmtune.resolve(key, gpu, family="epilogue")
    assert (res.solution.libtype, res.solution.kernel_name) == ("blaslt", sol.kernel_name), res.note
    x, w, b, *_ = fam.make_inputs(key, gpu, 1, 0)[0]
    y = gemmtune.gemm_gelu(x, w, b)
    ref = fam.reference(key, (x, w, b, None, 1.0, 0.0))
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_tuner_checks_and_times_blaslt_candidates(lt, gpu):
    from gemmtune.tuner.search import OK, TuneOptions, tune_shape

    key = _key("gelu_tanh", True, m=256, n=2560, k=1024)
    opts = TuneOptions(libtypes=["torch", "blaslt"], verify_range=False, reps=5, screen_reps=2, top=2)
    res = tune_shape(key, gpu, opts, family="epilogue")
    mine = [c for c in res.candidates if c.libtype == "blaslt"]
    assert mine and all(c.status == OK for c in mine), [(c.kernel_name, c.status, c.reason) for c in mine]
    assert res.us > 0 and res.winner.status == OK
