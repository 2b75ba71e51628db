"""The a8w8 families' `blaslt` backend (backends/quantized/blaslt.py): cuBLASLt fp8 with its scales.

CPU: kernel names with and without the fast-accumulation tag `_fa` round-trip through a table row (and
are refused under another cuBLASLt version), which keys it takes (fp8 e4m3 only, N and K multiples of
16), the backend says why it is unavailable, and the untuned a8w8 policy asks it first for fp8 on an
NVIDIA GPU and falls back to torch._scaled_mm when it has nothing (cuBLASLt patched). GPU (marked gpu,
skipped without nvmath-python): every sampled candidate on odd M against the fp32 dequantized reference
with the tuner's check (NaN-poisoned outputs, padded xq rows, CUDA-graph replay), both scale kinds, bias
and none, bf16 / fp16 / fp32 out, both accumulations; one runner over other Ms and misaligned operands;
a tuned `_fa` row dispatched by gemm_a8w8; the untuned default picking blaslt.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_tagged_names_round_trip, sample_candidates
from tiers import tiered

from gemmtune.backends.lib import blaslt as bl
from gemmtune.backends.quantized import blaslt as qb
from gemmtune.families.quantized import FP8, QuantKey
from gemmtune.quant import formats

NAME = "lt130100_a66_t20_s35_k1_r0_w0_c0_i0_cl2"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = torch.device("cuda")  # a device object only: no GPU needed to build it
pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def _key(m=1000, n=1040, k=1152, scale="per_token", bias=False, out=BF16, q=FP8) -> QuantKey:
    return QuantKey(m, n, k, q, scale, bias, out)


# ---- CPU ----------------------------------------------------------------------------------------
def test_names_round_trip_with_and_without_the_fast_accumulation_tag(monkeypatch, caplog):
    lt = qb.BlasLtA8W8Backend()
    bad = (NAME + "_tanh", NAME + "_fax", "_fa", "scaled_mm", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1")
    assert_tagged_names_round_trip(lt, qb.split_name, NAME, "_fa", bad, monkeypatch, caplog, version=130100)
    assert lt.name_tags(_key()) == ("", "_fa")


def test_which_keys_it_takes():
    lt = qb.BlasLtA8W8Backend()
    for scale in ("per_token", "per_tensor"):
        for out in (BF16, FP16, FP32):
            for bias in (False, True):
                assert lt.key_ok(_key(scale=scale, bias=bias, out=out)), (scale, out, bias)
    assert not lt.key_ok(_key(q=torch.int8))
    if formats.FP8_FNUZ is not None:
        assert not lt.key_ok(_key(q=formats.FP8_FNUZ))
    assert lt.sizes_ok(_key(m=1, n=16, k=16)) and lt.sizes_ok(_key(m=7, n=1040, k=1552))
    for n, k in ((1000, 1024), (1024, 1000), (1032, 1024), (0, 1024)):
        assert not lt.sizes_ok(_key(n=n, k=k)), (n, k)


def test_registered_for_both_a8w8_families_and_unavailable_here_says_why():
    from gemmtune import backends

    for fam in ("a8w8", "a8w8_bpreshuffle"):
        lt = backends.get("blaslt", fam)
        assert isinstance(lt, qb.BlasLtA8W8Backend) and lt.family == fam
        cpu = torch.device("cpu")
        why = lt.unavailable_reason(cpu)
        assert not lt.is_available(cpu) and why.startswith(f"blaslt ({fam}): ")
        assert "NVIDIA" in why or "nvmath" in why, why
        assert lt.candidates(_key(), cpu) == [] and lt.default_solution(_key(), cpu) is None
    assert backends.get("blaslt", "a8w8_blockscale") is None  # its block scales are another problem


class _Problem:
    """A stand-in for A8W8Problem: its heuristic's answer, or the error it raises."""

    def __init__(self, answer):
        self.answer = answer

    def heuristic(self, limit, min_align=256):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_default_solution_is_the_heuristic_pick_of_the_accumulation_asked_for(monkeypatch):
    lt = qb.BlasLtA8W8Backend()
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "is_available", lambda self, device: True)
    monkeypatch.setattr(qb, "lt_version", lambda: 130100)
    monkeypatch.setattr(qb, "algo_attrs", lambda algo: (66, 20, 35, 1, 0, 0, 0, 0, 2))
    tags = []

    def problem_for(self, key, device, tag):
        tags.append(tag)
        return _Problem([(b"algo", 0)])

    monkeypatch.setattr(qb.BlasLtA8W8Backend, "problem_for", problem_for)
    sol = lt.default_solution(_key(), CUDA)
    assert (sol.libtype, sol.kernel_name, sol.splitk) == ("blaslt", NAME, 1) and tags == [""]
    sol = lt.default_solution(_key(), CUDA, fast=True)  # the fast-accumulation problem's pick
    assert (sol.kernel_name, tags[-1]) == (NAME + "_fa", "_fa")
    assert lt.default_solution(_key(), torch.device("cpu")) is None  # cuBLASLt runs CUDA tensors only
    assert lt.default_solution(_key(q=torch.int8), CUDA) is None
    assert lt.default_solution(_key(n=1000), CUDA) is None
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "problem_for", lambda self, key, device, tag: _Problem([]))
    assert lt.default_solution(_key(), CUDA) is None
    refused = RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "problem_for", lambda self, key, device, tag: _Problem(refused))
    assert lt.default_solution(_key(), CUDA) is None


