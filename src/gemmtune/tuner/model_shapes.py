"""The GEMMs a Hugging Face model config runs, as serving engines run them: its linear layers
(model_gemms), its batched GEMMs (batched_gemms), and the keys of every GEMM family it runs at given
token counts (model_keys). The one place that turns a model config into shapes and keys.

Conventions (M = tokens, N = output features, K = input features, weight [N, K]):
- Fused projections as vLLM/SGLang run them: one `qkv` GEMM (q, k and v heads side by side) and one
  `gate_up` GEMM (gate and up side by side); DeepSeek's MLA fuses q_a and kv_a into `qkv_a`.
- Megatron-style tensor parallelism over `tp` ranks (the shapes of one rank): column-parallel layers
  (qkv, gate_up, expert_gate_up, kv_b, q_b, lm_head) are split along N, row-parallel layers (o, down,
  expert_down) along K. KV heads are replicated when there are fewer than tp: a rank holds
  max(1, kv_heads / tp) of them. The MoE router and MLA's qkv_a are replicated (not split).
- lm_head: N = ceil(vocab_size / tp) (no vocab padding), emitted whether or not embeddings are tied.
- Expert GEMMs (expert_gate_up, expert_down) are the per-expert GEMM of a grouped MoE: at T tokens
  an expert sees on average ceil(T * top_k / num_experts) of them, which is the M they are keyed on.
- Row-parallel layers keep their bias in the GEMM (the rank that adds it runs the same shape).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..configs.files import open_regular
from ..errors import GemmtuneError
from ..families.batched import BatchedKey
from ..families.epilogue import EpilogueKey
from ..families.fmoe import ACT_TYPES, MoeKey
from ..families.quantized import BlockKey, QuantKey
from ..keys import GemmKey, parse_dtype
from ..quant import formats


class ModelConfigError(GemmtuneError, ValueError):
    """A model config cannot be turned into GEMM shapes (unknown architecture, bad tp, missing field)."""


@dataclass(frozen=True)
class LinearShape:
    """One linear layer of a model (per TP rank): y[M, N] = x[M, K] @ w[N, K]^T (+ bias)."""

    name: str
    N: int
    K: int
    bias: bool = False
    count: int = 1  # instances in the whole model (layers x experts), for weighting and display
    experts: int = 0  # > 0 for per-expert GEMMs: M is the mean tokens one expert sees
    top_k: int = 0

    def m_for(self, tokens: int) -> int:
        """The GEMM's M when the model processes `tokens` tokens."""
        if self.experts:
            return max(1, math.ceil(tokens * self.top_k / self.experts))
        return tokens

    def key(self, tokens: int, dtype: torch.dtype = torch.bfloat16, outdtype: torch.dtype | None = None) -> GemmKey:
        return GemmKey(self.m_for(tokens), self.N, self.K, self.bias, dtype, outdtype or dtype)


# ---- helpers -------------------------------------------------------------------------------------
def _nests_text_config(config: dict) -> bool:
    """Whether the language model's sizes are under text_config: a multimodal wrapper (Gemma 3, Llama 4 ...),
    named by model_type or architectures, or a model type gemmtune does not read itself. A text model's own
    sizes win over a stray text_config."""
    mt = config.get("model_type")
    if mt is None:
        types = [_CLASS_TO_TYPE[c] for c in config.get("architectures") or [] if c in _CLASS_TO_TYPE]
        mt = types[0] if types else None
    return mt not in ARCHITECTURES or mt in NESTING_TYPES


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


