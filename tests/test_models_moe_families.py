"""optimize() on the MoE families beyond Mixtral / Qwen3-MoE: Qwen2-MoE (shared expert with a sigmoid
gate), DeepSeek-V3 (grouped sigmoid routing with e_score_correction_bias and routed_scaling_factor,
shared experts, first_k_dense_replace dense layers, MLA attention), OLMoE (full-width q/k norms),
GLM-4-MoE (partial rotary, optional q/k norms, DeepSeek-style routing) and GraniteMoE (residual
multipliers, block_sparse_moe / router names). Tiny random models of tests/data/models/tiny-moe (CPU,
fp32) against stock: logits of a padded batch, greedy tokens generated on the KV cache and every
teacher-forced cached decode step (test_models_parity.check_parity). Also: which parts stay stock and
why, the real-size presets against the modules transformers builds, and gpt-oss left alone."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_parity import check_parity  # noqa: E402
from tiers import tiered  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.kernels import moe_route  # noqa: E402
from gemmtune.models import moe as moe_mod  # noqa: E402
from gemmtune.models.version import MAX_EXCLUSIVE, MIN_VERSION, _parse  # noqa: E402
from gemmtune.tuner.model_shapes import PRESETS, model_gemms, moe_keys  # noqa: E402

if not (MIN_VERSION <= _parse(transformers.__version__) < MAX_EXCLUSIVE):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range", allow_module_level=True)

TINY = pathlib.Path(__file__).resolve().parent / "data" / "models" / "tiny-moe"
FAMILIES = ["qwen2-moe", "deepseek-v3", "olmoe", "glm4-moe", "granitemoe"]
_NOT_CONFIG = ("architectures", "model_type", "torch_dtype")
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def family_config(name: str, **overrides):
    """The tiny config of `name` in its own config class; the test skips where this transformers lacks it."""
    raw = json.loads((TINY / f"{name}.json").read_text())
    mt = raw["model_type"]
    if mt not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {mt}")
    sizes = {k: v for k, v in raw.items() if k not in _NOT_CONFIG}
    return transformers.AutoConfig.for_model(mt, **{**sizes, **_IDS, **overrides})


def build(name: str, seed: int = 0, **overrides):
    """A random fp32 model: norms, biases, routers and DeepSeek's e_score_correction_bias randomized too,
    so weighted norms, biases and every routing path are exercised (the router init leaves ties)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(name, **overrides)).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", ".bias", "gate.weight", "router.weight")):
                p.normal_(0.0, 0.2 if pname.endswith(("norm.weight", ".bias")) else 1.0)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def pair(name: str, **overrides):
    stock = build(name, **overrides)
    opt = copy.deepcopy(stock)
    return stock, opt, gemmtune.optimize(opt)


def moe_blocks(model) -> list:
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")]


def skipped(report, kind: str) -> list[str]:
    return [why for what, why in report.skipped if what.startswith(kind)]