def test_candidates_of_a_problem_cublaslt_refuses_are_none(monkeypatch):
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "is_available", lambda self, device: True)

    def refuse(self, key, device, tag):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(qb.BlasLtA8W8Backend, "problem_for", refuse)
    assert qb.BlasLtA8W8Backend().candidates(_key(), CUDA) == []


def test_make_runner_runs_the_accumulation_the_name_says(monkeypatch):
    lt = qb.BlasLtA8W8Backend()
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "supports", lambda self, sol, key, device: True)
    monkeypatch.setattr(qb, "LtA8W8Runner", lambda spec, key, fast, dev: (spec.name, fast))
    monkeypatch.setattr(qb, "device_index", lambda device: 0)
    spec = bl.AlgoSpec.parse(NAME)
    assert lt.make_runner(lt.solution(spec, "_fa"), _key(), CUDA) == (NAME, True)
    assert lt.make_runner(lt.solution(spec), _key(), CUDA) == (NAME, False)


@pytest.fixture
def h100(monkeypatch):
    """The device vocabulary answering an NVIDIA sm90 GPU (a CUDA build) for every device."""
    from gemmtune import device
    from gemmtune.kernels import _common

    monkeypatch.setattr(device, "vendor", lambda d=None: device.NVIDIA)
    monkeypatch.setattr(device, "facts", lambda d=None: device.OFF_GPU._replace(capability=(9, 0)))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(_common, "_pdl_on", {})


def _default(family, key) -> tuple[str, str]:
    from gemmtune import backends

    backend, sol = backends.default(family, key, CUDA)
    assert backend.name == sol.libtype and backend.family == family  # the row names what runs
    return sol.libtype, sol.kernel_name


