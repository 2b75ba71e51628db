"""optimize(model) / restore(model): plan every change first, then apply; undo in reverse.

The plan is a list of Actions that name modules by path (so a deep-copied optimized model restores
itself, not the original). Validation happens while planning, before the model is touched; if
applying still fails halfway, the applied part is undone and the error re-raised, so a model is
never left half patched.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..checks import check_bool, check_choice, check_int
from ..device import triton_installed
from . import architectures, epilogue_mlp, fusion, mask_positions, mla, moe_shared
from . import attention as attn_mod
from . import moe as moe_mod
from . import tensor_parallel as tp_mod
from . import verify as verify_mod
from .bind import bind, bound_function
from .linear import RouteOptions, is_routed, linear_skip_reason, route_linear, unroute_linear
from .report import OptimizeReport
from .version import check_transformers

_REPORT = "_gemmtune_report"
ATTENTION_CHOICES = ("auto", "off", *attn_mod.TIERS)  # optimize(attention=...), None too
SHARED_EXPERTS = ("shared_expert", "shared_experts")  # an MoE block's always-on MLP: Qwen2-MoE's; DeepSeek's, GLM's


@dataclass
class Action:
    kind: str
    path: str
    data: dict = field(default_factory=dict)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


# ---- planning -----------------------------------------------------------------------------------
class _Planner:
    def __init__(self, model, arch, opts: dict, report: OptimizeReport):
        self.model, self.arch, self.opts, self.report = model, arch, opts, report
        self.actions: list[Action] = []
        self.no_route: set[str] = set()  # module paths whose nn.Linear must not be routed
        self.no_route_prefixes: list[str] = []  # subtrees left alone (MoE experts)
        self.rope_probes: dict = {}

    def add(self, kind: str, path: str, mod: nn.Module, detail: str, **data) -> None:
        self.actions.append(Action(kind, path, data))
        self.report.change(kind, path, type(mod).__name__, detail)

    def skip(self, kind: str, path: str, mod: nn.Module, why: str) -> None:
        self.report.skip(kind, path, type(mod).__name__, why)

    def norm(
        self, path: str, mod: nn.Module, spec: architectures.NormSpec | str | None = None
    ) -> architectures.NormSpec | None:
        spec = architectures.detect_norm(mod) if spec is None else spec
        if isinstance(spec, str):
            self.skip("norm", path, mod, spec)
            return None
        self.add("norm", path, mod, f"gemmtune RMSNorm ({spec.style}, eps={spec.eps:g})", spec=spec)
        return spec

    def rope_kind(self, fn, ref) -> str:
        if not self.opts["fused_ops"]:
            return ""
        key = (fn, ref.device, ref.dtype)
        if key not in self.rope_probes:  # one probe per rope function
            self.rope_probes[key] = architectures.detect_rope(fn, ref.device, ref.dtype)
        return self.rope_probes[key]

    def attention(self, path: str, attn: nn.Module, qk_specs: dict) -> None:
        arch = self.arch
        if arch.mla and self.opts.get("mla_absorb"):
            spec = mla.plan(attn)
            if isinstance(spec, str):
                self.skip("mla", path, attn, spec)
            else:
                self.add("mla", path, attn, spec.describe(), spec=spec)
            return
        if not (self.opts["fuse_qkv"] and arch.qkv):
            return
        why = fusion.fuse_skip_reason(attn, arch.qkv, "qkv_proj")
        qk_norm = _uses_qk_norm(arch, attn)
        head_dim = getattr(attn, "head_dim", None)
        rope = architectures.rope_function(attn)
        cache_arg, call_why = architectures.attention_call(type(attn))
        why = why or call_why
        if why is None:
            missing = [
                a for a in ("o_proj", "layer_idx", "scaling", "config", "attention_dropout") if not hasattr(attn, a)
            ]
            sizes = tuple(getattr(attn, n).out_features for n in arch.qkv)
            if missing:
                why = f"missing attribute(s) {', '.join(missing)}"
            elif not isinstance(head_dim, int) or any(s % head_dim for s in sizes) or sizes[1] != sizes[2]:
                why = f"q/k/v widths {sizes} do not fit head_dim {head_dim}"
            elif (sizes[0] // head_dim) % (sizes[1] // head_dim):
                why = f"{sizes[0] // head_dim} query heads are not a multiple of {sizes[1] // head_dim} KV heads"
            elif rope is None:
                why = f"{type(attn).__module__} has no apply_rotary_pos_emb"
            elif qk_norm and not all(isinstance(getattr(attn, n, None), nn.Module) for n in ("q_norm", "k_norm")):
                why = "q_norm / k_norm missing"
            elif "forward" in attn.__dict__:
                why = "its forward is already overridden on the instance"
        if why is not None:
            self.skip("fuse qkv", path, attn, why)
            return
        n_q, n_kv = sizes[0] // head_dim, sizes[1] // head_dim
        self.add("fuse", path, attn, f"q/k/v -> qkv_proj N={sum(sizes)} ({n_q} q heads, {n_kv} kv heads)",
                 names=arch.qkv, fused="qkv_proj")  # fmt: skip
        spec = architectures.AttnSpec(
            sizes=sizes,
            head_dim=head_dim,
            qk_norm=qk_norm,
            pass_softcap=arch.softcap_kwarg,
            # 0 (Qwen2-MoE without sliding layers) means no window, as None does
            sliding_window=getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None)) or None,
            rope_fused=self.rope_kind(rope, attn.qkv_proj.weight if hasattr(attn, "qkv_proj") else attn.q_proj.weight),
            cache_arg=cache_arg,
        )
        kind = {"": "the model's rope", "full": "fused rope kernel", "any": "fused rope kernel"}[spec.rope_fused]
        qk_norms = _qk_norms_fusable(attn, qk_specs, head_dim) if spec.rope_fused else None
        if qk_norms is not None:
            spec = dataclasses.replace(spec, qk_norms=qk_norms)
            kind = "q_norm/k_norm + rope in one kernel"
        self.add("attn", path, attn, f"forward with the fused qkv GEMM and {kind}", spec=spec, rope=rope)
        for name in arch.qkv:
            self.no_route.add(_join(path, name))

    def moe_block(self, path: str, block: nn.Module) -> None:
        for child in block._modules:  # experts, router, shared-expert gate: left to the block
            if child not in SHARED_EXPERTS:
                self.no_route.add(_join(path, child))
                self.no_route_prefixes.append(_join(path, child) + ".")
        spec = moe_mod.plan_experts(block.experts)
        name = moe_mod.router_name(block)
        router = getattr(block, name) if name is not None else None
        rspec = moe_mod.plan_router(router) if self.opts["fused_ops"] and router is not None else None
        if self.opts["fused_ops"] and hasattr(block, "shared_expert_gate"):  # Qwen2-MoE: one call for all experts
            fold = moe_shared.plan(block, spec, rspec)
            if not isinstance(fold, str):
                self.no_route_prefixes.append(_join(path, "shared_expert") + ".")
                self.add("moe_fold", path, block, fold.describe(), spec=fold)
                return
            self.skip("moe_fold", path, block, fold)
        for shared in SHARED_EXPERTS:  # a dense MLP every token runs: fused as the decoder MLPs are
            if isinstance(getattr(block, shared, None), nn.Module):
                self.mlp(_join(path, shared), getattr(block, shared))
        if isinstance(spec, str):
            self.skip("moe", path, block, spec)
        else:
            detail = f"experts -> gemmtune.fused_moe ({spec.describe()})"
            self.add("moe", _join(path, "experts"), block.experts, detail, spec=spec)
        if isinstance(rspec, str):
            self.skip("router", _join(path, name), router, rspec)
        elif rspec is not None:
            self.add("router", _join(path, name), router, rspec.summary(), spec=rspec)

    def mlp(self, path: str, mlp: nn.Module) -> None:
        arch, fused_ops = self.arch, self.opts["fused_ops"]
        if architectures.is_moe_block(mlp):
            self.moe_block(path, mlp)
            return
        act_attr = "act_fn" if hasattr(mlp, "act_fn") else "activation_fn"
        act_fn = getattr(mlp, act_attr, None)
        if "forward" in mlp.__dict__ or act_fn is None or not isinstance(getattr(mlp, "down_proj", None), nn.Linear):
            self.skip("mlp", path, mlp, "layout not recognized (down_proj / act_fn / forward)")
            return
        if arch.gate_up is not None:
            if not self.opts["fuse_gate_up"]:
                return
            why = fusion.fuse_skip_reason(mlp, arch.gate_up, "gate_up_proj")
            if why is not None:
                self.skip("fuse gate_up", path, mlp, why)
                return
            ref = getattr(mlp, arch.gate_up[0]).weight
            size = getattr(mlp, arch.gate_up[0]).out_features
            if getattr(mlp, arch.gate_up[1]).out_features != size:
                self.skip("fuse gate_up", path, mlp, "gate and up widths differ")
                return
            self.add(
                "fuse", path, mlp, f"gate/up -> gate_up_proj N={2 * size}", names=arch.gate_up, fused="gate_up_proj"
            )
            for name in arch.gate_up:
                self.no_route.add(_join(path, name))
        else:  # already fused (Phi3): only the activation changes
            gu = getattr(mlp, "gate_up_proj", None)
            if not isinstance(gu, nn.Linear) or gu.out_features % 2 or not fused_ops:
                return
            ref = gu.weight
        act = architectures.detect_act(act_fn, ref.device, ref.dtype) if fused_ops else None
        if fused_ops and act is None:
            self.skip("act", path, mlp, f"{type(act_fn).__name__} is not SiLU or GELU-tanh: applied in torch")
        elif arch.gate_up is None and act is None:
            return
        label = f"{act}*mul kernel" if act else "torch act*mul"
        self.add(
            "mlp", path, mlp, f"forward gate_up -> {label} -> down_proj", spec=architectures.MlpSpec(act, act_attr)
        )

    def layer(self, path: str, layer: nn.Module) -> None:
        arch, opts = self.arch, self.opts
        pre = arch.prefix
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, arch.mlp, None)
        if type(layer).__name__ != f"{pre}DecoderLayer" or type(attn).__name__ != f"{pre}Attention" or mlp is None:
            self.skip("layer", path, layer, f"layout is not {pre}DecoderLayer/{pre}Attention: Linear routing only")
            return
        qk_specs = {}  # q_norm / k_norm formulas, probed first: the attention forward may fuse them
        if opts["fused_ops"] and arch.qk_norm:
            for n in ("q_norm", "k_norm"):
                if isinstance(getattr(attn, n, None), nn.Module):
                    qk_specs[n] = architectures.detect_norm(getattr(attn, n))
        self.attention(_join(path, "self_attn"), attn, qk_specs)
        self.mlp(_join(path, arch.mlp), mlp)
        if not opts["fused_ops"]:
            return
        for n, spec in qk_specs.items():
            self.norm(_join(path, "self_attn", n), getattr(attn, n), spec)
        for n in arch.attn_norms:  # norms inside an attention forward that stays stock
            if isinstance(getattr(attn, n, None), nn.Module):  # (DeepSeek's q_a_layernorm is None without q_lora)
                self.norm(_join(path, "self_attn", n), getattr(attn, n))
        names = architectures.LAYER_NORMS[arch.layer]
        specs = {}
        for n in names:
            mod = getattr(layer, n, None)
            if not isinstance(mod, nn.Module):
                self.skip("layer", path, layer, f"no {n}")
                return
            specs[n] = self.norm(_join(path, n), mod)
        add_norm = "pre_feedforward_layernorm" if arch.layer == "sandwich" else "post_attention_layernorm"
        call_why = architectures.layer_call(type(layer))
        if "forward" in layer.__dict__:
            self.skip("layer", path, layer, "its forward is already overridden on the instance")
        elif call_why is not None:
            self.skip("layer", path, layer, call_why)
        elif arch.layer == "scaled" and type(getattr(layer, "residual_multiplier", None)) not in (int, float):
            self.skip("layer", path, layer, "no int / float residual_multiplier")
        elif specs[add_norm] is None or getattr(layer, add_norm)._forward_hooks:
            self.skip("layer", path, layer, f"{add_norm} not fusable with the residual add")
        else:
            self.add("layer", path, layer, f"residual add + {add_norm} fused ({arch.layer})", layout=arch.layer)

    def linears(self) -> None:
        if not self.opts["route_linears"]:
            return
        route = RouteOptions(self.opts["m_threshold"], self.opts["split_bias"])
        for path, mod in self.model.named_modules():
            if not isinstance(mod, nn.Linear) or path in self.no_route:
                continue
            if hasattr(mod, "weight_scale_inv"):  # an fp8 checkpoint Linear: route_fp8_linears reports it
                continue
            if any(path.startswith(p) for p in self.no_route_prefixes):
                continue
            why = linear_skip_reason(mod)
            if why:
                self.skip("linear", path, mod, why)
            else:
                self.add("route", path, mod, f"GEMM N={mod.out_features} K={mod.in_features}", opts=route)

    def plan(self, tier: str | None) -> list[Action]:
        arch = self.arch
        stack = architectures.decoder_stack(self.model)
        if arch is None or stack is None:
            mt = getattr(getattr(self.model, "config", None), "model_type", "?")
            self.skip(
                "architecture",
                "",
                self.model,
                f"model_type {mt!r} is not a known architecture: plain Linear routing only",
            )
        else:
            spath, smod = stack
            for i, layer in enumerate(smod.layers):
                self.layer(_join(spath, "layers", str(i)), layer)
            final = getattr(smod, "norm", None)
            if self.opts["fused_ops"] and isinstance(final, nn.Module):
                self.norm(_join(spath, "norm"), final)
            index = mask_positions.plan(smod) if self.opts["fused_ops"] else "fused_ops=False"
            if isinstance(index, str):
                self.skip("positions", spath, smod, index)
            else:
                self.add("positions", spath, smod, "causal mask without transformers' packed-sequence check (a "
                         "host sync) when the model makes its own position ids", index=index)  # fmt: skip
            if tier is not None:
                self.actions.insert(0, Action("config", "", {"tier": tier}))
                self.report.change("attention", "", type(self.model).__name__,
                                   f"{attn_mod.NAMES[tier]} ({tier} tier) via AttentionInterface")  # fmt: skip
        if self.opts["fused_ops"] and not self.opts.get("quantize"):
            # (the fused-epilogue MLP runs its own 16-bit GEMMs: with quantize it would bypass the 8-bit ones)
            epilogue_mlp.plan(self, self.model)
        self.linears()
        return self.actions


def _uses_qk_norm(arch: architectures.Architecture, attn: nn.Module) -> bool:
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


# ---- apply / undo -------------------------------------------------------------------------------
def _swap_config(model: nn.Module, old, new) -> None:
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new


def _apply(model: nn.Module, a: Action, route: RouteOptions) -> None:
    if "tp" in a.data:  # a sharded module of a tensor-parallel model (models/tensor_parallel.py)
        return a.data["tp"].apply(model, a.path, lambda: _apply_one(model, a, route))
    return _apply_one(model, a, route)


def _apply_one(model: nn.Module, a: Action, route: RouteOptions) -> None:
    mod = _get(model, a.path)
    if a.kind == "config":
        a.data["registration"] = attn_mod.registration()  # a torch.load'ed copy registers the tiers too
        old = model.config
        new = copy.deepcopy(old)  # private copy: models sharing the config object stay untouched
        new._attn_implementation = attn_mod.NAMES[a.data["tier"]]
        _swap_config(model, old, new)
        a.data["old"] = old
    elif a.kind == "fuse":
        fusion.fuse(mod, a.data["names"], a.data["fused"], route)
    elif a.kind == "attn":
        mod._gemmtune_attn = a.data["spec"]
        mod._gemmtune_rope = a.data["rope"]
        mod.forward = bind(architectures._attention_forward, mod)
    elif a.kind == "mlp":
        mod._gemmtune_mlp = a.data["spec"]
        mod.forward = bind(architectures._mlp_forward, mod)
    elif a.kind == "norm":
        mod._gemmtune_norm = a.data["spec"]
        mod.forward = bind(architectures._norm_forward, mod)
        mod.__dict__[architectures.ADD_NORM] = bind(architectures._add_norm_forward, mod)
    elif a.kind == "layer":
        mod.forward = bind(architectures.LAYER_FORWARDS[a.data["layout"]], mod)
    elif a.kind == "route":
        route_linear(mod, a.data["opts"])
    elif a.kind == "moe":
        moe_mod.apply(mod, a.data["spec"])
    elif a.kind == "router":
        moe_mod.apply_router(mod, a.data["spec"])
    elif a.kind == "moe_fold":
        moe_shared.apply(mod, a.data["spec"])
    elif a.kind == "mla":
        mla.apply(mod, a.data["spec"])
    elif a.kind == "epilogue_mlp":
        epilogue_mlp.apply(mod, a.data["spec"])
    elif a.kind == "positions":
        mask_positions.apply(mod, a.data["index"])
    else:
        raise AssertionError(a.kind)


_ATTRS = {
    "attn": ("forward", "_gemmtune_attn", "_gemmtune_rope"),
    "mlp": ("forward", "_gemmtune_mlp"),
    "norm": ("forward", "_gemmtune_norm", architectures.ADD_NORM),
    "layer": ("forward",),
    "moe": ("forward", "_gemmtune_moe"),
    "router": ("forward", "_gemmtune_router"),
    "moe_fold": moe_shared.UNDO_ATTRS,
    "mla": mla.UNDO_ATTRS,
    "epilogue_mlp": epilogue_mlp.UNDO_ATTRS,
    "positions": mask_positions.UNDO_ATTRS,
}


def _undo(model: nn.Module, a: Action) -> str | None:
    """Undo one action; returns why it could not be undone where the module tree changed since."""
    if "tp" in a.data:
        return a.data["tp"].undo(model, a.path, lambda: _undo_one(model, a))
    return _undo_one(model, a)


def _undo_one(model: nn.Module, a: Action) -> str | None:
    if a.kind == "config":
        _swap_config(model, model.config, a.data["old"])
        return None
    if a.kind == "quantize":
        a.data["undo"]()
        return None
    try:
        mod = _get(model, a.path)
    except AttributeError:
        return None  # restore() names the missing module once
    if a.kind == "fuse":
        return fusion.unfuse(mod, a.data["fused"])
    if a.kind == "route":
        if is_routed(mod):
            unroute_linear(mod)
        return None
    attrs = _ATTRS[a.kind]
    if not any(k in mod.__dict__ for k in attrs[1:]) and bound_function(mod) is None:
        return None  # a module put there after optimize(): nothing of gemmtune's on it
    for attr in attrs:
        mod.__dict__.pop(attr, None)
    return None


def _softcap(model) -> float | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def _device(model):
    p = next(model.parameters(), None)
    return None if p is None else p.device


# ---- the cached-path check ----------------------------------------------------------------------
def _inside(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


class _CachedPathCheck:
    """optimize()'s parity check (models/verify.py): the stock trace before the changes, the judgement
    after; what disagrees is undone here and reported."""

    def __init__(self, model, report: OptimizeReport):
        from ..dispatch import get_dispatcher

        spath, smod = architectures.decoder_stack(model)
        self.paths = [_join(spath, "layers", str(i)) for i in range(len(smod.layers))]
        self.layers = list(smod.layers)
        self.quiet = get_dispatcher().quiet
        self.probe = verify_mod.Probe.for_model(model)
        self.tol = verify_mod.tolerance(model)
        with self.quiet():
            self.stock = verify_mod.run(model, self.layers, self.probe)

    def finish(self, model, actions: list[Action], done: list[Action], report: OptimizeReport) -> None:
        def revert(pick) -> int:
            picked = [a for a in reversed(done) if pick(a)]
            for a in picked:
                _undo(model, a)
                done.remove(a)
                actions.remove(a)
            return len(picked)

        try:
            with self.quiet():
                opt = verify_mod.run(model, self.layers, self.probe, teacher=self.stock)
        except Exception as e:  # noqa: BLE001 - a patched path that cannot even run: nothing stays patched
            revert(lambda a: True)
            report.entries = [e for e in report.entries if e.section == "left alone"]
            report.changed.clear()
            report.notes.append(f"cached-path check failed to run the optimized model ({type(e).__name__}: {e}); "
                                "every change was undone")  # fmt: skip
            return
        verdict = verify_mod.compare(self.stock, opt, self.probe, self.tol)
        verdict = tp_mod.decide_together(verdict, tp_mod.group_of(model))  # every rank puts back the same
        bad, logits = verdict.bad, verdict.logits
        for f in bad:
            prefix = self.paths[f.index]
            if revert(lambda a, p=prefix: _inside(a.path, p)):
                report.withdraw(prefix)
                why = f"differs from stock at {f.where()} (relative error {f.error:.2e} > {self.tol:g})"
                report.skip("verify", prefix, type(self.layers[f.index]).__name__, why)
        last_ok = not bad or bad[-1].index != len(self.layers) - 1
        if logits is not None and last_ok:  # the final norm or lm_head path, outside every layer
            outside = lambda a: a.kind != "config" and not any(_inside(a.path, p) for p in self.paths)  # noqa: E731
            reverted = [a.path for a in done if outside(a)]
            revert(outside)
            for p in reverted:
                report.withdraw(p)
            why = f"logits differ from stock at {logits.where()} (relative error {logits.error:.2e} > {self.tol:g})"
            report.skip("verify", "", type(model).__name__, why + ": changes outside the decoder layers undone")
        n = len(self.layers)
        secs = self.stock.seconds + opt.seconds
        report.notes.append(
            f"cached-path check: {n - len(bad)}/{n} decoder layers agree with stock (prefill of {verify_mod.PREFILL}"
            f" + {verify_mod.DECODE_STEPS} cached decode steps, batch {verify_mod.BATCH} left-padded, relative"
            f" error <= {self.tol:g}; worst layer {verdict.worst_layer:.1e}); took {secs:.2f} s"
        )


# (what makes new weight tensors from the model's parameters, the option that leaves it out)
_NEW_WEIGHTS = {
    "qkv_proj": ("fusing q/k/v", "fuse_qkv=False"),
    "gate_up_proj": ("fusing gate/up", "fuse_gate_up=False"),
    "moe_fold": ("folding shared experts into the experts", "fused_ops=False"),
}


def _optimizers_holding(model) -> list[str]:
    """The names of the model's parameters that a live torch.optim.Optimizer holds (found by the garbage
    collector's list of objects: an optimizer keeps no link back to the model)."""
    import gc

    ids = {id(p): name for name, p in model.named_parameters()}
    held = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):  # type(): a dead weakref proxy raises on isinstance
            held |= {ids[id(p)] for group in obj.param_groups for p in group["params"] if id(p) in ids}
    return sorted(held)


