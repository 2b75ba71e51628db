"""The architecture registry (gemmtune.model_types) is the one table optimize(), `gemmtune shapes` and the
docs read: each entry's shapes are its transformers model's weights, optimize() supports exactly the
entries with a layout and fuses exactly the epilogue MLPs they declare, every entry without a layout says
why, and docs/models.md's table is the registry's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from gemmtune.model_types import REGISTRY, Architecture, EpilogueLayout, Experts, ModelConfigError, ModelType
from gemmtune.model_types import registry as registry_mod
from gemmtune.model_types.entry import LAYOUTS
from gemmtune.model_types.shapes import llama_like
from gemmtune.tuner.model_shapes import PRESETS, batched_gemms, mlp_shape, model_gemms, model_keys, model_type_of

DOCS_TABLE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
TABLE_START = "<!-- model-types table: the registry's entries (tests/test_model_types.py checks it) -->"
TABLE_END = "<!-- end of the model-types table -->"

# Sizes on top of transformers' default config of each type: two layers, and for the types whose layers
# differ (dense then MoE), one of each. DeepSeek-V2's default leaves num_experts_per_tok unset, Ministral's
# head_dim (its attention does not fall back to hidden / heads).
_OVERRIDES = {
    "ministral": {"head_dim": 128},
    "deepseek_v2": {"first_k_dense_replace": 1, "num_experts_per_tok": 6},
    "deepseek_v3": {"first_k_dense_replace": 1},
    "glm4_moe": {"first_k_dense_replace": 1},
    "qwen2_moe": {"decoder_sparse_step": 2},
    "qwen3_moe": {"decoder_sparse_step": 2},
}
LANGUAGE_MODELS = [mt for mt, e in REGISTRY.items() if not e.nests_text_config]
EPILOGUE_MLP_TYPES = [mt for mt, e in REGISTRY.items() if e.epilogue_mlp is not None]
# The layouts one model type's config switches between, beside its default config (the weight check runs
# each): Falcon's three attention variants, the bias switches.
_VARIANTS = {
    "falcon-new-decoder": ("falcon", {"new_decoder_architecture": True, "hidden_size": 1024,
                                      "num_attention_heads": 16, "num_kv_heads": 4, "bias": True}),
    "falcon-multi-head": ("falcon", {"multi_query": False, "hidden_size": 512, "num_attention_heads": 8,
                                     "ffn_hidden_size": 1000, "activation": "relu"}),
    "gpt_neox-no-attention-bias": ("gpt_neox", {"attention_bias": False, "hidden_size": 512}),
    "phi-qk-layernorm": ("phi", {"qk_layernorm": True, "num_key_value_heads": 8}),
    "starcoder2-no-bias": ("starcoder2", {"use_bias": False}),
}  # fmt: skip
WEIGHT_CASES = {mt: (mt, {}) for mt in LANGUAGE_MODELS} | _VARIANTS


def registry_table() -> str:
    """The markdown table docs/models.md holds between its markers."""
    rows = [
        "| `model_type` | model | config class | `optimize()` | `gemmtune shapes --family` |",
        "|---|---|---|---|---|",
    ]
    for mt, e in REGISTRY.items():
        families = ["a16w16", *(["batched"] if e.batched else []), *(["fmoe"] if e.experts else []),
                    *(["epilogue"] if e.epilogue_mlp else [])]  # fmt: skip
        if e.optimize:
            rewrite = "yes"
        elif e.epilogue_mlp:
            rewrite = f"its MLP (`{e.epilogue_mlp.mlp_class}`) on the fused-epilogue GEMMs; {e.not_optimized}"
        else:
            rewrite = f"no: {e.not_optimized}"
        classes = ", ".join(f"`{c}`" for c in e.classes)
        rows.append(f"| `{mt}` | {e.title} | {classes} | {rewrite} | {', '.join(families)} |")
    return "\n".join(rows)


def test_docs_table_is_the_registry():
    text = DOCS_TABLE.read_text(encoding="utf-8")
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1, f"{DOCS_TABLE} lacks the table markers"
    held = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    want = registry_table()
    assert held == want, f"docs/models.md's model-types table is not the registry's; it should read:\n{want}"


def test_optimize_reads_the_registry():
    from gemmtune.models import architectures

    assert architectures.ARCHITECTURES == {mt: e.optimize for mt, e in REGISTRY.items() if e.optimize}
    # every layer form an entry may name has the forward and the norms optimize() installs for it
    assert set(architectures.LAYER_FORWARDS) == set(LAYOUTS) == set(architectures.LAYER_NORMS)


def test_every_entry_is_supported_by_optimize_or_says_why():
    for mt, e in REGISTRY.items():
        assert e.model_type == mt
        assert (e.optimize is None) == bool(e.not_optimized), mt
        assert callable(e.shapes), mt  # every entry, optimized or not, has its shape derivation


def test_an_entry_must_have_a_layout_or_a_reason_but_not_both():
    with pytest.raises(ValueError, match="'x'.*either an optimize\\(\\) layout or the reason"):
        ModelType("x", "X", (), llama_like, None)
    with pytest.raises(ValueError, match="not both"):
        ModelType("x", "X", (), llama_like, Architecture("x", "X"), not_optimized="because")
    with pytest.raises(ValueError, match="layer='post'"):
        ModelType("x", "X", (), llama_like, Architecture("x", "X", layer="post"))
    with pytest.raises(ValueError, match="needs its Experts"):
        ModelType("x", "X", (), llama_like, Architecture("x", "X", moe=True))
    with pytest.raises(ValueError, match="shared='sometimes'"):
        Experts(("num_experts",), "moe_intermediate_size", shared="sometimes")


def test_a_model_type_or_class_listed_twice_is_an_error():
    llama = REGISTRY["llama"]
    with pytest.raises(ValueError, match="'llama' is in the registry twice"):
        registry_mod._index([llama, llama])
    other = dataclasses.replace(REGISTRY["mistral"], classes=llama.classes)
    with pytest.raises(ValueError, match="'LlamaForCausalLM' names both 'llama' and 'mistral'"):
        registry_mod._index([llama, other])


def test_every_preset_is_a_registry_model_type():
    assert {name: model_type_of(cfg) in REGISTRY for name, cfg in PRESETS.items()} == dict.fromkeys(PRESETS, True)


def _default_config(mt: str, **overrides):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(mt, num_hidden_layers=2, **{**_OVERRIDES.get(mt, {}), **overrides})


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_entry_shapes_are_its_transformers_model_weights(case):
    # transformers' own model of each type, built on the meta device (no memory) from its default config:
    # the registry's shapes hold every weight matrix it has (fused projections and experts summed) and its
    # biases (a LayerNorm's are no GEMM's), and its class is one the entry lists.
    transformers = pytest.importorskip("transformers")
    mt, overrides = WEIGHT_CASES[case]
    config = _default_config(mt, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    entry = REGISTRY[mt]
    assert type(model).__name__ in entry.classes
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    norm_biases = {f"{n}.bias" for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head is its own GEMM
    weights = sum(p.numel() for n, p in params.items() if p.dim() >= 2 and n not in embeddings)
    biases = sum(p.numel() for n, p in params.items() if n.endswith(".bias") and n not in norm_biases)
    shapes = model_gemms(config.to_dict(), 1)
    assert weights == sum(s.N * s.K * s.count for s in shapes), [(s.name, s.N, s.K, s.count) for s in shapes]
    assert biases == sum(s.N * s.count for s in shapes if s.bias)


@pytest.mark.parametrize("mt", LANGUAGE_MODELS)
def test_entry_families_are_what_the_key_builders_derive(mt):
    cfg = _default_config(mt).to_dict()
    entry = REGISTRY[mt]
    assert bool(batched_gemms(cfg)) == (entry.batched is not None)
    assert bool(model_keys("fmoe", cfg, 1, [1], torch.bfloat16)) == (entry.experts is not None)
    assert bool(model_keys("epilogue", cfg, 1, [1], torch.bfloat16)) == (entry.epilogue_mlp is not None)


def test_optimize_fuses_exactly_the_registry_epilogue_mlps():
    # an MLP class optimize() runs on the epilogue GEMMs is a registry entry's, and every entry's is one
    from gemmtune.models import epilogue_mlp

    declared = {e.epilogue_mlp.mlp_class: e.epilogue_mlp for e in REGISTRY.values() if e.epilogue_mlp}
    assert epilogue_mlp.LAYOUTS == declared
    assert len(declared) == len(EPILOGUE_MLP_TYPES)  # one MLP class per model type


@pytest.mark.parametrize("mt", EPILOGUE_MLP_TYPES)
def test_epilogue_layout_is_its_transformers_mlp(mt):
    # every decoder layer of transformers' model has the entry's MLP class, with the attributes the layout
    # names; the config sizes mlp_shape() reads are that MLP's, and its activation is the one the layout
    # reads from the config (identified on the probe optimize() uses)
    transformers = pytest.importorskip("transformers")
    from gemmtune.models.epilogue_mlp import detect_act

    config = _default_config(mt)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layout = REGISTRY[mt].epilogue_mlp
    mlps = [m for m in model.modules() if type(m).__name__ == layout.mlp_class]
    assert len(mlps) == config.num_hidden_layers
    hidden, inter, act, bias = mlp_shape(config.to_dict())
    for m in mlps:
        up, down = getattr(m, layout.up), getattr(m, layout.down)
        assert isinstance(up, torch.nn.Linear) and isinstance(down, torch.nn.Linear)
        assert (up.in_features, up.out_features, down.in_features, down.out_features) == (hidden, inter, inter, hidden)
        assert (up.bias is not None, down.bias is not None) == (bias, bias)
        assert detect_act(getattr(m, layout.act)) == act
        if layout.dropout is not None:
            assert isinstance(getattr(m, layout.dropout), (int, float))


def test_epilogue_layout_reads_the_config_fields_it_names():
    layout = EpilogueLayout("XMLP", "up", "act", "down", act_field="activation", intermediate_field="ffn",
                            intermediate_multiple=4, bias_field="bias", bias_default=False)  # fmt: skip
    assert layout.intermediate_size({"hidden_size": 8}) == 32
    assert layout.intermediate_size({"hidden_size": 8, "ffn": 12}) == 12
    assert layout.intermediate_size({}) is None
    assert (layout.bias({}), layout.bias({"bias": True})) == (False, True)
    assert (layout.epilogue_act({}), layout.epilogue_act({"activation": "gelu_new"})) == ("gelu", "gelu_tanh")
    assert layout.epilogue_act({"activation": "silu"}) is None
    with pytest.raises(ModelConfigError, match="ffn=-4"):
        layout.intermediate_size({"ffn": -4})
    with pytest.raises(ValueError, match="act_default='silu'"):
        EpilogueLayout("XMLP", "up", "act", "down", act_default="silu")


def test_falcon_old_multi_head_attention_with_fewer_kv_heads_is_refused():
    # Falcon's old architecture without multi_query fuses q/k/v of every head (3 * hidden_size): a smaller
    # num_kv_heads is a config transformers' own forward cannot run
    cfg = {"model_type": "falcon", "hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 2,
           "vocab_size": 100, "multi_query": False, "num_kv_heads": 2}  # fmt: skip
    with pytest.raises(ModelConfigError, match="num_kv_heads=2 with num_attention_heads=8 needs new_decoder_arch"):
        model_gemms(cfg)
    assert model_gemms(dict(cfg, num_kv_heads=8))[0].N == 3 * 512
    assert model_gemms(dict(cfg, multi_query=True))[0].N == 512 + 2 * 64
    assert model_gemms(dict(cfg, new_decoder_architecture=True))[0].N == (8 + 2 * 2) * 64


def test_a_wrapper_entry_reads_its_language_model():
    inner = dict(PRESETS["llama-3-8b"], model_type="gemma3_text")
    assert REGISTRY["gemma3"].nests_text_config
    assert model_gemms({"model_type": "gemma3", "text_config": inner}) == model_gemms(inner)


def test_a_config_saved_by_transformers_qwen3_moe_has_its_experts():
    # Qwen3MoeConfig saves num_experts as num_local_experts (its attribute_map)
    cfg = dict(PRESETS["qwen3-30b-a3b"])
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert model_gemms(cfg) == model_gemms(PRESETS["qwen3-30b-a3b"])
    assert model_keys("fmoe", cfg, 1, [4], torch.bfloat16) == model_keys(
        "fmoe", PRESETS["qwen3-30b-a3b"], 1, [4], torch.bfloat16
    )


def test_unknown_model_type_lists_the_registry():
    from gemmtune.model_types import ModelConfigError

    with pytest.raises(ModelConfigError, match=re.escape(", ".join(sorted(REGISTRY)))):
        model_type_of({"model_type": "not_a_model"})
