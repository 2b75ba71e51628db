"""The rewrites of a decoder layer's dense parts: q/k/v and gate/up fusion, the attention and MLP forwards
that run the fused GEMMs, the RMSNorms and the residual add + norm of the layer forward. The replacement
forwards themselves are in models/architectures.py."""

from __future__ import annotations

import dataclasses

from torch import nn

from . import architectures, fusion
from .bind import bind
from .linear import route_options
from .moe_block import SHARED_EXPERTS, SharedExpertFold
from .rewrite import Change, ForwardSwap, PlanContext, join
from .sharding import ShardedChange

_ATTN_ATTRS = ("o_proj", "layer_idx", "scaling", "config", "attention_dropout")
NORM_STYLE = "replicated_with_grad_allreduce"  # a norm's parallel style: identity forward, gradients reduced


def _at(change: Change, other: Change, rewrite: type) -> bool:
    """Whether `other` is a change of `rewrite` on the module `change` changes."""
    return isinstance(other.rewrite, rewrite) and other.path == change.path


def uses_qk_norm(arch: architectures.Architecture, attn: nn.Module) -> bool:
    """Whether this attention normalizes q and k per head (GLM-4-MoE: only with use_qk_norm)."""
    return arch.qk_norm and (arch.qk_norm_flag is None or bool(getattr(attn, arch.qk_norm_flag, False)))


def _qk_norms_fusable(attn: nn.Module, specs: dict, head_dim: int):
    """(q_norm spec, k_norm spec) when both norms can run inside the fused rope kernel, else None: both
    gemmtune RMSNorms of one weight convention over head_dim, with no hooks the fusion would skip."""
    nq, nk = specs.get("q_norm"), specs.get("k_norm")
    if not (isinstance(nq, architectures.NormSpec) and isinstance(nk, architectures.NormSpec)):
        return None
    if (nq.offset, nq.cast_before_weight) != (nk.offset, nk.cast_before_weight):
        return None
    for mod in (attn.q_norm, attn.k_norm):
        if mod.weight.shape != (head_dim,) or mod._forward_hooks or mod._forward_pre_hooks:
            return None
    return nq, nk


def _qk_specs(ctx: PlanContext, path: str, attn: nn.Module) -> dict:
    """The q_norm / k_norm formulas of a per-head q/k-normed attention (probed once, shared by the
    attention forward that may fuse them and the norm swap)."""
    if not (ctx.opts["fused_ops"] and ctx.arch.qk_norm):
        return {}
    return {n: ctx.norm_spec(join(path, "self_attn", n), getattr(attn, n))
            for n in ("q_norm", "k_norm") if isinstance(getattr(attn, n, None), nn.Module)}  # fmt: skip


# ---- attention ----------------------------------------------------------------------------------
def _qkv_sizes(arch, attn: nn.Module) -> tuple[int, ...]:
    return tuple(getattr(attn, n).out_features for n in arch.qkv)


