"""The torch._scaled_mm block-scaled candidate (backends/lib/scaled_mm_blockwise.py) on the CPU, against a stand-in for
torch._scaled_mm that checks what torch checks and reads the scales the way cuBLASLt does (weight-scale
rows round_up(K/128, 4) apart in memory, whatever the strides say): the probe must find which layout a
torch release wants, refuse one that gives wrong answers, and report alignment and output dtypes; the
runner must be right for every scale layout, odd M, N not a multiple of 128, K/128 not a multiple of 4,
with a NaN-poisoned output. Plus the scale-layout helpers and the backend's wiring."""

from __future__ import annotations

import pytest
import torch

from gemmtune import backends, families
from gemmtune.backends.lib import scaled_mm_blockwise as blockwise
from gemmtune.backends.quantized import pytorch as bq
from gemmtune.families.quantized import FP8, BlockKey
from gemmtune.kernels.blockscale import blockscale_ref
from gemmtune.quant.layouts import is_k_padded, is_m_major, k_padded, m_major, round_up

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def fake_scaled_mm(row_check="padded", m_align=1, ragged_n=True, outs=(torch.bfloat16, torch.float16, torch.float32)):
    """torch._scaled_mm's 1x128 x 128x128 path as torch checks it (row_check: the weight-scale row
    stride a torch release accepts, "padded" = round_up(K/128, 4), "packed" = K/128) and as cuBLASLt
    computes it (rows read round_up(K/128, 4) apart from the first scale)."""

    def mm(a, b, scale_a, scale_b, out_dtype, out=None):
        m, k = a.shape
        n = b.shape[1]
        kb, nb = k // 128, -(-n // 128)
        l4 = round_up(kb, 4)
        sbt = scale_b.t()
        row = l4 if row_check == "padded" else kb
        ok_b = tuple(sbt.shape) == (nb, kb) and (kb <= 1 or sbt.stride(1) == 1) and (nb <= 1 or sbt.stride(0) == row)
        if not (tuple(scale_a.shape) == (m, kb) and is_m_major(scale_a) and ok_b):
            raise RuntimeError("Invalid scaling configuration")
        if m % m_align or (n % 128 and not ragged_n) or out_dtype not in outs:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        # cuBLASLt's read: scale (n, g) at offset n * l4 + g from the first one (past the end: garbage 0)
        flat = sbt.as_strided((sbt.untyped_storage().nbytes() // 4 - sbt.storage_offset(),), (1,))
        buf = torch.zeros(nb * l4 + kb)
        buf[: min(len(flat), len(buf))] = flat[: len(buf)]
        y = blockscale_ref(a, b.t(), scale_a, buf.as_strided((nb, kb), (l4, 1)), out_dtype)
        return y if out is None else out.copy_(y)

    return mm


def _inputs(m, n, k, seed=0):
    fam = families.get("a8w8_blockscale")
    key = BlockKey(m, n, k, FP8, torch.bfloat16)
    inputs = fam.make_inputs(key, torch.device("cpu"), 1, seed)[0]
    return fam, key, inputs


# ---- layouts ------------------------------------------------------------------------------------
def test_scale_layout_helpers():
    xs = torch.randn(5, 3)
    mm = m_major(xs)
    assert is_m_major(mm) and not is_m_major(xs) and torch.equal(mm, xs) and mm.stride() == (1, 5)
    assert m_major(mm) is mm and is_m_major(torch.randn(1, 3)) and is_m_major(torch.randn(5, 1))
    ws = torch.randn(4, 3)
    kp = k_padded(ws)
    assert is_k_padded(kp) and kp.stride() == (4, 1) and torch.equal(kp, ws) and k_padded(kp) is kp
    assert is_k_padded(torch.randn(4, 8)) and k_padded(torch.randn(1, 3)).shape == (1, 3)


def test_family_inputs_use_the_model_layouts_and_variants_the_plain_ones():
    fam, key, (xq, wq, xs, ws) = _inputs(37, 400, 384)
    assert is_m_major(xs) and is_k_padded(ws) and ws.stride(0) == 4
    ((_, (_, _, xs2, ws2), _),) = fam.check_variants(key, (xq, wq, xs, ws))
    assert xs2.is_contiguous() and ws2.is_contiguous() and torch.equal(xs2, xs) and torch.equal(ws2, ws)


# ---- probe --------------------------------------------------------------------------------------
def test_probe_finds_the_padded_layout_and_everything_else():
    s = blockwise.probe(torch.device("cpu"), fake_scaled_mm("padded"))
    assert s.ok and s.pad_k is True and s.m_align == 1 and s.ragged_n
    assert set(s.out_dtypes) == {torch.bfloat16, torch.float16, torch.float32}
    assert s.fits(37, 400, 384, torch.bfloat16) and not s.fits(37, 401, 384, torch.bfloat16)
    assert "rows padded to 4" in s.describe()


def test_probe_refuses_a_packed_layout_that_computes_wrong():
    # A torch release that checks the packed row stride while cuBLASLt reads padded rows: right only
    # when K/128 % 4 == 0, so the candidate is offered only there.
    s = blockwise.probe(torch.device("cpu"), fake_scaled_mm("packed"))
    assert s.ok and s.pad_k is None
    assert s.fits(64, 256, 512, torch.bfloat16) and not s.fits(64, 256, 384, torch.bfloat16)


def test_probe_records_alignment_and_output_limits():
    s = blockwise.probe(torch.device("cpu"), fake_scaled_mm("padded", m_align=16, ragged_n=False,
                                                           outs=(torch.bfloat16,)))  # fmt: skip
    assert s.ok and s.m_align == 16 and not s.ragged_n and s.out_dtypes == (torch.bfloat16,)
    assert not s.fits(37, 256, 512, torch.bfloat16) and s.fits(48, 256, 512, torch.bfloat16)
    assert not s.fits(48, 400, 512, torch.bfloat16) and not s.fits(48, 256, 512, torch.float32)


def test_probe_reports_why_it_is_unavailable():
    def broken(*a, **k):
        raise RuntimeError("scaled_gemm with 128x128 blockwise scaling is only supported for CUDA 12.9 and above")

    s = blockwise.probe(torch.device("cpu"), broken)
    assert not s.ok and "CUDA 12.9" in s.reason and not s.fits(64, 256, 512, torch.bfloat16)
    assert "unavailable" in s.describe()
    wrong = blockwise.probe(torch.device("cpu"), lambda a, b, scale_a, scale_b, out_dtype, out: out.fill_(1.0))
    assert not wrong.ok and "wrong result" in wrong.reason


# ---- the runner ---------------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k", [(1, 256, 512), (37, 400, 384), (300, 1000 + 24, 1024), (16, 128, 128)])
def test_runner_matches_reference_for_every_layout_nan_poisoned(m, n, k, monkeypatch):
    monkeypatch.setattr(blockwise, "_empty", lambda shape, like, dtype: torch.full(shape, float("nan"), dtype=dtype))
    fam, key, inputs = _inputs(m, n, k, seed=m)
    ref = fam.reference(key, inputs)
    mm = fake_scaled_mm("padded")
    for what, ins, shape in [("model layouts", inputs, (m, n)), *fam.check_variants(key, inputs)]:
        y = blockwise.scaled_mm_blockwise(*ins, torch.bfloat16, True, mm)
        assert y.shape == shape and not torch.isnan(y).any(), what
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < fam.error_threshold(key), (what, err)


def test_backend_offers_the_candidate_where_the_probe_says_so(monkeypatch):
    be = backends.get("torch", "a8w8_blockscale")
    dev = torch.device("cpu")
    key = BlockKey(64, 4096, 4096, FP8, torch.bfloat16)
    assert bq.SCALED_MM_BLOCKWISE not in be.candidates(key, dev)  # no GPU here
    from gemmtune import device

    monkeypatch.setattr(device, "vendor", lambda d=None: device.NVIDIA)  # the vocabulary answers a GPU
    support = blockwise.BlockwiseSupport(True, "", None, 16, False, (torch.bfloat16,))
    monkeypatch.setattr(blockwise, "cuda_support", lambda index: support)
    assert be.candidates(key, dev)[0] == bq.SCALED_MM_BLOCKWISE
    for bad in (key._replace(M=37), key._replace(N=4000), key._replace(K=384), key._replace(outdtype=torch.float16),
                key._replace(q_dtype_w=torch.int8)):  # fmt: skip
        assert bq.SCALED_MM_BLOCKWISE not in be.candidates(bad, dev), bad
    # the name before the probe worked still parses (no table should have it, but never fail on it)
    assert be.solution_from_row(0, "scaled_mm_block", 0) == bq.SCALED_MM_BLOCKWISE
    assert be.solution_from_row(bq.SCALED_MM_BLOCKWISE.solidx, "scaled_mm_blockwise", 0) == bq.SCALED_MM_BLOCKWISE
