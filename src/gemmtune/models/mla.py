"""Multi-head latent attention (DeepSeek-V3) in decode, with kv_b_proj absorbed into the query and output.

Transformers' MLA caches the compressed latents (kv_a_layernorm(kv) [B, 1, S, R] and the roped shared key
[B, 1, S, dr]) and on every forward expands the whole cache through kv_b_proj into per-head keys and
values ([B, H, S, dn + dv]), then runs attention over them. In decode that expansion is nearly all of
the attention's cost: on an H100, a 4-layer DeepSeek-V3 at batch 8 and 1024 tokens of context spends
~5.4 ms of its 13.6 ms step on it (the kv_b_proj GEMM over the cache, the copy building the keys,
attention over 128 full heads).

The absorbed form computes the same attention on the latents, as the serving engines do:
  q_lat = q_nope @ W_UK           (per head: [dn] -> [R], W_UK the key rows of kv_b_proj)
  scores = (q_lat . kv_latent + q_rot . k_rot) * scaling, masked, softmax (fp32)
  o_lat = probs @ kv_latent       ([R] per head)
  out   = o_lat @ W_UV^T          (per head: [R] -> [dv], W_UV the value rows of kv_b_proj)
It reads the latent cache once (B * S * (R + dr) elements) instead of writing and reading the expanded
one (B * H * S * (dn + 2 dv)). It runs for forwards of at most ABSORB_MAX_Q new tokens (decode,
speculation). Prefill keeps stock's math, where the expansion is a well-shaped GEMM, with the rotary in
one launch (kernels/rope.py, probed bit-equal to the modeling module's) and the roped features written
back into the query projection's output instead of a new concatenated query; where gradients may flow,
the stock forward runs.
`absorbed_attention_ref` is plain PyTorch (fp32), tested against the stock expansion; `absorbed_attention` runs
the latent decode kernel (kernels/mla_decode.py) where it can, the reference elsewhere.

On by default (optimize(mla_absorb=False) keeps the stock forward). Measured on an H100, 4-layer
DeepSeek-V3 (1 dense + 3 MoE layers, random weights, bf16, CUDA-graph decode at 1024 cached tokens): b=1
2.70 ms and b=8 7.12 ms vs stock's 4.16 / 13.91 (1.54x / 1.95x; MLA stock 1.19x / 1.10x), prefill 2048 1.32x
(1.26x; benchmarks/results/h100/fused_moe_op/bench_model_moe_families.md). It is no less exact than stock (one
layer against an fp64 evaluation of the same bf16 weights, its fp32 form: 0.49-0.53% vs stock's 0.51-0.55%;
benchmarks/experiments/exp_mla_precision.py), but it rounds elsewhere, and the ~1% that leaves between the
two models' hidden states flips near-tied expert choices of a random-weight router on some decode steps.
Both parity checks judge that apart from the arithmetic: optimize()'s cached-path check feeds each MoE
block stock's input (models/verify.py), and bench-model decodes again with stock's expert choices forced
(profiling/moe_routing.ForcedRouting), where every step is within 0.013 of stock.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .. import device as _device
from .. import settings
from ..kernels import mla_decode as kmla
from ..kernels import rope as krope
from ..kernels._common import ArrivalCounters
from . import static_cache
from .architectures import attention_call, attention_function
from .bind import bind
from .hf_cache import pop_cache
from .rewrite import Change, ForwardSwap, PlanContext, join

ABSORB_MAX_Q = 16  # new tokens a forward may have for the absorbed path
# Where the absorbed attention runs: "triton", the latent decode kernel (kernels/mla_decode.py) between the
# two per-head projections as cuBLAS batched GEMMs, on NVIDIA CUDA in fp16 / bf16 eager code; "torch", the
# fp32 PyTorch form (absorbed_attention_ref), which also serves everywhere the kernel does not.
# GEMMTUNE_MLA_DECODE=triton|torch picks.
MLA_DECODE_MODES = settings.MLA_DECODE.parse.modes  # torch, triton
MLA_DECODE = settings.MLA_DECODE.get()
_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per attention module: one call at a time
UNDO_ATTRS = ("forward", "_gemmtune_mla")
_ATTRS = ("kv_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj", "expand_kv", "scaling", "layer_idx")
_DIMS = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    heads: int
    nope: int
    rope: int
    v: int
    rank: int
    cache_arg: str
    rotary: Callable
    rotary_interleave: Callable | None
    rope_kernel: bool = False  # kernels/rope.rope computes the model's rotary bit for bit (probed at plan time)
    eager: Callable | None = None  # the modeling module's eager_attention_forward (the interface's default)

    def describe(self) -> str:
        return (
            f"decode (<= {ABSORB_MAX_Q} new tokens) on the latent cache with kv_b_proj absorbed "
            f"({self.heads} heads, latent {self.rank} + rope {self.rope})"
        )


def plan(attn: nn.Module) -> MlaSpec | str:
    """The spec for swapping `attn`'s forward, or why it stays stock."""
    missing = [a for a in _ATTRS + _DIMS if not hasattr(attn, a)]
    if missing:
        return f"not a transformers MLA attention (no {', '.join(missing)})"
    if "forward" in attn.__dict__:
        return "its forward is already overridden on the instance"
    cache_arg, why = attention_call(type(attn))
    if why is not None:
        return why
    h, dn, dr, dv, r = (getattr(attn, a) for a in _DIMS)
    kvb = attn.kv_b_proj
    if type(kvb) is not nn.Linear or kvb.bias is not None or tuple(kvb.weight.shape) != (h * (dn + dv), r):
        return f"kv_b_proj is not a bias-free Linear of shape ({h * (dn + dv)}, {r})"
    module = sys.modules.get(type(attn).__module__)
    rotary = getattr(module, "apply_rotary_pos_emb", None)
    if rotary is None:
        return f"{type(attn).__module__} has no apply_rotary_pos_emb"
    interleave = getattr(module, "apply_rotary_pos_emb_interleave", None)
    if getattr(attn.config, "rope_interleave", False) and interleave is None:
        return "rope_interleave is set but the modeling module has no apply_rotary_pos_emb_interleave"
    interleaved = bool(getattr(attn.config, "rope_interleave", False))
    rope_kernel = _rope_matches(interleave if interleaved else rotary, interleaved)
    eager = getattr(module, "eager_attention_forward", None)
    return MlaSpec(h, dn, dr, dv, r, cache_arg, rotary, interleave, rope_kernel, eager)


