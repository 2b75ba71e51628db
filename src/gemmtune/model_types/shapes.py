"""The GEMM shapes of each architecture, from its Hugging Face config: building blocks (attention, MLP,
MoE, lm_head) and one shape function per layout, which registry entries name.

Conventions (M = tokens, N = output features, K = input features, weight [N, K]):
- Fused projections as vLLM/SGLang run them: one `qkv` GEMM (q, k and v heads side by side) and one
  `gate_up` GEMM (gate and up side by side); DeepSeek's MLA fuses q_a and kv_a into `qkv_a`.
- Megatron-style tensor parallelism over `tp` ranks (the shapes of one rank): column-parallel layers
  (qkv, gate_up, up, expert_gate_up, kv_b, q_b, lm_head) are split along N, row-parallel layers (o, down,
  expert_down) along K. KV heads are replicated when there are fewer than tp: a rank holds
  max(1, kv_heads / tp) of them. The MoE router and MLA's qkv_a are replicated (not split).
- lm_head: N = ceil(vocab_size / tp) (no vocab padding), emitted whether or not embeddings are tied.
- Expert GEMMs (expert_gate_up, expert_down) are the per-expert GEMM of a grouped MoE: at T tokens
  an expert sees on average ceil(T * top_k / num_experts) of them, which is the M they are keyed on.
- Row-parallel layers keep their bias in the GEMM (the rank that adds it runs the same shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..keys import GemmKey
from .config import ModelConfigError, kv_per_rank, optional, required, split
from .epilogue_layout import EpilogueLayout


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


@dataclass(frozen=True)
class BatchedShape:
    """One batched GEMM of a model (per TP rank): y[b] = x[b][M, K] @ w[b][K, N] for b < B, M = tokens."""

    name: str
    B: int
    N: int
    K: int
    transB: bool = True  # w stored per batch as (N, K), K contiguous (nn.Linear layout)
    count: int = 1  # instances in the whole model (layers)


# ---- building blocks -----------------------------------------------------------------------------
def attention(cfg: dict, tp: int, qkv_bias: bool, o_bias: bool, layers: int, kv_default: int = 0) -> list[LinearShape]:
    """Multi-head / grouped-query attention: the fused qkv and o projections. A config without
    num_key_value_heads has `kv_default` of them (0: one per query head)."""
    hidden = required(cfg, "hidden_size")
    heads = required(cfg, "num_attention_heads")
    kv = optional(cfg, "num_key_value_heads", kv_default or heads)
    return fused_attention(hidden, heads, kv, optional(cfg, "head_dim", hidden // heads), tp, qkv_bias, o_bias, layers)


def fused_attention(hidden: int, heads: int, kv: int, head_dim: int, tp: int, qkv_bias: bool, o_bias: bool,
                    layers: int, kv_field: str = "num_key_value_heads") -> list[LinearShape]:  # fmt: skip
    """The qkv and o projections of `heads` query heads and `kv` KV heads (config field `kv_field`) of
    `head_dim`."""
    if heads % kv:
        raise ModelConfigError(
            f"model config: num_attention_heads={heads} is not a multiple of {kv_field}={kv} "
            "(each KV head serves a whole group of query heads)"
        )
    if head_dim < 1:
        raise ModelConfigError(f"model config: hidden_size={hidden} / num_attention_heads={heads} gives head_dim 0")
    q_rank = split(heads, tp, "num_attention_heads")
    kv_rank = kv_per_rank(kv, tp, kv_field)
    return [
        LinearShape("qkv", (q_rank + 2 * kv_rank) * head_dim, hidden, qkv_bias, layers),
        LinearShape("o", hidden, q_rank * head_dim, o_bias, layers),
    ]


def mlp(prefix: str, hidden: int, inter: int, tp: int, bias: bool, count: int, experts=0, top_k=0):
    """A gated MLP: the fused gate_up and the down projection."""
    i_rank = split(inter, tp, f"{prefix or 'mlp '}intermediate size")
    return [
        LinearShape(f"{prefix}gate_up", 2 * i_rank, hidden, bias, count, experts, top_k),
        LinearShape(f"{prefix}down", hidden, i_rank, bias, count, experts, top_k),
    ]


def lm_head(cfg: dict, tp: int, bias: bool = False) -> LinearShape:
    return LinearShape("lm_head", math.ceil(required(cfg, "vocab_size") / tp), required(cfg, "hidden_size"), bias, 1)


def linear_act_linear(cfg: dict, tp: int, layout: EpilogueLayout, layers: int) -> list[LinearShape]:
    """A Linear -> act -> Linear MLP (no gate): its up and down projections, sized as `layout` reads them."""
    hidden = required(cfg, "hidden_size")
    i_rank = split(layout.required_intermediate_size(cfg), tp, layout.intermediate_field)
    bias = layout.bias(cfg)
    return [LinearShape("up", i_rank, hidden, bias, layers), LinearShape("down", hidden, i_rank, bias, layers)]


def moe(
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
    """The router, routed experts and shared experts of `moe_layers` MoE layers, and the MLPs of the
    `dense_layers` layers beside them."""
    hidden = required(cfg, "hidden_size")
    out = [LinearShape("router", experts, hidden, False, moe_layers)]
    out += mlp("expert_", hidden, moe_inter, tp, False, moe_layers * experts, experts, top_k)
    if shared_inter:
        out += mlp("shared_expert_", hidden, shared_inter, tp, False, moe_layers)
        if shared_gate:
            out.append(LinearShape("shared_expert_gate", 1, hidden, False, moe_layers))
    if dense_layers:
        out += mlp("", hidden, required(cfg, "intermediate_size"), tp, bool(cfg.get("mlp_bias", False)), dense_layers)
    return out


# ---- shape functions of the registry's entries ---------------------------------------------------
def dense(cfg: dict, tp: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> list[LinearShape]:
    layers = required(cfg, "num_hidden_layers")
    hidden = required(cfg, "hidden_size")
    return [
        *attention(cfg, tp, qkv_bias, o_bias, layers),
        *mlp("", hidden, required(cfg, "intermediate_size"), tp, mlp_bias, layers),
        lm_head(cfg, tp),
    ]


def llama_like(cfg: dict, tp: int) -> list[LinearShape]:
    """Llama, Mistral, Qwen3, Gemma*, Phi3: attention_bias covers q/k/v/o; mlp_bias the MLP (Llama)."""
    ab = bool(cfg.get("attention_bias", False))
    return dense(cfg, tp, ab, ab, bool(cfg.get("mlp_bias", False)))


def qwen2(cfg: dict, tp: int) -> list[LinearShape]:
    """Qwen2 always has q/k/v bias and none on o or the MLP."""
    return dense(cfg, tp, True, False, False)


def _heads_split_hidden(cfg: dict) -> tuple[int, int, int]:
    """(hidden, heads, head_dim) of an attention whose head_dim is hidden / heads, which must divide."""
    hidden, heads = required(cfg, "hidden_size"), required(cfg, "num_attention_heads")
    if hidden % heads:
        raise ModelConfigError(f"model config: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                               f"(model_type {cfg.get('model_type')!r})")  # fmt: skip
    return hidden, heads, hidden // heads


def gpt_neox_attention(cfg: dict, tp: int, layers: int) -> list[LinearShape]:
    """GPT-NeoX / Pythia: query_key_value (q, k and v of each head side by side, one KV head per query head)
    and dense (o), both with attention_bias (transformers' default: on)."""
    hidden, heads, head_dim = _heads_split_hidden(cfg)
    bias = bool(cfg.get("attention_bias", True))
    return fused_attention(hidden, heads, heads, head_dim, tp, bias, bias, layers)


def phi_attention(cfg: dict, tp: int, layers: int) -> list[LinearShape]:
    """Phi-1/1.5/2: q/k/v and dense (o) always with a bias."""
    return attention(cfg, tp, True, True, layers)


def starcoder2_attention(cfg: dict, tp: int, layers: int) -> list[LinearShape]:
    """Starcoder2: q/k/v/o with use_bias (default on); transformers' default is 2 KV heads."""
    bias = bool(cfg.get("use_bias", True))
    return attention(cfg, tp, bias, bias, layers, kv_default=2)


def falcon_attention(cfg: dict, tp: int, layers: int) -> list[LinearShape]:
    """Falcon's fused query_key_value and dense (o), both with `bias` (default off). The new decoder
    architecture (Falcon-40B/180B, Falcon2) has num_kv_heads KV heads and ignores multi_query; the old one
    has one KV head with multi_query (its default: Falcon-7B) and one per query head without it."""
    hidden, heads, head_dim = _heads_split_hidden(cfg)
    if cfg.get("new_decoder_architecture", False):
        kv = optional(cfg, "num_kv_heads", heads)
    elif cfg.get("multi_query", True):
        kv = 1
    else:
        kv = optional(cfg, "num_kv_heads", heads)
        if kv != heads:  # its fused projection holds 3 * hidden_size; transformers' forward cannot split it
            raise ModelConfigError(
                f"model config: num_kv_heads={kv} with num_attention_heads={heads} needs "
                "new_decoder_architecture=true (Falcon's old architecture without multi_query has one KV head "
                "per query head)"
            )
    bias = bool(cfg.get("bias", False))
    return fused_attention(hidden, heads, kv, head_dim, tp, bias, bias, layers, kv_field="num_kv_heads")


def epilogue_mlp_model(attention_fn, layout: EpilogueLayout, lm_head_bias: bool = False):
    """A decoder of `attention_fn`'s attention and `layout`'s Linear -> act -> Linear MLP in every layer."""

    def shapes(cfg: dict, tp: int) -> list[LinearShape]:
        layers = required(cfg, "num_hidden_layers")
        return [*attention_fn(cfg, tp, layers), *linear_act_linear(cfg, tp, layout, layers),
                lm_head(cfg, tp, lm_head_bias)]  # fmt: skip

    return shapes


def _sparse_layer_split(cfg: dict) -> tuple[int, int]:
    """(moe layers, dense layers) for Qwen MoE's decoder_sparse_step / mlp_only_layers."""
    layers = required(cfg, "num_hidden_layers")
    step = optional(cfg, "decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    return moe_layers, layers - moe_layers


# Qwen-MoE configs name their expert count num_experts; transformers 5.24's Qwen3MoeConfig writes it as
# num_local_experts (its attribute_map), so a config it saved has only that.
QWEN_MOE_EXPERTS = ("num_experts", "num_local_experts")


def qwen_moe(qkv_bias: bool):
    """Qwen2/3-MoE: sparse layers by decoder_sparse_step, a sigmoid-gated shared expert when sized;
    `qkv_bias` (Qwen2-MoE) puts a bias on q/k/v whatever attention_bias says."""

    def shapes(cfg: dict, tp: int) -> list[LinearShape]:
        layers = required(cfg, "num_hidden_layers")
        ab = bool(cfg.get("attention_bias", False))
        moe_layers, dense_layers = _sparse_layer_split(cfg)
        shared = optional(cfg, "shared_expert_intermediate_size", 0)
        return [
            *attention(cfg, tp, qkv_bias or ab, ab and not qkv_bias, layers),
            *moe(
                cfg,
                tp,
                required(cfg, *QWEN_MOE_EXPERTS),
                required(cfg, "num_experts_per_tok"),
                required(cfg, "moe_intermediate_size"),
                moe_layers,
                dense_layers,
                shared,
                shared_gate=bool(shared),
            ),
            lm_head(cfg, tp),
        ]

    return shapes


def mixtral(cfg: dict, tp: int) -> list[LinearShape]:
    layers = required(cfg, "num_hidden_layers")
    return [
        *attention(cfg, tp, False, False, layers),
        *moe(
            cfg,
            tp,
            required(cfg, "num_local_experts", "num_experts"),
            required(cfg, "num_experts_per_tok"),
            required(cfg, "intermediate_size"),
            layers,
            0,
        ),
        lm_head(cfg, tp),
    ]


def routed_moe(experts_key: str, inter_key: str):
    """Every layer an MoE block of `experts_key` experts of size `inter_key`, attention_bias on q/k/v/o
    (OLMoE, GraniteMoE)."""

    def shapes(cfg: dict, tp: int) -> list[LinearShape]:
        layers = required(cfg, "num_hidden_layers")
        ab = bool(cfg.get("attention_bias", False))
        experts, top_k = required(cfg, experts_key), required(cfg, "num_experts_per_tok")
        inter = required(cfg, inter_key)
        return [*attention(cfg, tp, ab, ab, layers), *moe(cfg, tp, experts, top_k, inter, layers, 0),
                lm_head(cfg, tp)]  # fmt: skip

    return shapes


def glm4_moe(cfg: dict, tp: int) -> list[LinearShape]:
    """GLM-4-MoE: Llama-style attention (attention_bias on q/k/v only), DeepSeek-style MoE layers after
    first_k_dense_replace dense ones, shared experts of n_shared_experts * moe_intermediate_size."""
    layers = required(cfg, "num_hidden_layers")
    dense_layers = min(optional(cfg, "first_k_dense_replace", 0), layers)
    moe_inter = required(cfg, "moe_intermediate_size")
    shared = optional(cfg, "n_shared_experts", 0) * moe_inter
    experts, top_k = required(cfg, "n_routed_experts"), required(cfg, "num_experts_per_tok")
    return [
        *attention(cfg, tp, bool(cfg.get("attention_bias", False)), False, layers),
        *moe(cfg, tp, experts, top_k, moe_inter, layers - dense_layers, dense_layers, shared),
        lm_head(cfg, tp),
    ]


def deepseek(cfg: dict, tp: int) -> list[LinearShape]:
    """DeepSeek V2/V3 (MLA attention + shared/routed experts), as vLLM runs the prefill path."""
    layers = required(cfg, "num_hidden_layers")
    hidden = required(cfg, "hidden_size")
    heads = split(required(cfg, "num_attention_heads"), tp, "num_attention_heads")
    nope, rope = required(cfg, "qk_nope_head_dim"), required(cfg, "qk_rope_head_dim")
    v_dim, kv_lora = required(cfg, "v_head_dim"), required(cfg, "kv_lora_rank")
    q_lora = optional(cfg, "q_lora_rank", 0)
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
    dense_layers = min(optional(cfg, "first_k_dense_replace", 0), layers)
    moe_inter = required(cfg, "moe_intermediate_size")
    shared = optional(cfg, "n_shared_experts", 0) * moe_inter
    out += moe(
        cfg,
        tp,
        required(cfg, "n_routed_experts"),
        required(cfg, "num_experts_per_tok"),
        moe_inter,
        layers - dense_layers,
        dense_layers,
        shared,
    )
    out.append(lm_head(cfg, tp))
    return out


def mla_batched(cfg: dict, tp: int) -> list[BatchedShape]:
    """DeepSeek MLA's absorbed decode path: per head, q_nope @ W_UK maps the query into the latent
    space (K = qk_nope_head_dim, N = kv_lora_rank), and the attention output (latent) @ W_UV maps it
    back (K = kv_lora_rank, N = v_head_dim). Both weights are slices of kv_b_proj, heads split over tp.

    Layout: SGLang keeps both per-head weights K-contiguous (w_kc, w_vc: (heads, N, K) storage), as
    aiter's batched kernels read them, so both are transB=True here. vLLM's MLA backends keep W_UV
    that way too but hold W_UK as W_UK_T, a permuted view of kv_b_proj with N contiguous (transB=False
    for that GEMM); a capture from vLLM records that layout in its rows."""
    layers = required(cfg, "num_hidden_layers")
    heads = split(required(cfg, "num_attention_heads"), tp, "num_attention_heads")
    nope, v_dim, kv_lora = required(cfg, "qk_nope_head_dim"), required(cfg, "v_head_dim"), required(cfg, "kv_lora_rank")
    return [
        BatchedShape("mla_q_nope_w_uk", heads, kv_lora, nope, True, layers),
        BatchedShape("mla_attn_w_uv", heads, v_dim, kv_lora, True, layers),
    ]