# ---- every family: the experts go to fused_moe, parity on the cached decode path ----------------
# DeepSeek-V3's parity (without q LoRA) and OLMoE's optimize() keep tests of their own in the default tier.
@pytest.mark.parametrize("name", tiered(FAMILIES, lambda n: n not in ("deepseek-v3", "olmoe")))
def test_family_parity_on_cached_decode(name, monkeypatch):
    stock, opt, report = pair(name)
    blocks = moe_blocks(opt)
    assert blocks and report.counts().get("moe") == len(blocks), report.summary()
    assert all("forward" in b.experts.__dict__ for b in blocks)
    assert not skipped(report, "verify"), report.summary()
    calls = []
    real = moe_mod.fused_moe
    monkeypatch.setattr(moe_mod, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    check_parity(stock, opt)
    assert len(calls) > len(blocks) and 3 in calls, calls  # the decode steps (batch 3, one token) ran it too


@pytest.mark.parametrize("name", FAMILIES)
def test_family_restore_gives_back_stock(name):
    stock, opt, _ = pair(name)
    gemmtune.restore(opt)
    assert not any(k.startswith("_gemmtune") or k == "forward" for m in opt.modules() for k in m.__dict__)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(opt(ids).logits, stock(ids).logits)


# ---- what stays stock, per family ----------------------------------------------------------------
def test_qwen2_moe_shared_expert_is_fused_and_its_gate_stays_torch():
    """Where the router's top-k kernel does not run (here) the block is not folded (where it runs:
    test_models_moe_shared.py): its shared expert is a dense MLP."""
    stock, opt, report = pair("qwen2-moe")
    assert any("the experts or the softmax top-k router stay stock" in w for w in skipped(report, "moe_fold"))
    dense, sparse = opt.model.layers  # mlp_only_layers=[0]
    assert hasattr(dense.mlp, "gate_up_proj")  # the dense MLP is fused like Qwen2's
    assert "forward" in opt.model.layers[0].self_attn.__dict__  # Qwen2 attention: fused q/k/v
    block = sparse.mlp
    assert "forward" not in block.__dict__  # the block's own forward: shared expert + sigmoid gate in torch
    shared = block.shared_expert  # every token runs it: fused gate/up and the act*mul kernel, as a dense MLP
    assert "gate_proj" not in shared._modules and hasattr(shared, "gate_up_proj") and "forward" in shared.__dict__
    assert "forward" in shared.down_proj.__dict__  # routed through gemmtune's GEMM
    gate = block.shared_expert_gate  # the N=1 sigmoid gate stays a torch Linear
    assert not any(k.startswith("_gemmtune") or k == "forward" for k in gate.__dict__)
    assert report.counts()["moe"] == 1


def test_deepseek_v3_absorbs_mla_by_default_and_keeps_it_stock_on_request():
    _, opt, report = pair("deepseek-v3")
    assert all("forward" in layer.self_attn.__dict__ for layer in opt.model.layers)
    assert report.counts().get("mla") == len(opt.model.layers), report.summary()
    opt = build("deepseek-v3")
    report = gemmtune.optimize(opt, mla_absorb=False)
    assert all("forward" not in layer.self_attn.__dict__ for layer in opt.model.layers)
    assert "mla" not in report.counts()


def test_deepseek_v3_mla_decodes_on_the_latent_cache(monkeypatch):
    """optimize(mla_absorb=True) swaps MLA's forward (models/mla.py): forwards of <= 16 new tokens run the
    absorbed attention, a longer prefill the stock forward; parity on the cached decode path holds."""
    from gemmtune.models import mla

    stock = build("deepseek-v3")
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt, mla_absorb=True)
    layers = opt.model.layers
    assert hasattr(layers[0].mlp, "gate_up_proj") and not hasattr(layers[0].mlp, "experts")  # first_k_dense
    for layer in layers:
        attn = layer.self_attn
        assert "forward" in attn.__dict__ and attn._gemmtune_mla.rank == attn.kv_lora_rank
        assert "forward" in attn.kv_a_layernorm.__dict__ and "forward" in attn.q_a_layernorm.__dict__
    assert report.counts().get("mla") == len(layers), report.summary()
    seen = []
    real = mla.absorbed_attention
    monkeypatch.setattr(mla, "absorbed_attention", lambda *a: seen.append(tuple(a[1].shape)) or real(*a))
    check_parity(stock, opt)  # padded prefill of 11 tokens (absorbed: <= 16), then one token a step
    assert {L for _, _, L, _ in seen} >= {1, 11}, seen
    seen.clear()
    stock_calls = []
    real_stock = mla._stock
    monkeypatch.setattr(mla, "_stock", lambda *a: stock_calls.append(1) or real_stock(*a))
    ids = torch.randint(3, 256, (1, mla.ABSORB_MAX_Q + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-5)
    # 17 new tokens: stock's prefill math on the expanded keys (the rope kernel's, the query built in place)
    assert not seen and not stock_calls
    with torch.enable_grad():  # where gradients may flow, the stock forward itself
        opt(ids)
    assert len(stock_calls) == len(layers)
    for block in moe_blocks(opt):
        assert "forward" not in block.__dict__  # the block's own forward: router, experts, shared experts
        assert ("forward" in block.gate.__dict__) == (moe_mod.triton_reason(block.gate.weight.device) is None)
        assert hasattr(block.shared_experts, "gate_up_proj") and "forward" in block.shared_experts.__dict__
    assert all("the Triton top-k kernel cannot run: " in w for w in skipped(report, "router")), report.summary()
    gemmtune.restore(opt)
    assert not any("forward" in layer.self_attn.__dict__ for layer in opt.model.layers)


def test_deepseek_v3_routing_weights_reach_fused_moe_scaled(monkeypatch):
    """routed_scaling_factor and the bias-corrected group choice come from the stock router: fused_moe
    gets its weights as they are (renormalized, then times 2.5)."""
    stock, opt, _ = pair("deepseek-v3")
    seen = []
    real = moe_mod.fused_moe
    monkeypatch.setattr(moe_mod, "fused_moe", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-5)
    assert seen and all(torch.allclose(w.sum(-1), torch.full_like(w[:, 0], 2.5)) for w in seen)


def test_deepseek_v3_without_q_lora_keeps_parity():
    stock, opt, report = pair("deepseek-v3", q_lora_rank=None)
    assert opt.model.layers[0].self_attn.q_proj is not None
    assert report.counts().get("moe") == 2
    check_parity(stock, opt)


def test_olmoe_keeps_its_attention_and_swaps_its_full_width_norms():
    stock, opt, report = pair("olmoe", clip_qkv=0.5)  # the clamp after the q/k norms runs too
    attn = opt.model.layers[0].self_attn
    assert "forward" not in attn.__dict__ and "qkv_proj" not in attn._modules
    assert "forward" in attn.q_norm.__dict__ and "forward" in attn.k_norm.__dict__
    check_parity(stock, opt)


@pytest.mark.parametrize("use_qk_norm", [True, False])
def test_glm4_moe_qk_norm_follows_the_instance(use_qk_norm):
    stock, opt, report = pair("glm4-moe", use_qk_norm=use_qk_norm)
    spec = opt.model.layers[0].self_attn._gemmtune_attn
    assert spec.qk_norm is use_qk_norm and (spec.qk_norms is not None) is use_qk_norm
    assert spec.rope_fused == "any"  # partial rotary (0.5) through the fused rope
    check_parity(stock, opt)


def test_granitemoe_scaled_layer_and_router_name():
    stock, opt, report = pair("granitemoe")
    layer = opt.model.layers[0]
    assert "forward" in layer.__dict__ and "residual add + post_attention_layernorm fused (scaled)" in str(report)
    assert "forward" not in layer.block_sparse_moe.router.__dict__
    assert any("GraniteMoeTopKRouter is not a router the kernels compute" in w for w in skipped(report, "router"))


# ---- the routers: softmax top-k (Qwen2-MoE, OLMoE), grouped sigmoid (DeepSeek-V3, GLM-4-MoE) --------
@pytest.mark.parametrize(
    ("name", "kernel", "reference", "summary"),
    [
        ("qwen2-moe", "router_topk", moe_route.router_topk_ref, "softmax/top-k in one kernel"),
        ("olmoe", "router_topk", moe_route.router_topk_ref, "softmax/top-k in one kernel"),
        ("deepseek-v3", "grouped_router_topk", moe_route.grouped_router_topk_ref, "sigmoid/grouped top-k"),
        ("glm4-moe", "grouped_router_topk", moe_route.grouped_router_topk_ref, "sigmoid/grouped top-k"),
    ],
)
def test_routers_swap_with_parity(name, kernel, reference, summary, monkeypatch):
    """Where Triton runs, these routers take their kernel: here its reference stands in for it, so the probe
    (against the module's own forward) and the patched forward are what is tested (the kernels
    themselves: test_moe_route.py)."""
    monkeypatch.setattr(moe_mod, "triton_reason", lambda device: None)
    monkeypatch.setattr(moe_mod, kernel, reference)
    stock, opt, report = pair(name)
    blocks = moe_blocks(opt)
    assert report.counts().get("router") == len(blocks), report.summary()
    assert all("forward" in b.gate.__dict__ for b in blocks)
    assert summary in str(report)
    check_parity(stock, opt)


def test_grouped_router_reference_is_the_modules_own():
    """grouped_router_topk_ref against DeepSeek-V3's router: the same experts, the same weights up to the
    order of the renormalizing sum."""
    stock, _, _ = pair("deepseek-v3")
    router = moe_blocks(stock)[0].gate
    x = torch.randn(40, router.weight.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, w, ids = router(x)
        args = (router.top_k, router.num_group, router.topk_group, router.norm_topk_prob, router.routed_scaling_factor)
        w_ref, ids_ref = moe_route.grouped_router_topk_ref(logits, router.e_score_correction_bias, *args)
    mine, order = ids_ref.sort(1)
    theirs, their_order = ids.sort(1)
    assert torch.equal(mine, theirs)
    torch.testing.assert_close(w_ref.gather(1, order), w.gather(1, their_order), rtol=1e-6, atol=0)


def test_grouped_router_probe_refuses_a_router_it_does_not_reproduce(monkeypatch):
    monkeypatch.setattr(moe_mod, "triton_reason", lambda device: None)
    monkeypatch.setattr(moe_mod, "grouped_router_topk", moe_route.grouped_router_topk_ref)
    stock, _, _ = pair("deepseek-v3")
    router = moe_blocks(stock)[0].gate
    assert isinstance(moe_mod.plan_router(router), moe_mod.GroupedRouterSpec)
    real = type(router).forward  # a forward whose weights are 1% off
    monkeypatch.setattr(type(router), "forward", lambda self, h: (lambda r: (r[0], r[1] * 1.01, r[2]))(real(self, h)))
    assert moe_mod.plan_router(router) == "the grouped top-k kernel's weights differ from its forward on a probe"
    router.topk_group = router.num_group + 1
    assert "is not a grouping the kernel takes" in moe_mod.plan_router(router)


# ---- the probe guards the swap --------------------------------------------------------------------
def test_experts_whose_forward_differs_are_left_alone(monkeypatch):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    real = mod.DeepseekV3Experts.forward
    monkeypatch.setattr(mod.DeepseekV3Experts, "forward", lambda self, *a: real(self, *a) * 1.5)
    stock, opt, report = pair("deepseek-v3")
    assert not report.counts().get("moe"), report.summary()
    assert all("fused_moe differs from the module's forward" in w for w in skipped(report, "moe"))
    assert all("forward" not in b.experts.__dict__ for b in moe_blocks(opt))


def test_gpt_oss_experts_are_skipped_with_the_reason():
    """gpt-oss experts: biases, interleaved gate/up stored (E, H, 2I) and a clamped sigmoid-scaled GLU
    that fused_moe does not compute; the model type itself is not an architecture optimize() knows."""
    if "gpt_oss" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no gpt_oss")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    why = moe_mod.plan_experts(GptOssExperts(cfg))
    assert why == "experts layout not handled: has_bias=True, is_transposed=True, is_concatenated=False", why


# ---- presets: real sizes, as transformers builds them ---------------------------------------------
PRESET_FAMILIES = ["qwen2-moe", "qwen2-57b-a14b", "deepseek-v3", "olmoe-1b-7b", "glm-4.5-air", "granite-3.1-3b-a800m"]


@pytest.mark.parametrize("preset", PRESET_FAMILIES)
def test_preset_expert_shapes_match_the_built_model(preset):
    """The preset builds in transformers (meta device, first MoE layer only) and its experts are the
    shapes model_gemms and moe_keys derive from it."""
    cfg = dict(PRESETS[preset])
    mt = cfg.pop("model_type")
    if mt not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {mt}")
    dense = cfg.get("first_k_dense_replace", 0)
    config = transformers.AutoConfig.for_model(mt, **{**cfg, "num_hidden_layers": dense + 1})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    (block,) = moe_blocks(model)
    E, two_i, H = block.experts.gate_up_proj.shape
    shapes = {s.name: s for s in model_gemms(PRESETS[preset])}
    assert (shapes["expert_gate_up"].N, shapes["expert_gate_up"].K) == (two_i, H)
    assert (shapes["expert_down"].N, shapes["expert_down"].K) == tuple(block.experts.down_proj.shape[1:])
    assert shapes["expert_gate_up"].experts == E == shapes["router"].N
    (key,) = moe_keys(PRESETS[preset], tokens=(16,))
    shared = getattr(block, "shared_expert", None)  # Qwen2-MoE's: folded into the call (models/moe_shared.py)
    folded = -(-shared.gate_proj.out_features // (two_i // 2)) if hasattr(block, "shared_expert_gate") else 0
    assert (key.model_dim, key.inter_dim, key.expert - key.shared_expert) == (H, two_i // 2, E + folded)
    if folded:
        assert key.topk == block.gate.top_k + folded


def test_mla_prefill_expansion_equals_transformers_expand_kv():
    """The prefill path's keys and values (models/mla._expand: [B, S, H, .] buffers read as [B, H, S, .])
    hold exactly what transformers' expand_kv builds."""
    from gemmtune.models import mla

    attn = build("deepseek-v3").model.layers[0].self_attn
    spec = mla.plan(attn)
    g = torch.Generator().manual_seed(8)
    lat = torch.randn(2, 1, 7, attn.kv_lora_rank, generator=g)
    k_rot = torch.randn(2, 1, 7, attn.qk_rope_head_dim, generator=g)
    with torch.no_grad():
        got_k, got_v = mla._expand(attn, spec, lat, k_rot)
        want_k, want_v = attn.expand_kv(lat, k_rot)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
