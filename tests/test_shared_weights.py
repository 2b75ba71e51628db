"""bench-model's shared-weights mode: when contender copies of a model would not fit the device, they
share stock's parameters, and a parameter written in place is caught (profiling/shared_weights.py)."""

from __future__ import annotations

import pytest
import torch
from cli_cases import bench_model_report

from gemmtune.profiling import bench_model, shared_weights

GIB = 2**30


def test_sharing_rule_counts_every_copy_against_the_device():
    # DeepSeek-V3 cut to 1 dense + 3 MoE layers: ~74.7 GiB of bf16 weights on an 80 GB H100 (79.2 GiB)
    assert shared_weights.sharing_reason(int(74.7 * GIB), 1, int(79.2 * GIB)).startswith("the contenders share")
    # Llama-3-8B cut to 4 layers (3.6 GiB): stock + optimize + quantize copies fit
    assert shared_weights.sharing_reason(int(3.6 * GIB), 2, int(79.2 * GIB)) == ""
    assert shared_weights.sharing_reason(int(30 * GIB), 1, int(79.2 * GIB)) == ""  # 60 GiB: fits 85%
    assert shared_weights.sharing_reason(int(30 * GIB), 2, int(79.2 * GIB)) != ""  # 90 GiB does not
    assert shared_weights.sharing_reason(int(500 * GIB), 0, int(79.2 * GIB)) == ""  # no copies: nothing shared


def test_shared_copy_reuses_parameters_and_a_plain_copy_does_not():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    shared = shared_weights.copy_model(model, share=True)
    assert all(a is b for a, b in zip(model.parameters(), shared.parameters()))
    assert shared is not model and shared[0] is not model[0]  # the modules are the copy's own
    plain = shared_weights.copy_model(model, share=False)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), plain.parameters()))


def test_fingerprint_catches_an_in_place_write_and_names_the_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2).to(torch.bfloat16))
    marks = shared_weights.fingerprint(model)
    shared_weights.check_unchanged(marks, model)  # untouched: passes
    copy = shared_weights.copy_model(model, share=True)
    copy[1].weight = torch.nn.Parameter(copy[1].weight.detach() * 2)  # a new tensor, as optimize() makes: fine
    shared_weights.check_unchanged(marks, model)
    with torch.no_grad():
        copy[1].bias.data[0] += 1  # one element written in place through the copy
    with pytest.raises(RuntimeError, match=r"parameter 1\.bias of the stock model changed"):
        shared_weights.check_unchanged(marks, model)


def test_bench_model_in_shared_mode_reports_it_and_keeps_parity(tmp_path, monkeypatch):
    """The CPU run forced into the shared mode: optimize() and quantize copies built on stock's parameters,
    decode parity holds, and the report says the weights were shared."""
    pytest.importorskip("transformers")  # a model test too: CI runs it on the oldest and newest
    forced = "the contenders share stock's parameters: forced by the test"
    monkeypatch.setattr(bench_model, "must_share", lambda model, copies: forced if copies else "")
    out = tmp_path / "bm"
    data = bench_model_report(out, "--reps", "1", "--contenders", "stock,optimize", "--quantize", "fp8", "--no-profile")
    assert all(p["ok"] for p in data["decode_parity"].values()), data["decode_parity"]
    assert forced in (out / "report.md").read_text()