def _count(cfg: dict, name: str, minimum: int) -> int:
    """cfg[name] as an int >= minimum; a negative, fractional or non-numeric size is an error naming it."""
    value = cfg[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelConfigError(
            f"model config: {name}={value!r} must be a {'positive' if minimum > 0 else 'non-negative'} integer "
            f"(model_type {cfg.get('model_type')!r})"
        )
    return value


def _req(cfg: dict, *names: str) -> int:
    for n in names:
        if cfg.get(n) is not None:
            return _count(cfg, n, 1)
    raise ModelConfigError(f"model config has no {' / '.join(names)} (model_type {cfg.get('model_type')!r})")


def _opt(cfg: dict, name: str, default: int) -> int:
    """An optional size: missing, null or 0 mean `default` (as transformers reads them)."""
    if cfg.get(name) is None:
        return default
    return _count(cfg, name, 0) or default


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ModelConfigError(f"{what}={value} is not divisible by tp={tp}")
    return value // tp


def _kv_per_rank(kv: int, tp: int) -> int:
    if kv >= tp:
        return _split(kv, tp, "num_key_value_heads")
    if tp % kv:
        raise ModelConfigError(f"num_key_value_heads={kv} cannot be replicated over tp={tp} (tp % kv != 0)")
    return 1


def _attention(cfg: dict, tp: int, qkv_bias: bool, o_bias: bool, layers: int) -> list[LinearShape]:
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    kv = _opt(cfg, "num_key_value_heads", heads)
    if heads % kv:
        raise ModelConfigError(
            f"model config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
            "(each KV head serves a whole group of query heads)"
        )
    head_dim = _opt(cfg, "head_dim", hidden // heads)
    if head_dim < 1:
        raise ModelConfigError(f"model config: hidden_size={hidden} / num_attention_heads={heads} gives head_dim 0")
    q_rank = _split(heads, tp, "num_attention_heads")
    kv_rank = _kv_per_rank(kv, tp)
    return [
        LinearShape("qkv", (q_rank + 2 * kv_rank) * head_dim, hidden, qkv_bias, layers),
        LinearShape("o", hidden, q_rank * head_dim, o_bias, layers),
    ]


def _mlp(prefix: str, hidden: int, inter: int, tp: int, bias: bool, count: int, experts=0, top_k=0):
    i_rank = _split(inter, tp, f"{prefix or 'mlp '}intermediate size")
    return [
        LinearShape(f"{prefix}gate_up", 2 * i_rank, hidden, bias, count, experts, top_k),
        LinearShape(f"{prefix}down", hidden, i_rank, bias, count, experts, top_k),
    ]


def _lm_head(cfg: dict, tp: int) -> LinearShape:
    return LinearShape("lm_head", math.ceil(_req(cfg, "vocab_size") / tp), _req(cfg, "hidden_size"), False, 1)


# ---- architectures -------------------------------------------------------------------------------
def _dense(cfg: dict, tp: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> list[LinearShape]:
    layers = _req(cfg, "num_hidden_layers")
    hidden = _req(cfg, "hidden_size")
    return [
        *_attention(cfg, tp, qkv_bias, o_bias, layers),
        *_mlp("", hidden, _req(cfg, "intermediate_size"), tp, mlp_bias, layers),
        _lm_head(cfg, tp),
    ]


def _llama_like(cfg: dict, tp: int) -> list[LinearShape]:
    # Llama, Mistral, Qwen3, Gemma*, Phi3: attention_bias covers q/k/v/o; mlp_bias the MLP (Llama).
    ab = bool(cfg.get("attention_bias", False))
    return _dense(cfg, tp, ab, ab, bool(cfg.get("mlp_bias", False)))


def _qwen2(cfg: dict, tp: int) -> list[LinearShape]:
    # Qwen2 always has q/k/v bias and none on o or the MLP.
    return _dense(cfg, tp, True, False, False)


def _moe(
    cfg: dict,
    tp: int,
    experts: int,
    top_k: int,
    moe_inter: int,
    moe_layers: int,
    dense_layers: int,
    shared_inter: int = 0,
    shared_gate: bool = False,
) -> list[LinearShape]:
    hidden = _req(cfg, "hidden_size")
    out = [LinearShape("router", experts, hidden, False, moe_layers)]
    out += _mlp("expert_", hidden, moe_inter, tp, False, moe_layers * experts, experts, top_k)
    if shared_inter:
        out += _mlp("shared_expert_", hidden, shared_inter, tp, False, moe_layers)
        if shared_gate:
            out.append(LinearShape("shared_expert_gate", 1, hidden, False, moe_layers))
    if dense_layers:
        out += _mlp("", hidden, _req(cfg, "intermediate_size"), tp, bool(cfg.get("mlp_bias", False)), dense_layers)
    return out


def _sparse_layer_split(cfg: dict) -> tuple[int, int]:
    """(moe layers, dense layers) for Qwen MoE's decoder_sparse_step / mlp_only_layers."""
    layers = _req(cfg, "num_hidden_layers")
    step = _opt(cfg, "decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers") or [])
    moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    return moe, layers - moe


def _qwen_moe(cfg: dict, tp: int, qkv_bias: bool) -> list[LinearShape]:
    layers = _req(cfg, "num_hidden_layers")
    ab = bool(cfg.get("attention_bias", False))
    moe_layers, dense_layers = _sparse_layer_split(cfg)
    shared = _opt(cfg, "shared_expert_intermediate_size", 0)
    return [
        *_attention(cfg, tp, qkv_bias or ab, ab and not qkv_bias, layers),
        *_moe(
            cfg,
            tp,
            _req(cfg, "num_experts", "num_local_experts"),  # transformers 5.24 saves the latter
            _req(cfg, "num_experts_per_tok"),
            _req(cfg, "moe_intermediate_size"),
            moe_layers,
            dense_layers,
            shared,
            shared_gate=bool(shared),
        ),
        _lm_head(cfg, tp),
    ]


def _mixtral(cfg: dict, tp: int) -> list[LinearShape]:
    layers = _req(cfg, "num_hidden_layers")
    return [
        *_attention(cfg, tp, False, False, layers),
        *_moe(
            cfg,
            tp,
            _req(cfg, "num_local_experts", "num_experts"),
            _req(cfg, "num_experts_per_tok"),
            _req(cfg, "intermediate_size"),
            layers,
            0,
        ),
        _lm_head(cfg, tp),
    ]


def _routed_moe(experts_key: str, inter_key: str):
    """Every layer an MoE block of `experts_key` experts of size `inter_key`, attention_bias on q/k/v/o
    (OLMoE, GraniteMoE)."""

    def shapes(cfg: dict, tp: int) -> list[LinearShape]:
        layers = _req(cfg, "num_hidden_layers")
        ab = bool(cfg.get("attention_bias", False))
        experts, top_k, inter = _req(cfg, experts_key), _req(cfg, "num_experts_per_tok"), _req(cfg, inter_key)
        return [*_attention(cfg, tp, ab, ab, layers), *_moe(cfg, tp, experts, top_k, inter, layers, 0),
                _lm_head(cfg, tp)]  # fmt: skip

    return shapes


def _glm4_moe(cfg: dict, tp: int) -> list[LinearShape]:
    """GLM-4-MoE: Llama-style attention (attention_bias on q/k/v only), DeepSeek-style MoE layers after
    first_k_dense_replace dense ones, shared experts of n_shared_experts * moe_intermediate_size."""
    layers = _req(cfg, "num_hidden_layers")
    dense = min(_opt(cfg, "first_k_dense_replace", 0), layers)
    moe_inter = _req(cfg, "moe_intermediate_size")
    shared = _opt(cfg, "n_shared_experts", 0) * moe_inter
    experts, top_k = _req(cfg, "n_routed_experts"), _req(cfg, "num_experts_per_tok")
    return [
        *_attention(cfg, tp, bool(cfg.get("attention_bias", False)), False, layers),
        *_moe(cfg, tp, experts, top_k, moe_inter, layers - dense, dense, shared),
        _lm_head(cfg, tp),
    ]


def _deepseek(cfg: dict, tp: int) -> list[LinearShape]:
    """DeepSeek V2/V3 (MLA attention + shared/routed experts), as vLLM runs the prefill path."""
    layers = _req(cfg, "num_hidden_layers")
    hidden = _req(cfg, "hidden_size")
    heads = _split(_req(cfg, "num_attention_heads"), tp, "num_attention_heads")
    nope, rope = _req(cfg, "qk_nope_head_dim"), _req(cfg, "qk_rope_head_dim")
    v_dim, kv_lora = _req(cfg, "v_head_dim"), _req(cfg, "kv_lora_rank")
    q_lora = _opt(cfg, "q_lora_rank", 0)
    ab = bool(cfg.get("attention_bias", False))
    out: list[LinearShape] = []
    if q_lora:
        out.append(LinearShape("qkv_a", q_lora + kv_lora + rope, hidden, ab, layers))
        out.append(LinearShape("q_b", heads * (nope + rope), q_lora, False, layers))
    else:
        out.append(LinearShape("q", heads * (nope + rope), hidden, False, layers))
        out.append(LinearShape("kv_a", kv_lora + rope, hidden, ab, layers))
    out.append(LinearShape("kv_b", heads * (nope + v_dim), kv_lora, False, layers))
    out.append(LinearShape("o", hidden, heads * v_dim, ab, layers))
    dense = min(_opt(cfg, "first_k_dense_replace", 0), layers)
    moe_inter = _req(cfg, "moe_intermediate_size")
    shared = _opt(cfg, "n_shared_experts", 0) * moe_inter
    out += _moe(
        cfg,
        tp,
        _req(cfg, "n_routed_experts"),
        _req(cfg, "num_experts_per_tok"),
        moe_inter,
        layers - dense,
        dense,
        shared,
    )
    out.append(_lm_head(cfg, tp))
    return out


ARCHITECTURES = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen3": _llama_like,
    "gemma": _llama_like,
    "gemma2": _llama_like,
    "gemma3": _llama_like,
    "gemma3_text": _llama_like,
    "phi3": _llama_like,
    "qwen2": _qwen2,
    "mixtral": _mixtral,
    "qwen2_moe": lambda cfg, tp: _qwen_moe(cfg, tp, qkv_bias=True),
    "qwen3_moe": lambda cfg, tp: _qwen_moe(cfg, tp, qkv_bias=False),
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "olmoe": _routed_moe("num_experts", "intermediate_size"),
    "granitemoe": _routed_moe("num_local_experts", "intermediate_size"),
    "glm4_moe": _glm4_moe,
}
# Model types above whose config is a multimodal wrapper: the language model's sizes are in text_config.
NESTING_TYPES = frozenset({"gemma3"})
# The `architectures` class names that map onto the model types above (configs without model_type).
_CLASS_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "Glm4MoeForCausalLM": "glm4_moe",
}