def _qkv_reason(arch, attn: nn.Module) -> str | None:
    """Why q/k/v of `attn` cannot be fused and run by the fused attention forward (None: they can)."""
    why = fusion.fuse_skip_reason(attn, arch.qkv, "qkv_proj") or architectures.attention_call(type(attn))[1]
    if why is not None:
        return why
    missing = [a for a in _ATTN_ATTRS if not hasattr(attn, a)]
    sizes, head_dim = _qkv_sizes(arch, attn), getattr(attn, "head_dim", None)
    if missing:
        return f"missing attribute(s) {', '.join(missing)}"
    if not isinstance(head_dim, int) or any(s % head_dim for s in sizes) or sizes[1] != sizes[2]:
        return f"q/k/v widths {sizes} do not fit head_dim {head_dim}"
    if (sizes[0] // head_dim) % (sizes[1] // head_dim):
        return f"{sizes[0] // head_dim} query heads are not a multiple of {sizes[1] // head_dim} KV heads"
    if architectures.rope_function(attn) is None:
        return f"{type(attn).__module__} has no apply_rotary_pos_emb"
    qk_norms = (getattr(attn, n, None) for n in ("q_norm", "k_norm"))
    if uses_qk_norm(arch, attn) and not all(isinstance(m, nn.Module) for m in qk_norms):
        return "q_norm / k_norm missing"
    if "forward" in attn.__dict__:
        return "its forward is already overridden on the instance"
    return None


class QkvFusion(fusion.Fusion):
    what, remedy = "fusing q/k/v", "fuse_qkv=False"

    def applies(self, arch, opts) -> bool:
        mla = arch is not None and arch.mla and opts.get("mla_absorb")  # MLA's own forward (models/mla.py)
        return arch is not None and arch.qkv is not None and opts["fuse_qkv"] and not mla

    def plan(self, ctx: PlanContext) -> None:
        arch = ctx.arch
        for lpath, layer in ctx.layers:
            path, attn = join(lpath, "self_attn"), layer.self_attn
            why = _qkv_reason(arch, attn)
            if why is not None:
                ctx.skip("fuse qkv", path, attn, why)
                continue
            sizes, head_dim = _qkv_sizes(arch, attn), attn.head_dim
            n_q, n_kv = sizes[0] // head_dim, sizes[1] // head_dim
            ctx.add(self, path, attn, f"q/k/v -> qkv_proj N={sum(sizes)} ({n_q} q heads, {n_kv} kv heads)",
                    names=arch.qkv, fused="qkv_proj", route=route_options(ctx.opts))  # fmt: skip
            for name in arch.qkv:
                ctx.leave_linear(join(path, name))

    def needs(self, change: Change, other: Change) -> bool:
        return _at(change, other, AttentionForward)  # the stock forward reads the parts


class AttentionForward(ForwardSwap):
    """The attention forward on the fused q/k/v GEMM, with the fused rope (and q/k norms) kernel where
    probes show it computes the model's own."""

    kind = "attn"
    attrs = ("forward", "_gemmtune_attn", "_gemmtune_rope")

    def applies(self, arch, opts) -> bool:
        return QkvFusion.applies(self, arch, opts)  # it runs the fused q/k/v

    def plan(self, ctx: PlanContext) -> None:
        arch = ctx.arch
        for lpath, layer in ctx.layers:
            path, attn = join(lpath, "self_attn"), layer.self_attn
            if ctx.planned(QkvFusion, path) is None:
                continue
            rope = architectures.rope_function(attn)
            ref = attn.qkv_proj.weight if hasattr(attn, "qkv_proj") else attn.q_proj.weight
            spec = architectures.AttnSpec(
                sizes=_qkv_sizes(arch, attn),
                head_dim=attn.head_dim,
                qk_norm=uses_qk_norm(arch, attn),
                pass_softcap=arch.softcap_kwarg,
                # 0 (Qwen2-MoE without sliding layers) means no window, as None does
                sliding_window=getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None)) or None,
                rope_fused=ctx.rope_kind(rope, ref),
                cache_arg=architectures.attention_call(type(attn))[0],
            )
            kind = {"": "the model's rope", "full": "fused rope kernel", "any": "fused rope kernel"}[spec.rope_fused]
            qk_norms = _qk_norms_fusable(attn, _qk_specs(ctx, lpath, attn), spec.head_dim) if spec.rope_fused else None
            if qk_norms is not None:
                spec = dataclasses.replace(spec, qk_norms=qk_norms)
                kind = "q_norm/k_norm + rope in one kernel"
            ctx.add(self, path, attn, f"forward with the fused qkv GEMM and {kind}", spec=spec, rope=rope)

    def install(self, mod: nn.Module, change: Change) -> None:
        mod._gemmtune_attn = change.data["spec"]
        mod._gemmtune_rope = change.data["rope"]
        mod.forward = bind(architectures._attention_forward, mod)

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)

    def needs(self, change: Change, other: Change) -> bool:
        return _at(change, other, QkvFusion)


# ---- MLP ----------------------------------------------------------------------------------------
def mlp_sites(ctx: PlanContext) -> list[tuple[str, nn.Module]]:
    """(path, module) of the dense MLPs of the decoder layers: each layer's MLP, or the shared experts of
    an MoE block whose shared expert is not folded into its experts' call."""
    sites = []
    for lpath, layer in ctx.layers:
        path, mlp = join(lpath, ctx.arch.mlp), getattr(layer, ctx.arch.mlp)
        if not architectures.is_moe_block(mlp):
            sites.append((path, mlp))
        elif ctx.planned(SharedExpertFold, path) is None:  # a dense MLP every token runs: fused as the others
            sites += [(join(path, s), getattr(mlp, s)) for s in SHARED_EXPERTS
                      if isinstance(getattr(mlp, s, None), nn.Module)]  # fmt: skip
    return sites


