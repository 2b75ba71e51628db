"""The replacement forwards optimize() installs on instances, and the detection that decides them. What
each architecture (a Hugging Face model type: llama, qwen3_moe ...) looks like, its module layout, is its
entry of the architecture registry (gemmtune.model_types).

Every replacement forward reproduces the stock forward of transformers 5.17-5.24 op for op, except
where a fused op stands in for several (one GEMM for q/k/v or gate/up, one kernel for a norm, for
residual add + norm, for act(gate) * up, for rope or q/k norms + rope). Layouts are checked per
instance before anything changes (class names, attribute names, sizes), and norm/activation formulas
are confirmed on a probe tensor against the module's own forward, so a layout this file does not know
is skipped, not guessed.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.activations import act_mul
from ..kernels.norms import add_rmsnorm, rmsnorm, rmsnorm_ref
from ..kernels.qk_norm_rope import qk_norm_rope
from ..kernels.rope import rope, rope_ref
from ..model_types import REGISTRY, Architecture
from . import static_cache
from .hf_cache import CACHE_ARGS, pop_cache

# The layouts optimize() rewrites, by model type: the registry's entries that have one (gemmtune.model_types).
ARCHITECTURES: dict[str, Architecture] = {mt: e.optimize for mt, e in REGISTRY.items() if e.optimize is not None}


LAYER_NORMS = {
    "prenorm": ("input_layernorm", "post_attention_layernorm"),
    "scaled": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}


def architecture_of(model) -> Architecture | None:
    return ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))


def decoder_stack(model) -> tuple[str, nn.Module] | None:
    """(path, module) of the module holding `layers` (and the final `norm`), e.g. ('model', LlamaModel)."""
    for path, mod in (("model", getattr(model, "model", None)), ("", model)):
        if isinstance(mod, nn.Module) and isinstance(getattr(mod, "layers", None), nn.ModuleList):
            return path, mod
    return None


def is_moe_block(mod: nn.Module) -> bool:
    return hasattr(mod, "experts")


# ---- norms --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NormSpec:
    eps: float
    offset: float
    cast_before_weight: bool

    @property
    def style(self) -> str:
        return "llama" if self.cast_before_weight else "gemma(1+w)" if self.offset else "fp32-weight"


def _probe(shape, device, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def detect_norm(mod: nn.Module) -> NormSpec | str:
    """The RMSNorm formula `mod` computes, confirmed bit for bit on a probe; else a skip reason."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return f"{type(mod).__name__} has no 1-D weight"
    if "forward" in mod.__dict__:
        return "its forward is already overridden on the instance"
    if w.device.type == "meta":
        return "weights are not materialized (meta device)"
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(eps, float):
        return f"{type(mod).__name__} has no float eps / variance_epsilon"
    x = _probe((3, w.shape[0]), w.device, w.dtype, seed=1234)
    with torch.no_grad():
        want = type(mod).forward(mod, x)  # the class forward: no hooks, no instance overrides
        for spec in (NormSpec(eps, 0.0, True), NormSpec(eps, 1.0, False), NormSpec(eps, 0.0, False)):
            got = rmsnorm_ref(x, w, eps, offset=spec.offset, cast_before_weight=spec.cast_before_weight)
            if got.dtype == want.dtype and torch.equal(got, want):
                return spec
    return f"{type(mod).__name__}.forward does not match a known RMSNorm formula on a probe"


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    s = self._gemmtune_norm
    return rmsnorm(hidden_states, self.weight, s.eps, offset=s.offset, cast_before_weight=s.cast_before_weight)


# norm.__dict__ of a swapped norm: its (x, residual) -> (h, residual + x), what the fused layer forwards
# call; _add_norm_forward, or quant_feeds.py's, which hands h on quantized for the 8-bit GEMM after it
ADD_NORM = "_gemmtune_add_norm"


def _add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor):
    s = self._gemmtune_norm
    return add_rmsnorm(x, residual, self.weight, s.eps, offset=s.offset, cast_before_weight=s.cast_before_weight)