def model_type_of(config: dict) -> str:
    cfg = text_config(config)
    mt = cfg.get("model_type")
    if mt in ARCHITECTURES:
        return mt
    for cls in config.get("architectures") or []:
        if cls in _CLASS_TO_TYPE:
            return _CLASS_TO_TYPE[cls]
    what = f"model_type {mt!r}" if mt else f"architectures {config.get('architectures')!r}"
    raise ModelConfigError(
        f"unsupported model architecture ({what}); supported model_type values: {', '.join(sorted(ARCHITECTURES))}"
    )


def model_gemms(config: dict, tp: int = 1) -> list[LinearShape]:
    """The distinct linear layers of one TP rank of the model described by an HF `config` dict."""
    if not isinstance(tp, int) or tp < 1:
        raise ModelConfigError(f"tp must be a positive integer, got {tp!r}")
    mt = model_type_of(config)
    return ARCHITECTURES[mt](text_config(config), tp)


@dataclass(frozen=True)
class BatchedShape:
    """One batched GEMM of a model (per TP rank): y[b] = x[b][M, K] @ w[b][K, N] for b < B, M = tokens."""

    name: str
    B: int
    N: int
    K: int
    transB: bool = True  # w stored per batch as (N, K), K contiguous (nn.Linear layout)
    count: int = 1  # instances in the whole model (layers)