def test_policy_runs_blaslt_for_fp8_past_the_skinny_rows_else_scaled_mm(h100, monkeypatch):
    asked = []

    def lt_default(self, key, device, fast=False):
        asked.append((key, fast))
        return self.solution(bl.AlgoSpec.parse(NAME), "_fa" if fast else "")

    monkeypatch.setattr(qb.BlasLtA8W8Backend, "default_solution", lt_default)
    for fam in ("a8w8", "a8w8_bpreshuffle"):
        for m, n in ((65, 6144), (48, 16384), (1024, 6144)):
            for scale in ("per_token", "per_tensor"):
                assert _default(fam, _key(m=m, n=n, k=4096, scale=scale)) == ("blaslt", NAME + "_fa")
        for m in (8, 17, 64):  # decode, and fp8's band past it where one wave holds N: the skinny kernel
            assert _default(fam, _key(m=m, n=6144, k=4096))[0] == "skinny"
        assert _default(fam, _key(m=1024, n=6144, k=4096, q=torch.int8))[0] == "triton"
    assert all(k.q_dtype_w == FP8 and (k.M > 64 or k.N > 8448) and fast == (k.M > 32) for k, fast in asked)
    # cuBLASLt through nvmath has nothing (not installed, or no algorithm): torch._scaled_mm as before
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "default_solution", lambda self, key, device, fast=False: None)
    assert _default("a8w8", _key(m=1024, n=6144, k=4096)) == ("torch", "scaled_mm")


def test_policy_without_nvmath_is_unchanged(h100):
    lt = qb.BlasLtA8W8Backend()
    if lt.is_available(CUDA):
        pytest.skip("nvmath-python's cuBLASLt loads here")
    assert _default("a8w8", _key(m=1024, n=6144, k=4096)) == ("torch", "scaled_mm")


def test_policy_never_asks_blaslt_on_rocm(monkeypatch):
    from gemmtune import device

    monkeypatch.setattr(device, "vendor", lambda d=None: device.AMD)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(qb.BlasLtA8W8Backend, "default_solution", lambda *a: pytest.fail("asked on ROCm"))
    from gemmtune.backends.quantized import policy

    assert policy.a8w8(_key(m=1024, n=6144, k=4096), CUDA)[0] != "blaslt"


def test_a_blaslt_row_round_trips_and_falls_back_where_cublaslt_is_missing(tmp_path, monkeypatch):
    import gemmtune
    from gemmtune.configs import ConfigTable, TunedRow
    from gemmtune.device import identity
    from gemmtune.families import get

    fam, cpu = get("a8w8"), torch.device("cpu")
    key = _key(m=4, n=48, k=64, bias=True)
    name = NAME + "_fa"
    ident = identity(cpu)
    row = TunedRow(ident.gfx, ident.cu_num, key, "blaslt", bl.stable_solidx(name), 1, 9.5, name, family=fam)
    path = tmp_path / "a8w8_tuned_gemm.csv"
    ConfigTable([row], family=fam).write(str(path))
    back = ConfigTable.load(str(path), "a8w8").rows[0]
    assert (back.libtype, back.kernel_name, back.key) == ("blaslt", name, key)
    gemmtune.set_config(str(path))
    res = gemmtune.resolve(key, cpu, family="a8w8")
    assert res.row is not None and res.solution.libtype == "torch"
    assert "fallback" in res.note and "blaslt (a8w8)" in res.note


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.fixture
def lt(usable):
    return usable(qb.BlasLtA8W8Backend())


def _rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _fp8_zeros(numel: int, device) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.uint8, device=device).view(FP8)


def _poison(m, n, device) -> None:
    """Fill the caching allocator's next blocks with NaN (0xFF bytes) so an unwritten output shows."""
    torch.empty(m * n * 4, dtype=torch.uint8, device=device).fill_(255)


# Must have candidates: bf16 out, as the probe ran it. Elsewhere cuBLASLt decides, and a case with none
# is skipped saying so.
def _required(scale, bias, out) -> bool:
    return out == BF16 and not bias