# ---- activations --------------------------------------------------------------------------------
def detect_act(act_fn, device, dtype) -> str | None:
    """'silu' / 'gelu_tanh' when act_fn computes exactly that (probe), else None."""
    x = _probe((257,), device, dtype, seed=99) * 4
    with torch.no_grad():
        try:
            y = act_fn(x)
        except Exception:  # noqa: BLE001 - an activation we cannot even probe is not fused
            return None
        for name, ref in (("silu", torch.nn.functional.silu), ("gelu_tanh", _gelu_tanh)):
            if torch.equal(y, ref(x)):
                return name
    return None


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class MlpSpec:
    act: str | None  # fused activation kernel, or None to apply act_fn in torch
    act_attr: str  # "act_fn" (most) or "activation_fn" (Phi3)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    s = self._gemmtune_mlp
    gu = self.gate_up_proj(x)
    if s.act is not None:
        h = act_mul(gu, s.act)
    else:
        gate, up = gu.chunk(2, dim=-1)
        h = getattr(self, s.act_attr)(gate) * up
    return self.down_proj(h)


# ---- attention ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnSpec:
    sizes: tuple[int, int, int]  # q, k, v widths of the fused projection output
    head_dim: int
    qk_norm: bool
    pass_softcap: bool
    sliding_window: int | None
    rope_fused: str = ""  # "": the model's own function; "full": the kernel when R == D; "any": always
    # (q_norm, k_norm) formulas when both norms and the fused rope run in one kernel, else None
    qk_norms: tuple[NormSpec, NormSpec] | None = None
    cache_arg: str = "past_key_values"  # the stock forward's name for the KV cache (see attention_call)


def rope_function(attn: nn.Module):
    """The modeling module's own apply_rotary_pos_emb (partial rotary etc. stay exactly as stock)."""
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def detect_rope(fn, device, dtype) -> str:
    """Which rotary sizes `fn` computes exactly like rope_ref ("full", "any" or "" for none)."""
    found = ""
    for r in (16, 8):  # full rotary, then partial (the last 8 features pass through)
        q = _probe((2, 3, 4, 16), device, dtype, seed=5)
        k = _probe((2, 3, 2, 16), device, dtype, seed=6)
        cos, sin = _probe((2, 3, r), device, dtype, seed=7), _probe((2, 3, r), device, dtype, seed=8)
        with torch.no_grad():
            try:
                got_q, got_k = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            except Exception:  # noqa: BLE001 - e.g. a function without partial rotary
                break
            want_q, want_k = rope_ref(q, k, cos, sin)
            if not (torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k)):
                break
        found = "full" if r == 16 else "any"
    return found


# The patched forwards accept every name of hf_cache.CACHE_ARGS (5.24 `cache`, before `past_key_values`,
# still accepted by 5.24 through a deprecation shim).
_ATTN_PARAMS = {"hidden_states", "position_embeddings", "attention_mask"}
_LAYER_PARAMS = {"hidden_states", "attention_mask", "position_ids", "use_cache", "position_embeddings"}