def _refuse_new_weights_when_trained(model, actions: list[Action], opts: dict) -> None:
    """No new weight tensors for a model being trained: in training mode, or with parameters an optimizer
    already holds, that optimizer would keep stepping the Parameters the new tensors replace and silently
    stop training what the model computes with."""
    found = {_NEW_WEIGHTS[a.data["fused"] if a.kind == "fuse" else a.kind] for a in actions
             if a.kind == "moe_fold" or (a.kind == "fuse" and a.data["fused"] in _NEW_WEIGHTS)}  # fmt: skip
    if opts.get("quantize"):
        found.add((f"quantize={opts['quantize']!r}", "quantize=None"))
    if not found:
        return
    what, remedy = zip(*sorted(found))
    if model.training:
        why, first = "the model is in training mode (model.training is True)", "call model.eval() first"
    else:
        held = _optimizers_holding(model)
        if not held:
            return
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        why, first = f"an optimizer holds the model's parameters ({shown})", "make optimizers after optimize()"
    raise ValueError(
        f"gemmtune.optimize: {why} and {', '.join(what)} makes new weight tensors that an optimizer made "
        f"before optimize() would not train; {first} (gemmtune.restore(model) before training again), or "
        f"pass {', '.join(remedy)}"
    )


# ---- public -------------------------------------------------------------------------------------
def optimize(
    model,
    *,
    config=None,
    fuse_qkv: bool = True,
    fuse_gate_up: bool = True,
    fused_ops: bool = True,
    attention: str | None = "auto",
    m_threshold: int | None = None,
    split_bias: bool = False,
    route_linears: bool = True,
    quantize: str | None = None,
    quantize_lm_head: bool = False,
    quantize_producers: bool = True,
    verify: bool = True,
    mla_absorb: bool = True,
) -> OptimizeReport:
    """Optimize a loaded Hugging Face causal LM in place (call before torch.compile).

    config: a tuned table (path, list of paths or ConfigTable) to put in effect for gemmtune.gemm.
    fuse_qkv / fuse_gate_up: one GEMM for q/k/v and for gate/up. fused_ops: Triton RMSNorm,
    residual-add + RMSNorm and act*mul, and the causal mask built without transformers' packed-sequence
    sync on the model's own positions (models/mask_positions.py). attention: "auto", "flash", "triton",
    "flex", "sdpa", "eager" or None (leave as is; models/attention.py describes the tiers);
    GEMMTUNE_ATTENTION forces a tier.
    m_threshold: calls with fewer rows keep F.linear.
    split_bias: bias-free GEMM plus a separate add. route_linears: other nn.Linear via gemmtune.gemm,
    and fp8 block-scaled checkpoint Linears (transformers' FP8Linear) via gemm_a8w8_blockscale.
    quantize: "fp8" / "int8" (per-channel weights, per-token activations) or "fp8-block" (128x128 /
    1x128) runs the linears through the 8-bit ops (models/quantize.py); lm_head only with
    quantize_lm_head. In fused decoder layers the norms and act*mul emit the next GEMM's input
    already quantized (models/quant_feeds.py); quantize_producers=False leaves that out (each 8-bit
    GEMM quantizes its 16-bit input: the same math, one more pass per GEMM; for comparisons).
    verify: check every changed decoder layer against stock on a tiny left-padded prefill plus cached
    decode steps (models/verify.py) before quantizing; a layer that disagrees is put back to stock and
    reported (its cost is in the report's notes).
    mla_absorb: DeepSeek-V2/V3's MLA decodes (<= 16 new tokens) on the latent cache with kv_b_proj
    absorbed (models/mla.py), where transformers expands the whole cache every step: a 4-layer
    DeepSeek-V3's CUDA-graph decode 1.54x (b=1) / 1.95x (b=8) over stock instead of 1.19x / 1.10x
    (H100). False keeps its own forward.
    A model in training mode is refused where the changes would make new weight tensors (fusions, the
    shared-expert fold, quantize): an optimizer made earlier would not train them (docs/model-toolkit.md).
    Returns an OptimizeReport; gemmtune.restore(model) (or report.undo()) gives the original back.
    """
    flags = dict(fuse_qkv=fuse_qkv, fuse_gate_up=fuse_gate_up, fused_ops=fused_ops, split_bias=split_bias,
                 route_linears=route_linears, quantize_lm_head=quantize_lm_head,
                 quantize_producers=quantize_producers, verify=verify, mla_absorb=mla_absorb)  # fmt: skip
    for name, flag in flags.items():
        check_bool("optimize", name, flag)
    check_choice("optimize", "attention", attention, ATTENTION_CHOICES, optional=True)
    check_int("optimize", "m_threshold", m_threshold, optional=True)
    if quantize is not None:
        from .quantize import check_mode

        check_mode(quantize)
    version = check_transformers()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"gemmtune.optimize takes a transformers PreTrainedModel, got {type(model).__name__}")
    opts = dict(
        fuse_qkv=bool(fuse_qkv), fuse_gate_up=bool(fuse_gate_up), fused_ops=bool(fused_ops),
        attention=attention, m_threshold=m_threshold, split_bias=bool(split_bias),
        route_linears=bool(route_linears), config=None if config is None else repr(config), verify=bool(verify),
    )  # fmt: skip
    opts.update(mla_absorb=bool(mla_absorb))
    if quantize is not None:
        from .quantize import check_mode

        opts.update(quantize=check_mode(quantize), quantize_lm_head=bool(quantize_lm_head),
                    quantize_producers=bool(quantize_producers))  # fmt: skip
    existing = model.__dict__.get(_REPORT)
    if existing is not None:
        if existing.options == opts:
            return existing  # idempotent: the same call twice changes nothing
        raise ValueError(
            "gemmtune.optimize: this model is already optimized with other options "
            f"({existing.options}); call gemmtune.restore(model) first"
        )
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"gemmtune.optimize: parameters are not materialized (meta device), e.g. {meta[0]}")
    tier, note = attn_mod.resolve_tier(attention, _softcap(model), _device(model))
    arch = architectures.architecture_of(model)
    report = OptimizeReport(
        architecture=arch.name if arch else "unknown",
        model_type=str(getattr(model.config, "model_type", "?")),
        transformers_version=version,
        options=opts,
        attention_tier=tier if arch else None,
        attention_note=note,
    )
    if model.training:
        report.notes.append("model is in training mode: fused layer forwards run the stock path until eval()")
    if fused_ops:
        if not triton_installed():
            report.notes.append("triton is not installed: fused ops run their PyTorch references")
    actions = tp_mod.plan(model, report, lambda: _Planner(model, arch, opts, report).plan(tier),
                          check_tables=config is None)  # fmt: skip
    _refuse_new_weights_when_trained(model, actions, opts)
    route = RouteOptions(m_threshold, bool(split_bias))
    check = None
    if verify and arch is not None and architectures.decoder_stack(model) is not None and actions:
        try:
            check = _CachedPathCheck(model, report)
        except Exception as e:  # noqa: BLE001 - the stock model itself cannot run the probe
            report.notes.append(f"cached-path check not run: the stock model failed on its probe ({e})")
    if config is not None:
        from ..dispatch import set_config

        set_config(config)
        report.notes.append("tuned table put in effect for gemmtune.gemm (process-wide)")
    done: list[Action] = []
    try:
        for a in actions:
            _apply(model, a, route)
            done.append(a)
        if check is not None:
            check.finish(model, actions, done, report)
        if quantize is not None:
            from .quant_feeds import wire_producers
            from .quantize import quantize_linears

            a = Action("quantize", "", {"undo": quantize_linears(model, quantize, report, bool(quantize_lm_head))})
            actions.append(a)
            done.append(a)
            if quantize_producers:
                a = Action("quantize", "", {"undo": wire_producers(model, report)})  # norms / act*mul emit 8-bit
                actions.append(a)
                done.append(a)
        if route_linears:  # fp8 checkpoint Linears (transformers' FP8Linear) through gemm_a8w8_blockscale
            from .fp8_checkpoint import route_fp8_linears

            a = Action("quantize", "", {"undo": route_fp8_linears(model, report)})
            actions.append(a)
            done.append(a)
    except BaseException:
        for a in reversed(done):
            _undo(model, a)
        raise
    report._model = model
    report._restore = restore
    report._actions = actions
    model.__dict__[_REPORT] = report
    return report