def _act_attr(mlp: nn.Module) -> str:
    return "act_fn" if hasattr(mlp, "act_fn") else "activation_fn"


def _mlp_layout_reason(mlp: nn.Module) -> str | None:
    act_fn = getattr(mlp, _act_attr(mlp), None)
    if "forward" in mlp.__dict__ or act_fn is None or not isinstance(getattr(mlp, "down_proj", None), nn.Linear):
        return "layout not recognized (down_proj / act_fn / forward)"
    return None


class GateUpFusion(fusion.Fusion):
    what, remedy = "fusing gate/up", "fuse_gate_up=False"

    def applies(self, arch, opts) -> bool:
        return arch is not None and arch.gate_up is not None and opts["fuse_gate_up"]

    def plan(self, ctx: PlanContext) -> None:
        names = ctx.arch.gate_up
        for path, mlp in mlp_sites(ctx):
            if _mlp_layout_reason(mlp) is not None:
                continue  # MlpForward reports it
            why = fusion.fuse_skip_reason(mlp, names, "gate_up_proj")
            if why is None and getattr(mlp, names[1]).out_features != getattr(mlp, names[0]).out_features:
                why = "gate and up widths differ"
            if why is not None:
                ctx.skip("fuse gate_up", path, mlp, why)
                continue
            size = getattr(mlp, names[0]).out_features
            ctx.add(self, path, mlp, f"gate/up -> gate_up_proj N={2 * size}", names=names, fused="gate_up_proj",
                    route=route_options(ctx.opts))  # fmt: skip
            for name in names:
                ctx.leave_linear(join(path, name))

    def needs(self, change: Change, other: Change) -> bool:
        return _at(change, other, MlpForward)  # the stock forward reads the parts


class MlpForward(ForwardSwap):
    """The MLP forward on the fused gate/up GEMM (or the model's own, Phi3), with act*mul in one kernel."""

    kind = "mlp"
    attrs = ("forward", "_gemmtune_mlp")

    def applies(self, arch, opts) -> bool:
        return arch is not None

    def plan(self, ctx: PlanContext) -> None:
        arch, fused_ops = ctx.arch, ctx.opts["fused_ops"]
        for path, mlp in mlp_sites(ctx):
            why = _mlp_layout_reason(mlp)
            if why is not None:
                ctx.skip("mlp", path, mlp, why)
                continue
            if arch.gate_up is not None:
                if ctx.planned(GateUpFusion, path) is None:
                    continue
                ref = getattr(mlp, arch.gate_up[0]).weight
            else:  # already fused (Phi3): only the activation changes
                gu = getattr(mlp, "gate_up_proj", None)
                if not isinstance(gu, nn.Linear) or gu.out_features % 2 or not fused_ops:
                    continue
                ref = gu.weight
            act_attr = _act_attr(mlp)
            act_fn = getattr(mlp, act_attr)
            act = architectures.detect_act(act_fn, ref.device, ref.dtype) if fused_ops else None
            if fused_ops and act is None:
                ctx.skip("act", path, mlp, f"{type(act_fn).__name__} is not SiLU or GELU-tanh: applied in torch")
            elif arch.gate_up is None and act is None:
                continue
            label = f"{act}*mul kernel" if act else "torch act*mul"
            ctx.add(self, path, mlp, f"forward gate_up -> {label} -> down_proj",
                    spec=architectures.MlpSpec(act, act_attr))  # fmt: skip

    def install(self, mod: nn.Module, change: Change) -> None:
        mod._gemmtune_mlp = change.data["spec"]
        mod.forward = bind(architectures._mlp_forward, mod)

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)

    def needs(self, change: Change, other: Change) -> bool:
        return _at(change, other, GateUpFusion)


# ---- norms and the layer forward ----------------------------------------------------------------
def _layer_norms(ctx: PlanContext, lpath: str, layer: nn.Module):
    """(path, module) of the layer's own norms, in order, up to the first one missing."""
    for n in architectures.LAYER_NORMS[ctx.arch.layer]:
        mod = getattr(layer, n, None)
        if not isinstance(mod, nn.Module):
            return
        yield join(lpath, n), mod