def _mla_batched(cfg: dict, tp: int) -> list[BatchedShape]:
    """DeepSeek MLA's absorbed decode path: per head, q_nope @ W_UK maps the query into the latent
    space (K = qk_nope_head_dim, N = kv_lora_rank), and the attention output (latent) @ W_UV maps it
    back (K = kv_lora_rank, N = v_head_dim). Both weights are slices of kv_b_proj, heads split over tp.

    Layout: SGLang keeps both per-head weights K-contiguous (w_kc, w_vc: (heads, N, K) storage), as
    aiter's batched kernels read them, so both are transB=True here. vLLM's MLA backends keep W_UV
    that way too but hold W_UK as W_UK_T, a permuted view of kv_b_proj with N contiguous (transB=False
    for that GEMM); a capture from vLLM records that layout in its rows."""
    layers = _req(cfg, "num_hidden_layers")
    heads = _split(_req(cfg, "num_attention_heads"), tp, "num_attention_heads")
    nope, v_dim, kv_lora = _req(cfg, "qk_nope_head_dim"), _req(cfg, "v_head_dim"), _req(cfg, "kv_lora_rank")
    return [
        BatchedShape("mla_q_nope_w_uk", heads, kv_lora, nope, True, layers),
        BatchedShape("mla_attn_w_uv", heads, v_dim, kv_lora, True, layers),
    ]