def _rope_matches(fn: Callable, interleaved: bool) -> bool:
    """Does kernels/rope.rope (its reference, on this probe) give what the modeling module's `fn` gives, bit
    for bit, on MLA's layouts ([B, H, L, dr] queries, one shared key head) and a rotary embedding's cos /
    sin (cat(angles, angles))? A transformers release that changes its rotary leaves MLA on `fn`."""
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 1, 4, 16, generator=g)
    cos, sin = (torch.randn(2, 4, 8, generator=g).repeat(1, 1, 2) for _ in range(2))
    try:
        with torch.no_grad():
            want_q, want_k = fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - a rotary with another signature: keep it
        return False
    got_q, got_k = krope.rope_ref(q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved)
    return torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k)


def apply(attn: nn.Module, spec: MlaSpec) -> None:
    attn._gemmtune_mla = spec
    attn.forward = bind(_mla_forward, attn)


class MlaAbsorb(ForwardSwap):
    """The MLA attention's forward: decode on the latent cache with kv_b_proj absorbed."""

    kind = "mla"
    attrs = UNDO_ATTRS

    def applies(self, arch, opts) -> bool:
        return arch is not None and arch.mla and opts.get("mla_absorb")

    def plan(self, ctx: PlanContext) -> None:
        for lpath, layer in ctx.layers:
            path, attn = join(lpath, "self_attn"), layer.self_attn
            spec = plan(attn)
            if isinstance(spec, str):
                ctx.skip("mla", path, attn, spec)
            else:
                ctx.add(self, path, attn, spec.describe(), spec=spec)

    def install(self, mod: nn.Module, change: Change) -> None:
        apply(mod, change.data["spec"])