class Norms(ForwardSwap):
    """Each RMSNorm whose formula a probe confirms runs the gemmtune kernel, and offers the fused layer
    forward its residual add + norm (architectures.ADD_NORM)."""

    kind = "norm"
    attrs = ("forward", "_gemmtune_norm", architectures.ADD_NORM)

    def applies(self, arch, opts) -> bool:
        return arch is not None and opts["fused_ops"]

    def plan(self, ctx: PlanContext) -> None:
        for lpath, layer in ctx.layers:
            attn, apath = layer.self_attn, join(lpath, "self_attn")
            norms = [(join(apath, n), getattr(attn, n)) for n in _qk_specs(ctx, lpath, attn)]
            # norms inside an attention forward that stays stock (DeepSeek's q_a_layernorm is None without q_lora)
            norms += [(join(apath, n), getattr(attn, n)) for n in ctx.arch.attn_norms
                      if isinstance(getattr(attn, n, None), nn.Module)]  # fmt: skip
            for path, mod in norms + list(_layer_norms(ctx, lpath, layer)):
                self._plan_one(ctx, path, mod)
        spath, smod = ctx.stack or ("", None)
        final = getattr(smod, "norm", None)
        if isinstance(final, nn.Module):
            self._plan_one(ctx, join(spath, "norm"), final)

    def _plan_one(self, ctx: PlanContext, path: str, mod: nn.Module) -> None:
        spec = ctx.norm_spec(path, mod)
        if isinstance(spec, str):
            ctx.skip("norm", path, mod, spec)
        else:
            ctx.add(self, path, mod, f"gemmtune RMSNorm ({spec.style}, eps={spec.eps:g})", spec=spec)

    def install(self, mod: nn.Module, change: Change) -> None:
        mod._gemmtune_norm = change.data["spec"]
        mod.forward = bind(architectures._norm_forward, mod)
        mod.__dict__[architectures.ADD_NORM] = bind(architectures._add_norm_forward, mod)

    def on_sharded(self, model, sharding, change: Change):
        if change.path not in sharding.hooked:
            return None, None
        style = sharding.style(change.path)
        if style != NORM_STYLE:
            return f"tensor parallel: plan entry {style!r} on a norm", None
        wrapped = "forward" in model.get_submodule(change.path).__dict__
        return None, ShardedChange(sharding, rewrap=style if wrapped else None)


class LayerForward(ForwardSwap):
    """The decoder-layer forward with the residual add fused into the norm after attention."""

    kind = "layer"

    def applies(self, arch, opts) -> bool:
        return arch is not None and opts["fused_ops"]

    def plan(self, ctx: PlanContext) -> None:
        arch = ctx.arch
        add_norm = "pre_feedforward_layernorm" if arch.layer == "sandwich" else "post_attention_layernorm"
        for path, layer in ctx.layers:
            names = architectures.LAYER_NORMS[arch.layer]
            present = dict(_layer_norms(ctx, path, layer))
            if len(present) < len(names):
                ctx.skip("layer", path, layer, f"no {names[len(present)]}")
                continue
            call_why = architectures.layer_call(type(layer))
            norm = getattr(layer, add_norm)
            if "forward" in layer.__dict__:
                ctx.skip("layer", path, layer, "its forward is already overridden on the instance")
            elif call_why is not None:
                ctx.skip("layer", path, layer, call_why)
            elif arch.layer == "scaled" and type(getattr(layer, "residual_multiplier", None)) not in (int, float):
                ctx.skip("layer", path, layer, "no int / float residual_multiplier")
            elif isinstance(ctx.norm_spec(join(path, add_norm), norm), str) or norm._forward_hooks:
                ctx.skip("layer", path, layer, f"{add_norm} not fusable with the residual add")
            else:
                ctx.add(self, path, layer, f"residual add + {add_norm} fused ({arch.layer})", layout=arch.layer)

    def install(self, mod: nn.Module, change: Change) -> None:
        mod.forward = bind(architectures.LAYER_FORWARDS[change.data["layout"]], mod)

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)

    def needs(self, change: Change, other: Change) -> bool:
        return isinstance(other.rewrite, Norms) and other.path.startswith(change.path + ".")  # its own norms