_BATCHED = {"deepseek_v2": _mla_batched, "deepseek_v3": _mla_batched}


def batched_gemms(config: dict, tp: int = 1) -> list[BatchedShape]:
    """The distinct batched GEMMs of one TP rank of the model (DeepSeek V2/V3's MLA); [] for others."""
    if not isinstance(tp, int) or tp < 1:
        raise ModelConfigError(f"tp must be a positive integer, got {tp!r}")
    fn = _BATCHED.get(model_type_of(config))
    return fn(text_config(config), tp) if fn else []


CONFIG_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def config_dtype(config: dict, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype the config says the model runs in (torch_dtype / dtype), else `default` when it says none.

    A dtype gemmtune does not tune (float64, int8, ...) is an error, not a silent `default`."""
    cfg = text_config(config)
    field = "torch_dtype" if cfg.get("torch_dtype") else "dtype"
    text = cfg.get(field)
    if not text:
        return default
    try:
        dtype = parse_dtype(str(text))
    except ValueError:
        dtype = None
    if dtype not in CONFIG_DTYPES:
        raise ModelConfigError(
            f"model config: {field}={text!r} is not a dtype gemmtune tunes (bfloat16, float16, float32); "
            "pass the dtype to use explicitly (gemmtune shapes --dtype)"
        )
    return dtype


def gemm_keys(
    shapes: Iterable[LinearShape],
    ms: Iterable[int],
    dtype: torch.dtype = torch.bfloat16,
    outdtype: torch.dtype | None = None,
) -> list[GemmKey]:
    """GemmKeys for every shape at every token count in `ms` (nsets), deduplicated, in shape then M order."""
    ms = list(ms)
    bad = [m for m in ms if not isinstance(m, int) or m < 1]
    if bad:
        raise ValueError(f"token counts must be positive integers, got {bad}")
    seen: dict[GemmKey, None] = {}
    for s in shapes:
        for m in ms:
            seen.setdefault(s.key(m, dtype, outdtype))
    return list(seen)


def named_keys(shapes: Iterable[LinearShape], ms: Iterable[int], dtype=torch.bfloat16, outdtype=None):
    """(layer names, key) pairs: like gemm_keys, with the layer names that share each key."""
    out: dict[GemmKey, list[str]] = {}
    for s in shapes:
        for m in ms:
            out.setdefault(s.key(m, dtype, outdtype), []).append(s.name)
    return [(names, k) for k, names in out.items()]


# ---- keys of each GEMM family ---------------------------------------------------------------------
def moe_keys(config: dict, tp: int = 1, ep: int = 1, tokens=(1,), dtype: torch.dtype = torch.bfloat16,
             activation: str | None = None, fuse_shared: bool = False) -> list[MoeKey]:  # fmt: skip
    """The fmoe keys one rank of an MoE model runs at each token count (empty for a dense model).

    tp splits every expert's intermediate size; ep splits the routed experts (each rank holds
    experts / ep of them and keys global_expert = experts). Shared experts are dense MLPs, as optimize()
    runs them (their GEMMs are in model_gemms); `fuse_shared` keys DeepSeek-V3's and GLM-4-MoE's shared
    experts of the routed experts' size as extra experts of the fmoe call (shared_expert =
    n_shared_experts), as aiter and SGLang run them. Qwen2-MoE's sigmoid-gated shared expert is folded
    into the call as optimize() folds it (models/moe_shared.py: ceil(shared / moe intermediate size)
    more experts, every token routed to all of them) where ep = 1; with ep > 1 it is dense.
    """
    cfg = text_config(config)
    mt = cfg.get("model_type", "")
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be positive, got tp={tp} ep={ep}")
    if mt == "mixtral":
        experts, inter = _req(cfg, "num_local_experts", "num_experts"), _req(cfg, "intermediate_size")
    elif mt in ("qwen2_moe", "qwen3_moe"):
        experts, inter = _req(cfg, "num_experts"), _req(cfg, "moe_intermediate_size")
    elif mt in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        experts, inter = _req(cfg, "n_routed_experts"), _req(cfg, "moe_intermediate_size")
    elif mt in ("olmoe", "granitemoe"):
        experts, inter = _req(cfg, "num_experts", "num_local_experts"), _req(cfg, "intermediate_size")
    else:
        return []
    topk = _req(cfg, "num_experts_per_tok")
    fusable = mt.startswith("deepseek") or mt == "glm4_moe"
    shared = _opt(cfg, "n_shared_experts", 0) if fuse_shared and fusable else 0
    for what, total, parts in (("experts", experts, ep), ("intermediate size", inter, tp)):
        if total % parts:
            raise ValueError(f"{mt}: {what} {total} do not split over {parts} ranks")
    folded = -(-_opt(cfg, "shared_expert_intermediate_size", 0) // inter) if mt == "qwen2_moe" and ep == 1 else 0
    experts, topk = experts + folded, topk + folded
    act = activation or {"gelu_pytorch_tanh": "gelu_tanh"}.get(cfg.get("hidden_act", "silu"), cfg.get("hidden_act"))
    act_type = ACT_TYPES.get(act, "ActivationType.Silu")
    return [MoeKey(t, _req(cfg, "hidden_size"), inter // tp, experts // ep + shared, topk, act_type, dtype, dtype,
                   dtype, "QuantType.No", True, False, experts if ep > 1 else 0, shared) for t in tokens]  # fmt: skip


# config hidden_act -> the epilogue family's act, for Linear -> act -> Linear MLPs
_MLP_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "relu": "relu"}  # fmt: skip


def mlp_shape(config: dict) -> tuple[int, int, str, bool] | None:
    """(hidden, intermediate, act, bias) of a Linear -> act -> Linear model's MLP (GPT-NeoX, Phi, Starcoder2,
    Falcon: the MLPs models/epilogue_mlp.py fuses), or None."""
    config = text_config(config)
    mt = config.get("model_type")
    hidden = config.get("hidden_size")
    if mt in ("gpt_neox", "phi", "starcoder2"):
        inter, act_name = config.get("intermediate_size"), config.get("hidden_act", "gelu")
        bias = bool(config.get("use_bias", True)) if mt == "starcoder2" else True
    elif mt == "falcon":
        inter = config.get("ffn_hidden_size") or (4 * hidden if hidden else None)
        act_name, bias = config.get("activation", "gelu"), bool(config.get("bias", False))
    else:
        return None
    act = _MLP_ACTS.get(act_name)
    if not hidden or not inter or act is None:
        return None
    return int(hidden), int(inter), act, bias


def epilogue_keys(config: dict, tp: int, ms: Iterable[int], dtype: torch.dtype) -> list[EpilogueKey]:
    """The epilogue-family keys of such a model at token counts `ms`: up as GEMM + bias + act (its
    columns split over tp ranks), down as GEMM + bias (rows split; with tp > 1 the bias follows the
    all-reduce, so the GEMM has none)."""
    shape = mlp_shape(config)
    if shape is None:
        return []
    hidden, inter, act, bias = shape
    n_up, k_down = inter // tp, inter // tp
    out = []
    for m in ms:
        out.append(EpilogueKey(m, n_up, hidden, bias, dtype, dtype, act))
        out.append(EpilogueKey(m, hidden, k_down, bias and tp == 1, dtype, dtype))
    return out


def _weight_shapes(config: dict, tp: int) -> list[tuple[int, int]]:
    """The distinct (N, K) of the model's linear layers."""
    return list(dict.fromkeys((s.N, s.K) for s in model_gemms(config, tp)))


