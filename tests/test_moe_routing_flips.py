"""Decode parity's MoE routing-flip rule (profiling/moe_routing.py): a step over the tolerance is
explained only by a flip whose block input was right and whose router agrees on the reference's input.
Tiny Qwen3-MoE (8 experts, top 2), fp32, CPU."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")  # a model test: CI runs it on the oldest and newest

from test_models_parity import build, tiny_config  # noqa: E402

from gemmtune.cli.main import cli  # noqa: E402
from gemmtune.profiling.bench_model import DecodeParity  # noqa: E402
from gemmtune.profiling.moe_routing import Flip, ForcedRouting, RoutingTrace, explain, moe_blocks  # noqa: E402

TOL = 3e-2


def _traced(model, steps=3):
    """A trace of `steps` forwards (prompt of 6 tokens, then one token each)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad(), RoutingTrace(model) as trace:
        for t in range(steps):
            model(input_ids=torch.randint(3, 200, (1, 6 if t == 0 else 1), generator=g), use_cache=False)
    return trace


def _flip_ids(trace, name, step):
    """The trace as if step's first token had picked another expert in block `name`."""
    out = copy.copy(trace)
    out.ids = {n: list(v) for n, v in trace.ids.items()}
    ids = out.ids[name][step].clone()
    spare = next(e for e in range(8) if e not in ids[0].tolist())
    ids[0, 0] = spare
    out.ids[name][step] = ids.sort(dim=-1).values
    return out


def test_trace_records_each_forward_of_each_block():
    model = build("qwen3_moe")
    trace = _traced(model)
    names = [n for n, _, _ in moe_blocks(model)]
    assert names and all(len(trace.ids[n]) == 3 and len(trace.inputs[n]) == 3 for n in names)
    assert trace.ids[names[0]][0].shape == (6, 2) and trace.ids[names[0]][1].shape == (1, 2)
    assert all(not h for h in [model._forward_pre_hooks for _, model, _ in moe_blocks(model)])  # hooks removed


def test_a_flip_with_a_right_input_and_an_agreeing_router_is_explained():
    model = build("qwen3_moe")
    ref = _traced(model)
    name = moe_blocks(model)[0][0]
    got = _flip_ids(ref, name, 1)
    got.inputs = {n: [x + 1e-4 * x.std() for x in v] for n, v in ref.inputs.items()}  # rounding-sized
    flip = explain(1, ref, got, model, TOL)
    assert isinstance(flip, Flip) and flip.step == 1 and flip.block == name and 0 < flip.input_rel_err < 1e-3
    assert explain(2, ref, got, model, TOL) is None  # routing equal on that step: nothing to explain


def test_a_flip_from_a_wrong_input_or_a_wrong_router_is_not_explained():
    model = build("qwen3_moe")
    ref = _traced(model)
    name = moe_blocks(model)[0][0]
    got = _flip_ids(ref, name, 1)
    far = copy.copy(got)
    far.inputs = {n: [torch.randn_like(x) for x in v] for n, v in ref.inputs.items()}  # a lost cache's input
    assert explain(1, ref, far, model, TOL) is None
    broken = copy.deepcopy(model)  # a router that disagrees on the same input
    block = dict((n, b) for n, b, _ in moe_blocks(broken))[name]
    with torch.no_grad():
        block.gate.weight.copy_(block.gate.weight.roll(1, 0))  # expert e scores as e+1 did
    assert explain(1, ref, got, broken, TOL) is None
    assert explain(1, ref, got, model, TOL) is not None  # the same traces with the right router: explained


def test_parity_verdict_counts_explained_steps_and_caps_them():
    p = DecodeParity(TOL, errors=[0.01, 0.12, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01], agree=[True] * 8)
    assert not p.ok
    p.flips = [Flip(1, "model.layers.0.mlp", 0.004)]
    assert p.ok and "1 step(s) over it explained by MoE routing flips" in p.verdict()
    assert "max step rel err 0.01 " in p.verdict() and "up to 0.12" in p.verdict()
    p.errors[5] = 0.2
    assert not p.ok  # an unexplained step still fails
    p.errors[5] = 0.01
    p.flips = [Flip(i, "b", 0.0) for i in (1, 2, 3)]  # 3 of 8 steps: more than one in 4
    assert not p.ok
    assert json.dumps(p.as_dict())
    one = DecodeParity(TOL, errors=[0.2, 0.3], agree=[False, False], flips=[Flip(0, "b", 0.0), Flip(1, "b", 0.0)])
    assert not one.ok and one.verdict().startswith("MISMATCH")  # every step a flip: no crash, not ok


def test_with_the_routing_forced_every_step_must_agree():
    """Flips beyond one step in four pass only when the run with the reference's routing forced has every
    step within the tolerance (the flips were the only difference)."""
    errors = [0.01, 0.12, 0.2, 0.09, 0.01, 0.01, 0.01, 0.01]
    p = DecodeParity(TOL, errors=errors, agree=[True] * 8, flips=[Flip(i, "b", 0.01) for i in (1, 2, 3)])
    assert not p.ok  # over the cap, nothing forced
    p.forced = [0.01] * 8
    assert p.ok and "expert choices forced on every MoE block, max step rel err 0.01" in p.verdict()
    p.forced[4] = 0.05
    assert not p.ok  # an error that stays with the reference's routing is the contender's own
    assert json.loads(json.dumps(p.as_dict()))["forced_routing_step_rel_err"][4] == 0.05


def test_forced_routing_replays_the_reference_choices():
    """A contender whose router is wrong (expert e scores as e+1 did) computes the reference's logits
    exactly when the reference's routing is forced on it, and `complete` says every call was forced."""
    model = build("qwen3_moe")
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(3, 200, (1, 6 if t == 0 else 1), generator=g) for t in range(3)]

    def run(m, ctx):
        with torch.no_grad(), ctx:
            return [m(input_ids=x, use_cache=False).logits for x in ids]

    ref_trace = RoutingTrace(model)
    want = run(model, ref_trace)
    broken = copy.deepcopy(model)
    for _, block, _ in moe_blocks(broken):
        with torch.no_grad():
            block.gate.weight.copy_(block.gate.weight.roll(1, 0))
    plain = run(broken, RoutingTrace(broken))
    assert not all(torch.allclose(a, b) for a, b in zip(plain, want))
    forcing = ForcedRouting(broken, ref_trace)
    forced = run(broken, forcing)
    assert forcing.complete and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(forced, want))
    assert all(not e._forward_pre_hooks for _, _, e in moe_blocks(broken))  # hooks removed
    assert not ForcedRouting(broken, ref_trace).complete  # not run: nothing forced


def test_bench_model_traces_a_moe_model_on_the_cpu(tmp_path):
    """bench-model on a tiny Qwen3-MoE config: stock and optimize() traced, parity ok, flips reported."""
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config("qwen3_moe").to_json_string())
    out = tmp_path / "bm"
    args = ["bench-model", "--device", "cpu", "--model", str(cfg), "--layers", "2", "--prefill", "1x16",
            "--ctx", "16", "--batches", "1", "--reps", "1", "--contenders", "stock,optimize", "--no-profile",
            "-o", str(out)]  # fmt: skip
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    data = json.loads((out / "report.json").read_text())
    p = data["decode_parity"]["optimize"]
    assert p["ok"] and p["routing_flips"] == [], p
