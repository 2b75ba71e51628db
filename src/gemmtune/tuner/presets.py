"""Named model configs (`gemmtune shapes --model llama-3-8b`), with the same architecture facts as the
models' public config.json files, and reading a config.json (load_model_config)."""

from __future__ import annotations

import json
import os

from ..configs.files import open_regular
from ..model_types import ModelConfigError


def _llama(hidden, inter, heads, kv, layers, vocab, head_dim=None, **extra) -> dict:
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
    }
    if head_dim:
        cfg["head_dim"] = head_dim
    cfg.update(extra)
    return cfg


def _qwen2_moe(hidden, inter, heads, kv, layers, *, moe_inter, shared_inter, experts, topk) -> dict:
    """A Qwen2-MoE config: every layer sparse, a shared expert beside the routed ones."""
    return _llama(hidden, inter, heads, kv, layers, 151936, model_type="qwen2_moe", moe_intermediate_size=moe_inter,
                  shared_expert_intermediate_size=shared_inter, num_experts=experts, num_experts_per_tok=topk,
                  norm_topk_prob=False, decoder_sparse_step=1, rope_theta=1000000.0, rms_norm_eps=1e-06)  # fmt: skip


PRESETS: dict[str, dict] = {
    # The models of tests/data/models (same architecture facts as those config.json files).
    "llama-3-8b": _llama(4096, 14336, 32, 8, 32, 128256, 128),
    "llama-3-70b": _llama(8192, 28672, 64, 8, 80, 128256, 128),
    "mixtral-8x7b": _llama(
        4096, 14336, 32, 8, 32, 32000, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen3-30b-a3b": _llama(
        2048,
        6144,
        32,
        4,
        48,
        151936,
        128,
        model_type="qwen3_moe",
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    "qwen3-32b": _llama(5120, 25600, 64, 8, 64, 151936, 128, model_type="qwen3"),
    "tiny-llama": _llama(64, 128, 4, 2, 2, 256, 16, torch_dtype="float32"),
    # A few more, from their public config.json files.
    "llama-3.1-405b": _llama(16384, 53248, 128, 8, 126, 128256, 128),
    "mistral-7b": _llama(4096, 14336, 32, 8, 32, 32768, 128, model_type="mistral"),
    "qwen2.5-7b": _llama(
        3584,
        18944,
        28,
        4,
        28,
        152064,
        model_type="qwen2",
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    "qwen3-8b": _llama(4096, 12288, 32, 8, 36, 151936, 128, model_type="qwen3"),
    "gemma-2-9b": _llama(
        3584,
        14336,
        16,
        8,
        42,
        256000,
        256,
        model_type="gemma2",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        rms_norm_eps=1e-06,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "phi-3-mini": _llama(3072, 8192, 32, 32, 32, 32064, model_type="phi3"),
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": _llama(
        7168,
        18432,
        128,
        128,
        61,
        129280,
        model_type="deepseek_v3",
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen2-moe": _qwen2_moe(2048, 5632, 16, 16, 24, moe_inter=1408, shared_inter=5632, experts=60, topk=4),
    # Qwen/Qwen2-57B-A14B
    "qwen2-57b-a14b": _qwen2_moe(3584, 18944, 28, 4, 28, moe_inter=2560, shared_inter=20480, experts=64, topk=8),
    # allenai/OLMoE-1B-7B-0924
    "olmoe-1b-7b": _llama(
        2048,
        1024,
        16,
        16,
        16,
        50304,
        model_type="olmoe",
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        clip_qkv=None,
        rms_norm_eps=1e-05,
        tie_word_embeddings=False,
    ),
    # zai-org/GLM-4.5-Air
    "glm-4.5-air": _llama(
        4096,
        10944,
        96,
        8,
        46,
        151552,
        128,
        model_type="glm4_moe",
        moe_intermediate_size=1408,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
        attention_bias=True,
        rms_norm_eps=1e-05,
    ),
    # ibm-granite/granite-3.1-3b-a800m-instruct
    "granite-3.1-3b-a800m": _llama(
        1536,
        512,
        24,
        8,
        32,
        49155,
        model_type="granitemoe",
        num_local_experts=40,
        num_experts_per_tok=8,
        tie_word_embeddings=True,
    ),
}


def load_model_config(model: str) -> tuple[dict, str]:
    """A preset name, a config.json path, or a folder holding config.json -> (config dict, source)."""
    if model in PRESETS:
        return dict(PRESETS[model]), f"preset {model}"
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.exists(path):
        raise ModelConfigError(
            f"{model!r} is neither a config.json file, a folder with one, nor a preset "
            f"(presets: {', '.join(sorted(PRESETS))})"
        )
    try:
        with open_regular(path, ModelConfigError, "a config.json file", encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read model config: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: a model config must be a JSON object")
    return config, path