def _quant_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 8-bit type a model's GEMMs are tuned for: its own when quantized, else fp8."""
    return dtype if formats.is_quant_dtype(dtype) else formats.FP8


def _a8w8_keys(config, tp, ms, dtype) -> list[QuantKey]:
    q = _quant_dtype(dtype)
    return [QuantKey(m, n, k, q, "per_token", False, torch.bfloat16) for n, k in _weight_shapes(config, tp) for m in ms]


def _blockscale_keys(config, tp, ms, dtype) -> list[BlockKey]:
    q = _quant_dtype(dtype)
    return [BlockKey(m, n, k, q, torch.bfloat16) for n, k in _weight_shapes(config, tp) if k % formats.BLOCK == 0
            for m in ms]  # fmt: skip


def _batched_keys(config, tp, ms, dtype) -> list[BatchedKey]:
    return [BatchedKey(s.B, m, s.N, s.K, dtype, dtype, False, s.transB) for s in batched_gemms(config, tp)
            for m in ms]  # fmt: skip


def _fmoe_keys(config, tp, ms, dtype, fuse_shared: bool = False) -> list[MoeKey]:
    return moe_keys(config, tp, 1, ms, dtype, fuse_shared=fuse_shared)


# family name -> (config, tp, token counts, dtype) -> the family's keys the model runs
FAMILY_KEYS: dict[str, Callable[[dict, int, Sequence[int], torch.dtype], list]] = {
    "a16w16": lambda config, tp, ms, dtype: gemm_keys(model_gemms(config, tp), ms, dtype),
    "batched": _batched_keys,
    "a8w8": _a8w8_keys,
    "a8w8_bpreshuffle": _a8w8_keys,
    "a8w8_blockscale": _blockscale_keys,
    "a8w8_blockscale_bpreshuffle": _blockscale_keys,
    "fmoe": _fmoe_keys,
    "epilogue": epilogue_keys,
}
# Families a model runs besides its linear layers (the others run the same linear layers another way:
# quantized, fused epilogue).
OWN_GEMMS = ("batched", "fmoe")


