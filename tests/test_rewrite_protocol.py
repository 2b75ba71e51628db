"""optimize()'s rewrite protocol (models/rewrite.py): every change is a Rewrite of the one list in
models/plan.py, the planner and optimize() never branch on a rewrite's name, restore() undoes the applied
changes in reverse (a deep copy undoing its own modules), a failure while applying undoes what was applied;
and what a transformers user expects around it: save_pretrained writes stock keys, a model optimized twice
(or inside an optimized one) is told so."""

from __future__ import annotations

import ast
import copy
import importlib
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_parity import build  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.models import plan as plan_mod  # noqa: E402
from gemmtune.models.rewrite import Change, PlanContext, Rewrite  # noqa: E402

SRC = pathlib.Path(gemmtune.__file__).resolve().parent / "models"
LOG: list[tuple[str, str, int]] = []  # (what, rewrite name, id(model)): module-level, so deep copies share it


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _report_words() -> set[str]:
    """Every word a rewrite reports its changes or skips under (its kind, the kinds of ctx.skip calls)."""
    words = {r.kind for r in plan_mod.REWRITES}
    for path in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "skip" and node.args:
                if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    words.add(node.args[0].value)
    return words


def _string_comparisons(source: str, words: set[str]) -> list[str]:
    """Comparisons (==, !=, in, match cases) and dict keys against a string literal in `words`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        consts = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                consts += [e for e in elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.Dict):
            consts = [k for k in node.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.MatchValue):
            consts = [node.value] if isinstance(node.value, ast.Constant) else []
        found += [f"line {c.lineno}: {c.value!r}" for c in consts if c.value in words]
    return found


def test_the_planner_and_optimize_never_branch_on_rewrite_names():
    words = _report_words()
    assert {"fuse", "attn", "norm", "route", "moe_fold", "quantize"} <= words  # the check sees the kinds
    for name in ("api.py", "plan.py", "rewrite.py", "tensor_parallel.py", "sharding.py"):
        hits = _string_comparisons((SRC / name).read_text(encoding="utf-8"), words)
        assert not hits, f"models/{name} branches on rewrite names: {hits}"
    # the checker itself finds such a branch
    assert _string_comparisons("if a.kind == 'fuse':\n    pass\nx = {'moe_fold': 1}", words) == [
        "line 1: 'fuse'",
        "line 3: 'moe_fold'",
    ]


def test_every_rewrite_is_one_object_of_the_one_list():
    for name in [p.stem for p in SRC.glob("*.py")]:
        importlib.import_module(f"gemmtune.models.{name}")
    listed = {type(r) for r in plan_mod.REWRITES}
    assert all(isinstance(r, Rewrite) for r in plan_mod.REWRITES)
    assert len(listed) == len(plan_mod.REWRITES), "a rewrite listed twice"
    concrete = {c for c in _all_subclasses(Rewrite)  # every class of the package that plans changes
                if c.__module__.startswith("gemmtune.") and c.kind and c.plan is not Rewrite.plan}  # fmt: skip
    assert concrete == listed, f"rewrites not in models/plan.py REWRITES: {concrete - listed}"
    for cls in listed:
        for method in ("plan", "apply", "undo"):  # each one plans, applies and undoes (its own or a base's)
            assert getattr(cls, method) is not getattr(Rewrite, method), f"{cls.__name__}.{method}"
    after = [r.after_check for r in plan_mod.REWRITES]
    assert after == sorted(after), "the rewrites applied after the check come last"


class Recorder(Rewrite):
    """Changes the model's root: records its apply / undo, by name, in LOG; fails to apply when told to."""

    kind = "route"  # a report kind that lists the change

    def __init__(self, name: str, fail: bool = False):
        self.name, self.fail = name, fail

    def plan(self, ctx: PlanContext) -> None:
        ctx.add(self, "", ctx.model, f"recorder {self.name}")

    def apply(self, model, change: Change, report) -> None:
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        LOG.append(("apply", self.name, id(model)))
        model.__dict__[f"_recorded_{self.name}"] = True

    def undo(self, model, change: Change) -> str | None:
        LOG.append(("undo", self.name, id(model)))
        model.__dict__.pop(f"_recorded_{self.name}")
        return None


@pytest.fixture
def recorders(monkeypatch):
    LOG.clear()

    def use(*rewrites):
        monkeypatch.setattr(plan_mod, "REWRITES", rewrites)

    yield use
    LOG.clear()