def named_params(fn) -> tuple[list[str], bool] | str:
    """(named parameters after self, takes **kwargs) of a stock forward, read through its decorators."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError) as e:
        return f"its forward's signature cannot be read ({e})"
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def _signature_reason(cls, known: set[str]) -> tuple[str, str | None]:
    """(cache parameter name, None) when the patched forward understands every parameter of the stock
    `cls.forward`; else ("", why). A parameter it does not know would be dropped, so the module stays stock."""
    got = named_params(cls.forward)
    if isinstance(got, str):
        return "", got
    named, var_kw = got
    caches = [n for n in named if n in CACHE_ARGS]
    unknown = [n for n in named if n not in known and n not in CACHE_ARGS]
    if unknown:
        return "", f"{cls.__name__}.forward takes {', '.join(unknown)}, which the patched forward does not handle"
    if len(caches) != 1:
        return "", f"{cls.__name__}.forward names its KV cache {caches or 'nowhere'} (expected one of {CACHE_ARGS})"
    if not var_kw:
        return "", f"{cls.__name__}.forward takes no **kwargs (the attention interface needs them)"
    return caches[0], None


def attention_call(cls) -> tuple[str, str | None]:
    """(cache parameter name, None) if the patched attention forward can stand in for `cls.forward`."""
    return _signature_reason(cls, _ATTN_PARAMS)


def layer_call(cls) -> str | None:
    """None if the patched decoder-layer forward can stand in for `cls.forward`, else why not."""
    return _signature_reason(cls, _LAYER_PARAMS)[1]


def _eager_default(*args, **kwargs):
    from .attention import eager_attention

    return eager_attention(*args, **kwargs)


_interface: list = []  # transformers' ALL_ATTENTION_FUNCTIONS, imported on first use


def attention_function(config, default=_eager_default):
    """The attention function `config._attn_implementation` names in transformers' registry (`default`
    for "eager"), as the stock attention forwards look it up."""
    if not _interface:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _interface.append(ALL_ATTENTION_FUNCTIONS)
    return _interface[0].get_interface(config._attn_implementation, default)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    s = self._gemmtune_attn
    cache = pop_cache(kwargs, s.cache_arg)
    input_shape = hidden_states.shape[:-1]
    qkv = self.qkv_proj(hidden_states)  # one GEMM; gemmtune capture sees N = q + k + v
    q, k, v = qkv.split(s.sizes, dim=-1)
    q = q.view(*input_shape, -1, s.head_dim)
    k = k.view(*input_shape, -1, s.head_dim)
    v = v.view(*input_shape, -1, s.head_dim)
    cos, sin = position_embeddings
    fused_rope = s.rope_fused == "any" or (s.rope_fused == "full" and cos.shape[-1] == s.head_dim)
    if fused_rope and s.qk_norms is not None:  # q_norm, k_norm and the rope in one kernel
        nq, nk = s.qk_norms
        q, k = qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, nq.eps, nk.eps,
            offset=nq.offset, cast_before_weight=nq.cast_before_weight,
        )  # fmt: skip
    else:
        if s.qk_norm:  # per head, read in place from the fused output
            q = self.q_norm(q)
            k = self.k_norm(k)
        if fused_rope:
            q, k = rope(q, k, cos, sin)  # one kernel for q and k, straight from the [B, S, H, D] views
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if not fused_rope:
        q, k = self._gemmtune_rope(q, k, cos, sin)
    if cache is not None:
        # 5.24 hands the layer's kwargs to the cache (its layers may read them); earlier releases did not
        cache_extra = {"kwargs": kwargs} if s.cache_arg == "cache" else {}
        k, v = static_cache.update(cache, k, v, self.layer_idx, **cache_extra)
    fn = attention_function(self.config)
    extra = {"softcap": self.attn_logit_softcapping} if s.pass_softcap else {}
    out, weights = fn(
        self, q, k, v, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, sliding_window=s.sliding_window, **extra, **kwargs,
    )  # fmt: skip
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


# ---- decoder layers -----------------------------------------------------------------------------
def _prenorm_layer_forward(self, hidden_states, *args, **kwargs):
    if args or self.training:  # positional call or training (dropouts): the stock forward
        return type(self).forward(self, hidden_states, *args, **kwargs)
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(hidden_states=h, **kwargs)
    h, residual = self.post_attention_layernorm._gemmtune_add_norm(h, residual)
    h = self.mlp(h)
    return residual + h


def _sandwich_layer_forward(self, hidden_states, *args, **kwargs):
    if args or self.training:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(hidden_states=h, **kwargs)
    h = self.post_attention_layernorm(h)
    h, residual = self.pre_feedforward_layernorm._gemmtune_add_norm(h, residual)
    h = self.mlp(h)
    h = self.post_feedforward_layernorm(h)
    return residual + h


def _scaled_layer_forward(self, hidden_states, *args, **kwargs):
    """Prenorm with each branch scaled by residual_multiplier before its add (GraniteMoE)."""
    if args or self.training:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    m = self.residual_multiplier
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(hidden_states=h, **kwargs)
    h, residual = self.post_attention_layernorm._gemmtune_add_norm(h * m, residual)
    h = self.block_sparse_moe(h)
    return residual + h * m


LAYER_FORWARDS = {
    "prenorm": _prenorm_layer_forward,
    "sandwich": _sandwich_layer_forward,
    "scaled": _scaled_layer_forward,
}