def absorbed_attention_ref(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rot: torch.Tensor,
    w_kv_b: torch.Tensor,
    v_dim: int,
    scaling: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v with k, v the kv_b_proj expansion of the latents, computed on the
    latents. q_nope [B, H, L, dn], q_rot [B, H, L, dr], kv_latent [B, 1, S, R], k_rot [B, 1, S, dr],
    w_kv_b [H * (dn + dv), R], mask None or [B|1, 1, L, >=S] (bool: True attends; else added).
    Returns [B, L, H, dv] in q_nope's dtype."""
    B, H, L, dn = q_nope.shape
    S, R = kv_latent.shape[2], kv_latent.shape[3]
    # fp32 from here to the output, which alone rounds to the model dtype (as stock's attention output).
    # Rounding q_lat and o_lat to bf16 as well left a 4-layer DeepSeek-V3's hidden states as far from
    # stock's (0.8-1.2% on an H100 vs 0.9-1.1% in fp32): the distance is the two orders of summation.
    w = w_kv_b.float().view(H, dn + v_dim, R)
    # per head, batched over heads: [H, B*L, dn] @ [H, dn, R]
    q_lat = torch.bmm(q_nope.float().permute(1, 0, 2, 3).reshape(H, B * L, dn), w[:, :dn])
    q_rot = q_rot.float()
    q = torch.cat([q_lat.view(H, B, L, R).permute(1, 0, 2, 3), q_rot], dim=-1).reshape(B, H * L, R + q_rot.shape[-1])
    latent = kv_latent[:, 0].float()
    k = torch.cat([latent, k_rot[:, 0].float()], dim=-1)  # [B, S, R + dr]: one key head for every query head
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scaling)  # [B, H*L, S]
    if mask is not None:
        m = mask[:, 0, :, :S]
        m = m.unsqueeze(1).expand(m.shape[0], H, L, S).reshape(m.shape[0], H * L, S)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    probs = scores.softmax(dim=-1)
    if mask is not None:  # a query that may see no key (a padding row) gets zeros, not NaN
        probs = probs.nan_to_num_(0.0)
    o_lat = torch.bmm(probs, latent)  # [B, H*L, R]
    o_lat = o_lat.view(B, H, L, R).permute(1, 0, 2, 3).reshape(H, B * L, R)
    out = torch.bmm(o_lat, w[:, dn:].transpose(1, 2))  # [H, B*L, dv]
    return out.view(H, B, L, v_dim).permute(1, 2, 0, 3).to(q_nope.dtype)


def _kernel_takes(q_nope, q_rot, kv_latent, k_rot, mask) -> bool:
    if MLA_DECODE != "triton" or torch.compiler.is_compiling() or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return False
    if _device.vendor(q_nope.device) != _device.NVIDIA or not _device.triton_installed():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_nope, q_rot, kv_latent, k_rot)):
        return False
    q_lat_shape = (*q_nope.shape[:3], kv_latent.shape[-1])  # what the key-rows GEMM will make
    return kmla.takes_shape(q_lat_shape, q_nope.dtype, q_rot, kv_latent[:, 0], k_rot[:, 0], mask) == ""


def _absorbed_kernel(owner, q_nope, q_rot, kv_latent, k_rot, w_kv_b, v_dim: int, scaling: float, mask):
    """absorbed_attention_ref with the key rows applied by a batched GEMM per head, the attention on the
    latents in one kernel launch and the value rows by a second batched GEMM; q_lat and the latent output
    round to the model dtype between them (the scores, softmax and sums run in fp32 in the kernel)."""
    B, H, L, dn = q_nope.shape
    R = kv_latent.shape[-1]
    w = w_kv_b.view(H, dn + v_dim, R)
    q_lat = torch.bmm(q_nope.permute(1, 0, 2, 3).reshape(H, B * L, dn), w[:, :dn])  # [H, B*L, R]
    q_lat = q_lat.view(H, B, L, R).permute(1, 0, 2, 3)
    counters = _counters.get(owner)
    if counters is None:
        counters = _counters[owner] = ArrivalCounters()
    arrivals = counters.get(kmla.counters_needed(B, H, L), q_nope.device)
    o_lat = q_nope.new_empty(H, B, L, R)  # the layout the value GEMM reads per head
    kmla.mla_decode(q_lat, q_rot, kv_latent[:, 0], k_rot[:, 0], mask, scaling, arrivals, check=False,
                    out=o_lat.permute(1, 2, 0, 3))  # fmt: skip
    out = torch.bmm(o_lat.view(H, B * L, R), w[:, dn:].transpose(1, 2))  # [H, B*L, dv]
    return out.view(H, B, L, v_dim).permute(1, 2, 0, 3)


def absorbed_attention(owner, q_nope, q_rot, kv_latent, k_rot, w_kv_b, v_dim: int, scaling: float, mask):
    """absorbed_attention_ref's result [B, L, H, dv]: through the latent decode kernel where it runs
    (MLA_DECODE), else the fp32 reference. `owner`: the attention module (its kernel's arrival counters)."""
    if _kernel_takes(q_nope, q_rot, kv_latent, k_rot, mask):
        return _absorbed_kernel(owner, q_nope, q_rot, kv_latent, k_rot, w_kv_b, v_dim, scaling, mask)
    return absorbed_attention_ref(q_nope, q_rot, kv_latent, k_rot, w_kv_b, v_dim, scaling, mask)