def restore(model):
    """Undo gemmtune.optimize on `model` (weights of fused projections come back as views). Modules
    deleted or replaced after optimize() are left as they are and named in one warning."""
    report = getattr(model, "__dict__", {}).get(_REPORT)
    if report is None:
        raise ValueError("gemmtune.restore: this model was not optimized by gemmtune.optimize")
    left = {}
    for a in reversed(report._actions):
        why = _undo(model, a)
        gone = _missing_prefix(model, a.path)
        if gone is not None:
            left.setdefault(gone, "no longer in the model")
        elif why is not None:
            left.setdefault(a.path, why)
    del model.__dict__[_REPORT]
    report._model = None
    if left:
        where = "; ".join(f"{p}: {why}" for p, why in reversed(left.items()))
        warnings.warn(f"gemmtune.restore: the module tree changed after optimize(); not restored: {where}",
                      stacklevel=2)  # fmt: skip
    return model


def _missing_prefix(model: nn.Module, path: str) -> str | None:
    """The first prefix of `path` that names no module of `model` (None when the whole path does)."""
    mod, parts = model, path.split(".") if path else []
    for i, name in enumerate(parts):
        mod = mod._modules.get(name) if isinstance(mod, nn.Module) else None
        if mod is None:
            return ".".join(parts[: i + 1])
    return None


def report_of(model) -> OptimizeReport | None:
    """The report of an optimized model, or None."""
    return getattr(model, "__dict__", {}).get(_REPORT)