def model_keys(family: str, config: dict, tp: int, ms: Sequence[int], dtype: torch.dtype, **options) -> list:
    """The keys of `family` one TP rank of the model runs at token counts `ms` (empty when it runs none,
    or gemmtune derives none for that family); `options` go to the family's deriver (fmoe: fuse_shared)."""
    derive = FAMILY_KEYS.get(family)
    return derive(config, tp, list(ms), dtype, **options) if derive else []


# ---- presets -------------------------------------------------------------------------------------
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


MAX_TOKENS = 1 << 24  # a token count beyond this is a typo, not a GEMM anyone runs (16M tokens)


def parse_nsets(text: str) -> list[int]:
    """'1,16,256' or '32..8192' (powers of two between) or a mix -> sorted unique token counts in
    [1, MAX_TOKENS]; ValueError naming the bad part for an empty item, a bad number or range."""
    out: set[int] = set()
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # a trailing comma is harmless
    for part in parts:
        try:
            if not part:
                raise ValueError
            if ".." in part:
                lo, hi = (int(v) for v in part.split("..", 1))
                if not 1 <= lo <= hi <= MAX_TOKENS:
                    raise ValueError
                m = lo
                while m <= hi:
                    out.add(m)
                    m *= 2
            else:
                v = int(part)
                if not 1 <= v <= MAX_TOKENS:
                    raise ValueError
                out.add(v)
        except ValueError:
            raise ValueError(f"bad token count {part!r} in {text!r} (integers 1..{MAX_TOKENS}, or LO..HI)") from None
    if not out:
        raise ValueError(f"no token counts in {text!r}")
    return sorted(out)