def _stock(self, s: MlaSpec, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    return type(self).forward(
        self, hidden_states, position_embeddings, attention_mask, **{s.cache_arg: cache}, **kwargs
    )


def _grad_needed(self) -> bool:
    return torch.is_grad_enabled() and self.kv_b_proj.weight.requires_grad


def _mla_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    s: MlaSpec = self._gemmtune_mla
    cache = pop_cache(kwargs, s.cache_arg)
    B, L = hidden_states.shape[:-1]
    absorb = L <= ABSORB_MAX_Q and not (L > 1 and attention_mask is None)  # no mask: the causal pattern implied
    prefill_ok = s.rope_kernel and s.eager is not None and not _grad_needed(self)
    if (
        self.training
        or not (absorb or prefill_ok)
        or not (attention_mask is None or isinstance(attention_mask, torch.Tensor))
        or type(self.kv_b_proj) is not nn.Linear  # quantized, or replaced since the plan
    ):
        return _stock(self, s, hidden_states, position_embeddings, attention_mask, cache, kwargs)
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, L, s.heads, s.nope + s.rope)
    kv_latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [s.rank, s.rope], dim=-1)
    kv_latent = self.kv_a_layernorm(kv_latent).view(B, 1, L, s.rank)
    k_rot = _rotate(self, s, q[..., s.nope :], k_rot.view(B, L, 1, s.rope), position_embeddings)
    k_rot = k_rot.transpose(1, 2)  # [B, 1, L, dr], as stock caches it
    if cache is not None:
        # 5.24 hands the layer's kwargs to the cache (its layers may read them); earlier releases did not
        extra = {"kwargs": kwargs} if s.cache_arg == "cache" else {}
        kv_latent, k_rot = static_cache.update(cache, kv_latent, k_rot, self.layer_idx, **extra)
    if absorb:
        q = q.transpose(1, 2)
        out = absorbed_attention(self, q[..., : s.nope], q[..., s.nope :], kv_latent, k_rot, self.kv_b_proj.weight,
                                 s.v, self.scaling, attention_mask)  # fmt: skip
        return self.o_proj(out.reshape(B, L, s.heads * s.v)), None
    # prefill: stock's math with the roped features written back into the query projection's output (stock
    # concatenates a new query) and the keys built in the expansion's [B, S, H, .] order (stock's copies
    # transpose); the same values
    key_states, value_states = _expand(self, s, kv_latent, k_rot)
    fn = attention_function(self.config, s.eager)
    out, weights = fn(self, q.transpose(1, 2), key_states, value_states, attention_mask, dropout=0.0,
                      scaling=self.scaling, **kwargs)  # fmt: skip
    return self.o_proj(out.reshape(B, L, -1).contiguous()), weights


def _expand(self, s: MlaSpec, kv_latent, k_rot):
    """transformers' expand_kv (kv_b_proj over every cached latent; keys [k_nope | k_rot], values) as views
    [B, H, S, .] of [B, S, H, .] tensors."""
    B, S = kv_latent.shape[0], kv_latent.shape[2]
    kv = self.kv_b_proj(kv_latent).view(B, S, s.heads, s.nope + s.v)
    key = kv.new_empty(B, S, s.heads, s.nope + s.rope)
    key[..., : s.nope].copy_(kv[..., : s.nope])
    key[..., s.nope :].copy_(k_rot[:, 0, :, None, :].expand(B, S, s.heads, s.rope))
    return key.transpose(1, 2), kv[..., s.nope :].transpose(1, 2)


def _rotate(self, s: MlaSpec, q_rot, k_rot, position_embeddings):
    """The rotary on [B, L, H, dr] / [B, L, 1, dr] views: q_rot is rotated in place (a view into the query
    projection's output), the rotated k_rot returned. kernels/rope in one launch where it matched the
    modeling module's function (plan), else that function."""
    cos, sin = position_embeddings
    interleaved = bool(getattr(self.config, "rope_interleave", False))
    if s.rope_kernel:
        return krope.rope(q_rot, k_rot, cos, sin, interleaved=interleaved, out_q=q_rot)[1]
    rotary = s.rotary_interleave if interleaved else s.rotary
    q_new, k_new = rotary(q_rot.transpose(1, 2), k_rot.transpose(1, 2), cos, sin)
    q_rot.copy_(q_new.transpose(1, 2))
    return k_new.transpose(1, 2)