def test_restore_undoes_the_applied_rewrites_in_reverse(recorders):
    recorders(Recorder("a"), Recorder("b"), Recorder("c"))
    model = build("llama")
    report = gemmtune.optimize(model, verify=False)
    assert [w[:2] for w in LOG] == [("apply", "a"), ("apply", "b"), ("apply", "c")]
    assert [c.rewrite.name for c in report._actions] == ["a", "b", "c"]
    LOG.clear()
    gemmtune.restore(model)
    assert LOG == [("undo", "c", id(model)), ("undo", "b", id(model)), ("undo", "a", id(model))]
    assert not any(k.startswith("_recorded") for k in model.__dict__)


def test_a_deep_copy_restores_itself_not_the_original(recorders):
    recorders(Recorder("a"), Recorder("b"))
    model = build("llama")
    gemmtune.optimize(model, verify=False)
    twin = copy.deepcopy(model)
    LOG.clear()
    gemmtune.restore(twin)
    assert LOG == [("undo", "b", id(twin)), ("undo", "a", id(twin))]
    assert model.__dict__["_recorded_a"] and gemmtune.models.report_of(model) is not None


def test_a_failure_while_applying_undoes_the_applied_part_in_reverse(recorders):
    recorders(Recorder("a"), Recorder("b"), Recorder("c", fail=True))
    model = build("llama")
    with pytest.raises(RuntimeError, match="c failed"):
        gemmtune.optimize(model, verify=False)
    assert [w[:2] for w in LOG] == [("apply", "a"), ("apply", "b"), ("undo", "b"), ("undo", "a")]
    assert gemmtune.models.report_of(model) is None


def test_each_rewrite_decides_from_the_architecture_entry():
    from gemmtune.models.architectures import ARCHITECTURES

    base = dict(fuse_qkv=True, fuse_gate_up=True, fused_ops=True, route_linears=True, mla_absorb=True)
    by_kind = lambda arch: {type(r).__name__ for r in plan_mod.REWRITES if r.applies(arch, base)}  # noqa: E731
    assert "MlaAbsorb" in by_kind(ARCHITECTURES["deepseek_v3"]) and "MlaAbsorb" not in by_kind(ARCHITECTURES["llama"])
    assert "QkvFusion" not in by_kind(ARCHITECTURES["phi3"]) and "QkvFusion" in by_kind(ARCHITECTURES["llama"])
    assert "MoeExperts" in by_kind(ARCHITECTURES["mixtral"]) and "MoeExperts" not in by_kind(ARCHITECTURES["qwen3"])
    assert by_kind(None) == {"EpilogueMlp", "LinearRouting", "Fp8CheckpointLinears"}  # an unknown model_type
    quantized = {**base, "quantize": "int8", "quantize_producers": True, "quantize_lm_head": False}
    assert "QuantizeLinears" in {type(r).__name__ for r in plan_mod.REWRITES if r.applies(None, quantized)}


# ---- what a transformers user expects -----------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"quantize": "int8"}], ids=["fused", "int8"])
def test_save_pretrained_after_optimize_writes_stock_keys(tmp_path, opts):
    from safetensors.torch import load_file

    stock = build("llama")
    model = copy.deepcopy(stock)
    report = gemmtune.optimize(model, verify=False, **opts)
    assert report.counts()["fuse"] == 4  # q/k/v and gate/up of both layers: their keys must split again
    stock.save_pretrained(tmp_path / "stock")
    model.save_pretrained(tmp_path / "optimized")
    want = load_file(tmp_path / "stock" / "model.safetensors")
    got = load_file(tmp_path / "optimized" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # and it loads back into a stock model
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "optimized")
    assert all(torch.equal(p, stock.state_dict()[n]) for n, p in again.state_dict().items())


def test_optimized_twice_or_inside_an_optimized_model_is_told_so():
    model = build("llama")
    first = gemmtune.optimize(model.model)  # the decoder stack alone is a PreTrainedModel too
    assert first.counts()["fuse"] == 4
    with pytest.raises(ValueError, match=r"model is already optimized by gemmtune.optimize; call "
                       r"gemmtune.restore\(model.model\) first"):  # fmt: skip
        gemmtune.optimize(model)
    assert gemmtune.optimize(model.model) is first  # the same call again: its report, nothing changed
    gemmtune.restore(model.model)
    assert gemmtune.optimize(model).counts()["fuse"] == 4


# ---- tensor parallel: each rewrite says how its change runs on sharded modules ------------------
def _sharding(plan: dict):
    from gemmtune.models.sharding import Sharding

    return Sharding(plan, mesh=None, hooked=set(plan))


