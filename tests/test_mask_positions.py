"""optimize() builds the causal mask of a forward whose position ids the model makes itself without
transformers' packed-sequence check (models/mask_positions.py): that check syncs the host with the GPU on
every prefill without a mask or a cache, and on the model's own positions it always finds "not packed".

Counted here by wrapping transformers' find_packed_sequence_indices: the optimized model skips it on its
own positions and still runs it on positions a caller passes (packed sequences then get their mask, as
stock gets it); a stock model next to it keeps its check; logits equal stock's either way; restore()
gives the stock forward back. Tiny random models of test_models_parity.py, CPU, fp32.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

from test_models_parity import ARCHITECTURES, build, pair  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.models import mask_positions  # noqa: E402

# two sequences of 5 and 4 tokens packed into each row
PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]] * 2)


@pytest.fixture
def packed_checks(monkeypatch):
    """How many times transformers looked for packed sequences."""
    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: calls.append(p.shape) or real(p))
    return calls


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_own_positions_skip_the_check_and_keep_the_logits(arch, packed_checks):
    stock, opt, report = pair(arch)
    assert report.counts().get("positions") == 1, report.summary()
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    want = _logits(stock, ids)
    stock_checks = len(packed_checks)
    assert stock_checks >= 1  # stock: a sync on every such forward (one per mask it builds: Gemma 2/3 two)
    got = _logits(opt, ids)
    assert len(packed_checks) == stock_checks, "the optimized model looked for packed sequences in its own positions"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_callers_packed_positions_are_still_checked(arch, packed_checks):
    stock, opt, _ = pair(arch)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(stock, ids, position_ids=PACKED)
    got = _logits(opt, ids, position_ids=PACKED)
    assert len(packed_checks) == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    unpacked = _logits(stock, ids)
    assert (unpacked - want).abs().max() > 1e-2  # the packed mask changed the answer: the test can see it


def test_a_stock_model_beside_an_optimized_one_keeps_its_check(packed_checks):
    stock, opt, _ = pair("llama")
    other = build("qwen3")  # its modeling module's builders are not wrapped; llama's are
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    _logits(opt, ids)
    _logits(stock, ids)
    _logits(other, ids)
    assert len(packed_checks) == 2


def test_a_failed_forward_leaves_no_mark(packed_checks):
    stock, opt, _ = pair("llama")
    with pytest.raises(Exception):  # noqa: B017,PT011 - whatever the model raises on a bad input
        _logits(opt, torch.zeros(1, 3, 4, dtype=torch.long))
    _logits(stock, torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)))
    assert len(packed_checks) == 1


def test_restore_gives_back_the_stock_forward(packed_checks):
    stock, opt, _ = pair("llama")
    gemmtune.restore(opt)
    assert not any(k in opt.model.__dict__ for k in mask_positions.UNDO_ATTRS)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_logits(opt, ids), _logits(stock, ids))
    assert len(packed_checks) == 2


def test_a_stack_without_mask_builders_is_left_alone_with_the_reason():
    class Stack(torch.nn.Module):
        def forward(self, x, position_ids=None):
            return x

    assert "builds no causal mask by name" in mask_positions.plan(Stack())


def test_fused_ops_off_leaves_the_stack_alone():
    _, opt, report = pair("llama", fused_ops=False)
    assert "positions" not in report.counts() and "forward" not in opt.model.__dict__
    assert any(why == "fused_ops=False" for what, why in report.skipped if what.startswith("positions"))
