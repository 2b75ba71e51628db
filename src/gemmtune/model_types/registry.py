"""The architecture registry: every Hugging Face model type gemmtune knows, one entry each, read by
optimize() (models/architectures.py), `gemmtune shapes` and the tuner (tuner/model_shapes.py), and the
docs' supported-model table (docs/models.md; tests/test_model_types.py keeps it in step)."""

from __future__ import annotations

from . import shapes as s
from .config import ModelConfigError
from .entry import Architecture, Experts, ModelType
from .epilogue_layout import EpilogueLayout


def _epilogue_mlp_type(model_type: str, title: str, cls: str, attention, layout: EpilogueLayout, why: str,
                       lm_head_bias: bool = False) -> ModelType:  # fmt: skip
    """A model type optimize() has no layout for but whose Linear -> act -> Linear MLP (`layout`) it runs on
    the fused-epilogue GEMMs, its other linears routed; its shapes read the MLP from the same layout."""
    return ModelType(model_type, title, classes=(cls,), shapes=s.epilogue_mlp_model(attention, layout, lm_head_bias),
                     optimize=None, not_optimized=why, epilogue_mlp=layout)  # fmt: skip


# MLA attention (DeepSeek-V3: its decode swapped by models/mla.py) and OLMoE's full-width q/k norms (with
# clip_qkv) have no fused-qkv attention forward: their norms and linears change.
_ENTRIES = (
    ModelType("llama", "Llama", classes=("LlamaForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("llama", "Llama")),
    ModelType("mistral", "Mistral", classes=("MistralForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("mistral", "Mistral")),
    ModelType("ministral", "Ministral", classes=("MinistralForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("ministral", "Ministral")),
    ModelType("qwen2", "Qwen2", classes=("Qwen2ForCausalLM",), shapes=s.qwen2,
              optimize=Architecture("qwen2", "Qwen2")),
    ModelType("qwen3", "Qwen3", classes=("Qwen3ForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("qwen3", "Qwen3", qk_norm=True)),
    ModelType("gemma", "Gemma", classes=("GemmaForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("gemma", "Gemma")),
    ModelType("gemma2", "Gemma 2", classes=("Gemma2ForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("gemma2", "Gemma2", layer="sandwich", softcap_kwarg=True)),
    ModelType("gemma3_text", "Gemma 3", classes=("Gemma3ForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("gemma3", "Gemma3", layer="sandwich", qk_norm=True)),
    ModelType("gemma3", "Gemma 3 (multimodal)", classes=("Gemma3ForConditionalGeneration",), shapes=s.llama_like,
              optimize=None, nests_text_config=True,
              not_optimized="a multimodal wrapper: optimize() rewrites its language model loaded as "
              "Gemma3ForCausalLM (gemma3_text)"),
    ModelType("phi3", "Phi-3", classes=("Phi3ForCausalLM",), shapes=s.llama_like,
              optimize=Architecture("phi3", "Phi3", qkv=None, gate_up=None)),
    ModelType("mixtral", "Mixtral", classes=("MixtralForCausalLM",), shapes=s.mixtral,
              optimize=Architecture("mixtral", "Mixtral", moe=True),
              experts=Experts(("num_local_experts", "num_experts"), "intermediate_size")),
    ModelType("qwen2_moe", "Qwen2-MoE", classes=("Qwen2MoeForCausalLM",), shapes=s.qwen_moe(qkv_bias=True),
              optimize=Architecture("qwen2_moe", "Qwen2Moe", moe=True),
              experts=Experts(s.QWEN_MOE_EXPERTS, "moe_intermediate_size", shared="folded")),
    ModelType("qwen3_moe", "Qwen3-MoE", classes=("Qwen3MoeForCausalLM",), shapes=s.qwen_moe(qkv_bias=False),
              optimize=Architecture("qwen3_moe", "Qwen3Moe", qk_norm=True, moe=True),
              experts=Experts(s.QWEN_MOE_EXPERTS, "moe_intermediate_size")),
    ModelType("deepseek_v2", "DeepSeek-V2", classes=("DeepseekV2ForCausalLM",), shapes=s.deepseek,
              batched=s.mla_batched, experts=Experts(("n_routed_experts",), "moe_intermediate_size", shared="fusable"),
              optimize=None,
              not_optimized="its MLA rotates q/k as complex numbers (freqs_cis) and its router is a softmax "
              "group-limited greedy top-k: neither is the layout models/mla.py and models/moe.py rewrite "
              "(DeepSeek-V3's)"),
    ModelType("deepseek_v3", "DeepSeek-V3", classes=("DeepseekV3ForCausalLM",), shapes=s.deepseek,
              batched=s.mla_batched, experts=Experts(("n_routed_experts",), "moe_intermediate_size", shared="fusable"),
              optimize=Architecture("deepseek_v3", "DeepseekV3", qkv=None, attn_norms=("q_a_layernorm",
                                    "kv_a_layernorm"), moe=True, mla=True)),
    ModelType("olmoe", "OLMoE", classes=("OlmoeForCausalLM",), shapes=s.routed_moe("num_experts", "intermediate_size"),
              optimize=Architecture("olmoe", "Olmoe", qkv=None, attn_norms=("q_norm", "k_norm"), moe=True),
              experts=Experts(("num_experts", "num_local_experts"), "intermediate_size")),
    ModelType("granitemoe", "GraniteMoE", classes=("GraniteMoeForCausalLM",),
              shapes=s.routed_moe("num_local_experts", "intermediate_size"),
              optimize=Architecture("granitemoe", "GraniteMoe", layer="scaled", moe=True, mlp="block_sparse_moe"),
              experts=Experts(("num_experts", "num_local_experts"), "intermediate_size")),
    ModelType("glm4_moe", "GLM-4-MoE", classes=("Glm4MoeForCausalLM",), shapes=s.glm4_moe,
              optimize=Architecture("glm4_moe", "Glm4Moe", qk_norm=True, qk_norm_flag="use_qk_norm", moe=True),
              experts=Experts(("n_routed_experts",), "moe_intermediate_size", shared="fusable")),
    _epilogue_mlp_type("gpt_neox", "GPT-NeoX / Pythia", "GPTNeoXForCausalLM", s.gpt_neox_attention,
                       EpilogueLayout("GPTNeoXMLP", "dense_h_to_4h", "act", "dense_4h_to_h"),
                       "its query_key_value comes fused per head and its layers are LayerNorm ones with a parallel "
                       "residual, no layout of the dense rewrites: its other linears are routed"),
    _epilogue_mlp_type("phi", "Phi-1 / 1.5 / 2", "PhiForCausalLM", s.phi_attention,
                       EpilogueLayout("PhiMLP", "fc1", "activation_fn", "fc2", act_default="gelu_new"),
                       "one LayerNorm feeds attention and MLP in parallel and its rotary covers part of each head, "
                       "no layout of the dense rewrites: its q/k/v/dense and lm_head are routed", lm_head_bias=True),
    _epilogue_mlp_type("starcoder2", "StarCoder2", "Starcoder2ForCausalLM", s.starcoder2_attention,
                       EpilogueLayout("Starcoder2MLP", "c_fc", "act", "c_proj", dropout="residual_dropout",
                                      act_default="gelu_pytorch_tanh", bias_field="use_bias"),
                       "its norms are LayerNorms (weight and bias), which the dense rewrites' fused norms and layer "
                       "forward do not compute: its q/k/v/o are routed"),
    _epilogue_mlp_type("falcon", "Falcon", "FalconForCausalLM", s.falcon_attention,
                       EpilogueLayout("FalconMLP", "dense_h_to_4h", "act", "dense_4h_to_h", act_field="activation",
                                      intermediate_field="ffn_hidden_size", intermediate_multiple=4,
                                      bias_field="bias", bias_default=False),
                       "its query_key_value comes fused (multi-head, multi-query or grouped) and its layers run "
                       "attention and MLP in parallel off LayerNorms, no layout of the dense rewrites: lm_head is "
                       "routed, its attention's FalconLinear projections stay stock (not a plain nn.Linear)"),
)  # fmt: skip


def _index(entries) -> tuple[dict[str, ModelType], dict[str, ModelType]]:
    """({model_type: entry}, {class name: entry}); a model type or class name listed twice is an error."""
    by_type: dict[str, ModelType] = {}
    by_class: dict[str, ModelType] = {}
    for e in entries:
        if e.model_type in by_type:
            raise ValueError(f"model type {e.model_type!r} is in the registry twice")
        by_type[e.model_type] = e
        for cls in e.classes:
            if cls in by_class:
                raise ValueError(f"class {cls!r} names both {by_class[cls].model_type!r} and {e.model_type!r}")
            by_class[cls] = e
    return by_type, by_class


REGISTRY, BY_CLASS = _index(_ENTRIES)


def _nests_text_config(config: dict) -> bool:
    """Whether the language model's sizes are under text_config: a multimodal wrapper (Gemma 3, Llama 4 ...),
    named by model_type or architectures, or a model type gemmtune does not read itself. A text model's own
    sizes win over a stray text_config."""
    mt = config.get("model_type")
    if mt is None:
        types = [BY_CLASS[c].model_type for c in config.get("architectures") or [] if c in BY_CLASS]
        mt = types[0] if types else None
    entry = REGISTRY.get(mt)
    return entry is None or entry.nests_text_config


def text_config(config: dict) -> dict:
    """The language model's config: multimodal configs (Gemma 3, Llama 4 ...) keep it under text_config."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and _nests_text_config(config):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(inner)
        if "model_type" in inner:
            merged["model_type"] = inner["model_type"]
        return merged
    return config


def model_type_of(config: dict) -> str:
    """The registry's model type of an HF config dict: its (language model's) model_type, else the first
    `architectures` class name the registry knows; an unknown one is a ModelConfigError listing them."""
    cfg = text_config(config)
    mt = cfg.get("model_type")
    if mt in REGISTRY:
        return mt
    for cls in config.get("architectures") or []:
        if cls in BY_CLASS:
            return BY_CLASS[cls].model_type
    what = f"model_type {mt!r}" if mt else f"architectures {config.get('architectures')!r}"
    raise ModelConfigError(
        f"unsupported model architecture ({what}); supported model_type values: {', '.join(sorted(REGISTRY))}"
    )
