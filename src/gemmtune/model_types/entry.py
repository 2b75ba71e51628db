"""What one registry entry says about a Hugging Face model type: the layout optimize() rewrites, how its
config becomes GEMM shapes, and the class names its configs may carry instead of a model_type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .epilogue_layout import EpilogueLayout
from .shapes import BatchedShape, LinearShape


@dataclass(frozen=True)
class Architecture:
    """The module layout optimize() rewrites (models/api.py reads these fields)."""

    name: str
    prefix: str  # class-name prefix: f"{prefix}DecoderLayer", f"{prefix}Attention"
    # None: no q/k/v to fuse (the model already fuses them, or its attention forward stays stock)
    qkv: tuple[str, ...] | None = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] | None = ("gate_proj", "up_proj")
    # "prenorm" (Llama), "sandwich" (Gemma2/3: norms after attn and mlp too) or "scaled" (prenorm with
    # residual_multiplier on both branches: GraniteMoE)
    layer: str = "prenorm"
    qk_norm: bool = False
    qk_norm_flag: str | None = None  # attention attribute that turns the q/k norms on per instance
    attn_norms: tuple[str, ...] = ()  # RMSNorms a stock attention forward calls (swapped one by one)
    softcap_kwarg: bool = False  # the stock forward passes attn_logit_softcapping to attention
    moe: bool = False
    mlp: str = "mlp"  # the layer's MLP / MoE block attribute
    mla: bool = False  # multi-head latent attention: decode on the latent cache (models/mla.py)


LAYOUTS = ("prenorm", "sandwich", "scaled")
# How a model type's shared experts join the fused MoE call (moe_keys):
# "fusable": n_shared_experts of the routed experts' size, fused only on request (DeepSeek, GLM-4-MoE);
# "folded": a sigmoid-gated shared expert folded in as optimize() folds it (Qwen2-MoE, models/moe_shared.py).
SHARED_EXPERTS = ("", "fusable", "folded")


@dataclass(frozen=True)
class Experts:
    """Where a config keeps its routed experts' sizes: the fused-MoE (fmoe) keys read them."""

    count: tuple[str, ...]  # config fields of the routed expert count, the first one present wins
    intermediate: str  # config field of one expert's intermediate size
    shared: str = ""  # one of SHARED_EXPERTS

    def __post_init__(self):
        if self.shared not in SHARED_EXPERTS:
            raise ValueError(f"Experts: shared={self.shared!r} is not one of {SHARED_EXPERTS}")


ShapeFn = Callable[[dict, int], list[LinearShape]]  # (language-model config, tp) -> linear layers of one rank
BatchedFn = Callable[[dict, int], list[BatchedShape]]


@dataclass(frozen=True)
class ModelType:
    """One Hugging Face model type gemmtune knows (one entry of registry.REGISTRY)."""

    model_type: str
    title: str  # the model family as the docs name it
    classes: tuple[str, ...]  # config `architectures` class names meaning this model type
    shapes: ShapeFn  # its linear layers, for `gemmtune shapes` and the tuner
    optimize: Architecture | None  # the layout optimize() rewrites; None: only Linear routing
    not_optimized: str = ""  # why optimize() has no layout for it (required when optimize is None)
    # its Linear -> act -> Linear MLP, which optimize() runs on the fused-epilogue GEMMs with or without a layout
    epilogue_mlp: EpilogueLayout | None = None
    batched: BatchedFn | None = None  # its batched GEMMs (DeepSeek MLA's absorbed projections)
    experts: Experts | None = None  # its routed experts, for the fused-MoE keys
    nests_text_config: bool = False  # a multimodal wrapper: the language model's sizes are in text_config

    def __post_init__(self):
        if (self.optimize is None) == (not self.not_optimized):
            raise ValueError(
                f"model type {self.model_type!r}: give either an optimize() layout or the reason it has none, "
                f"not both (optimize={self.optimize!r}, not_optimized={self.not_optimized!r})"
            )
        if self.optimize is not None and self.optimize.layer not in LAYOUTS:
            raise ValueError(f"model type {self.model_type!r}: layer={self.optimize.layer!r} is not one of {LAYOUTS}")
        if self.optimize is not None and self.optimize.moe != (self.experts is not None):
            raise ValueError(f"model type {self.model_type!r}: an MoE layout needs its Experts, and only it")