def test_a_rewrite_that_does_not_say_how_it_runs_sharded_leaves_its_change_stock():
    rewrite = Recorder("a")  # the report word "route", but not LinearRouting: the word decides nothing
    sharding = _sharding({"m.x": "colwise"})
    why, around = rewrite.on_sharded(None, sharding, Change(rewrite, "m", {}))
    assert around is None and why == "tensor parallel: a route change over sharded modules (m.x 'colwise')"
    assert rewrite.on_sharded(None, sharding, Change(rewrite, "mx", {})) == (None, None)  # a sibling, not inside
    assert rewrite.on_sharded(None, sharding, Change(rewrite, "", {}))[0] == why  # the model holds every module


def _around_wrapped():
    from gemmtune.models import dense, moe_block
    from gemmtune.models.attention_tier import AttentionTier
    from gemmtune.models.mask_positions import OwnPositions

    return [dense.AttentionForward(), dense.MlpForward(), dense.LayerForward(), moe_block.Router(), OwnPositions(),
            AttentionTier()]  # fmt: skip


@pytest.mark.parametrize("rewrite", _around_wrapped(), ids=lambda r: type(r).__name__)
def test_a_forward_around_wrapped_submodules_runs_unless_its_module_is_planned(rewrite):
    sharding = _sharding({"m.a.q_proj": "colwise", "m.b": "rowwise"})
    assert rewrite.on_sharded(None, sharding, Change(rewrite, "m.a", {})) == (None, None)
    why, around = rewrite.on_sharded(None, sharding, Change(rewrite, "m.b", {}))
    assert why == "tensor parallel: the module itself is planned 'rowwise'" and around is None


def test_linear_routing_and_moe_experts_say_which_wrapper_goes_back():
    from gemmtune.models.linear import LinearRouting
    from gemmtune.models.moe_block import MoeExperts

    route = LinearRouting()
    sharding = _sharding({"m.o": "rowwise", "m.g": "local_packed_rowwise"})
    assert route.on_sharded(None, sharding, Change(route, "m.o", {}))[1].rewrap == "rowwise"
    why, around = route.on_sharded(None, sharding, Change(route, "m.g", {}))
    assert around is None
    assert why == "tensor parallel: plan entry 'local_packed_rowwise' is not a linear style gemmtune routes"
    assert route.on_sharded(None, sharding, Change(route, "m.q", {})) == (None, None)

    model = torch.nn.Module()
    model.experts = torch.nn.Module()  # plain parameters: not split over the expert dimension
    moe = MoeExperts()
    tp = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}
    assert moe.on_sharded(model, _sharding(tp), Change(moe, "experts", {}))[1].rewrap == "moe_tp_experts"
    why, around = moe.on_sharded(model, _sharding({**tp, "experts.down_proj": "colwise"}), Change(moe, "experts", {}))
    assert around is None and "gemmtune swaps only" in why and "'down_proj': 'colwise'" in why


def test_the_changes_a_left_out_one_takes_with_it_come_from_the_rewrites():
    from gemmtune.models import dense
    from gemmtune.models.linear import LinearRouting
    from gemmtune.models.tensor_parallel import _dependents

    fuse = Change(dense.QkvFusion(), "l1.attn", {"names": ("q", "k", "v"), "fused": "qkv_proj"})
    attn = Change(dense.AttentionForward(), "l1.attn", {})
    gate_up = Change(dense.GateUpFusion(), "l1.mlp", {"names": ("gate", "up"), "fused": "gate_up_proj"})
    mlp = Change(dense.MlpForward(), "l1.mlp", {})
    norm = Change(dense.Norms(), "l1.post_attention_layernorm", {})
    layer, other_layer = Change(dense.LayerForward(), "l1", {}), Change(dense.LayerForward(), "l10", {})
    route = Change(LinearRouting(), "l1.attn.o_proj", {})
    changes = [fuse, attn, gate_up, mlp, norm, layer, other_layer, route]
    assert _dependents(changes, [fuse]) == [attn]  # a fused forward without its fusion
    assert _dependents(changes, [attn]) == [fuse]  # the stock forward reads the parts the fusion took
    assert _dependents(changes, [gate_up]) == [mlp] and _dependents(changes, [mlp]) == [gate_up]
    assert _dependents(changes, [norm]) == [layer]  # only the layer that holds the norm
    assert _dependents(changes, [route]) == [] and _dependents(changes, [layer]) == []