FAST_REL = 1e-2  # FAST_ACCUM's error bound against the fp32 reference (the probe: 2-3.6e-3 in bf16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", tiered([1, 7, 33, 1000], lambda m: m in (7, 1000)))
@pytest.mark.parametrize("out", tiered([BF16, FP16, FP32], lambda o: o == BF16), ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scale", ["per_token", "per_tensor"])
def test_gpu_candidates_match_the_dequantized_reference(lt, gpu, scale, bias, out, m):
    from gemmtune.families import get
    from gemmtune.tuner.check import check_runner

    fam = get("a8w8")
    key = _key(m, 1040, 1152, scale, bias, out)
    sols = lt.candidates(key, gpu)
    plain = [s for s in sols if not s.kernel_name.endswith("_fa")]
    fast = [s for s in sols if s.kernel_name.endswith("_fa")]
    if not sols:
        assert not _required(scale, bias, out), f"cuBLASLt offered no fp8 algorithm for {key.describe()}"
        assert lt.default_solution(key, gpu) is None
        pytest.skip(f"cuBLASLt {bl.lt_version()} offers no fp8 algorithm for {key.describe()}")
    assert plain, [s.kernel_name for s in sols]
    assert lt.default_solution(key, gpu).kernel_name in {s.kernel_name for s in plain}
    if _required(scale, bias, out):
        assert fast and len(plain) > 1, [s.kernel_name for s in sols]  # neighbours beside the heuristic's pick
    inputs = fam.make_inputs(key, gpu, 1, seed=m + int(bias))[0]
    ref = fam.reference(key, inputs)
    for sol in sample_candidates(plain):
        run = lt.make_runner(sol, key, gpu)
        verdict = check_runner(run, key, inputs, ref, family=fam)  # poisoned, padded xq rows, graph
        assert verdict.ok, (sol.kernel_name, key.describe(), verdict.reason)
    for sol in sample_candidates(fast, 3):
        run = lt.make_runner(sol, key, gpu)
        _poison(m, key.N, gpu)
        y = run(*inputs)
        assert y.shape == (m, key.N) and y.dtype == out and not torch.isnan(y).any(), sol.kernel_name
        assert _rel(y, ref) < FAST_REL, (sol.kernel_name, _rel(y, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["per_token", "per_tensor"])
def test_gpu_one_runner_serves_other_ms_and_misaligned_operands(lt, gpu, scale):
    """A runner made for M = 64 runs M = 1, 300 (cuBLASLt's pick where its algorithm does not fit),
    xq with padded rows in place, and through copies a misaligned xq / wq, strided scales and a strided
    bias, into poisoned outputs."""
    from gemmtune.families import get

    fam = get("a8w8")
    key = _key(64, 1040, 1152, scale, True, BF16)
    sols = lt.candidates(key, gpu)
    if not sols:  # no bias epilogue with these scales: the rest still holds
        key = key._replace(bias=False)
        sols = lt.candidates(key, gpu)
    run = lt.make_runner(sols[0], key, gpu)
    for m in (1, 64, 300):
        xq, wq, xs, ws, b = fam.make_inputs(key._replace(M=m), gpu, 1, seed=m)[0]
        ref = fam.reference(key._replace(M=m), (xq, wq, xs, ws, b))
        padded = _fp8_zeros(m * (key.K + 32), gpu).view(m, key.K + 32)[:, : key.K]
        padded.copy_(xq)
        off_x = _fp8_zeros(m * key.K + 8, gpu)[8:].view(m, key.K)  # 8 bytes off its allocation
        off_x.copy_(xq)
        off_w = _fp8_zeros(key.N * key.K + 8, gpu)[8:].view(key.N, key.K)
        off_w.copy_(wq)
        wide_b = torch.zeros(2 * key.N, dtype=BF16, device=gpu)
        if b is not None:
            wide_b[::2] = b
        if scale == "per_token":
            xs_s = torch.zeros(m, 2, device=gpu)
            xs_s[:, :1] = xs.reshape(m, 1)
            xs_s = xs_s[:, :1]  # [m, 1], row stride 2
            ws_s = torch.zeros(2 * key.N, device=gpu)[1 : key.N + 1]  # 4 bytes off
            ws_s.copy_(ws.reshape(-1))
            ws_s = ws_s.view(1, key.N)
        else:
            xs_s, ws_s = xs, ws
        for args in ((padded, wq, xs, ws, b), (off_x, off_w, xs_s, ws_s, None if b is None else wide_b[::2])):
            _poison(m, key.N, gpu)
            y = run(*args)
            assert y.shape == (m, key.N) and not torch.isnan(y).any(), m
            assert _rel(y, ref) < fam.error_threshold(key), (m, _rel(y, ref))


@pytest.mark.gpu
def test_gpu_tuned_fast_accumulation_row_dispatches_through_gemm_a8w8(lt, gpu, tmp_path):
    import gemmtune
    from gemmtune.configs import ConfigTable, TunedRow
    from gemmtune.device import identity
    from gemmtune.families import get
    from gemmtune.ops.quantized import gemm_a8w8

    fam = get("a8w8")
    key = _key(64, 4096, 1024, "per_token", False, BF16)
    fast = [s for s in lt.candidates(key, gpu) if s.kernel_name.endswith("_fa")]
    assert fast, "cuBLASLt offered no fast-accumulation algorithm"
    sol = fast[0]
    ident = identity(gpu)
    row = TunedRow(ident.gfx, ident.cu_num, key, "blaslt", sol.solidx, sol.splitk, 10.0, sol.kernel_name, family=fam)
    path = tmp_path / "a8w8_tuned_gemm.csv"
    ConfigTable([row], family=fam).write(str(path))
    assert ConfigTable.load(str(path), "a8w8").rows[0].kernel_name == sol.kernel_name
    gemmtune.set_config(str(path))
    res = gemmtune.resolve(key, gpu, family="a8w8")
    assert (res.solution.libtype, res.solution.kernel_name) == ("blaslt", sol.kernel_name), res.note
    xq, wq, xs, ws, _ = fam.make_inputs(key, gpu, 1, 0)[0]
    y = gemm_a8w8(xq, wq, xs, ws, None, BF16)
    assert _rel(y, fam.reference(key, (xq, wq, xs, ws, None))) < FAST_REL
    y3 = gemm_a8w8(xq.view(4, 16, key.K), wq, xs.view(4, 16, 1), ws, None, BF16)  # the same key, 3-D
    assert torch.equal(y3.view(64, key.N), y)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["a8w8", "a8w8_bpreshuffle"])
def test_gpu_untuned_fp8_default_is_cublaslt_heuristic_pick(lt, gpu, family):
    import gemmtune
    from gemmtune import backends
    from gemmtune.families import get
    from gemmtune.ops.quantized import gemm_a8w8, gemm_a8w8_bpreshuffle

    fam = get(family)
    key = _key(1000, 5120, 4096, "per_token", False, BF16)
    want = lt.default_solution(key, gpu, fast=True)  # M 1000: the fast-accumulation pick (policy.py)
    assert want is not None, f"cuBLASLt has no fp8 algorithm for {key.describe()}"
    backend, sol = backends.default(family, key, gpu)
    spec, tag = qb.split_name(sol.kernel_name)
    assert (backend.name, sol, tag) == ("blaslt", want, "_fa") and spec.version == bl.lt_version()
    assert gemmtune.resolve(key, gpu, family=family).solution.libtype == "blaslt"
    xq, wq, xs, ws, b = fam.make_inputs(key, gpu, 1, 0)[0]
    op = gemm_a8w8 if family == "a8w8" else gemm_a8w8_bpreshuffle
    _poison(key.M, key.N, gpu)
    y = op(xq, wq, xs, ws, b, BF16)
    assert not torch.isnan(y).any() and _rel(y, fam.reference(key, (xq, wq, xs, ws, b))) < fam.error_threshold(key)
    # torch._scaled_mm on the same operands (fast accumulation both): the same cuBLASLt numerics
    sm = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=BF16, use_fast_accum=True)
    assert _rel(y, sm) < 1e-2
