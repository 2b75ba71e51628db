"""Projection fusion: several nn.Linear reading the same input become one FusedLinear.

The fused weight is cat(parts) and the parts' Parameters are dropped, so memory is not doubled. The
original module objects are kept (without parameters) on the parent and get views of the fused
weight back at restore. state_dict stays checkpoint-compatible both ways: a hook splits the fused
tensors back into the original keys (as views, no copy) on save, and a load pre-hook concatenates the
original keys into the fused parameter on load; a checkpoint with only some of the parts is refused
with a message naming them.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import FusedLinear, RouteOptions, linear_skip_reason
from .rewrite import Change, Rewrite, find, join
from .sharding import ShardedChange

# the one parallel style whose parts fuse: replicated input, this rank's slice of the output features,
# so the rank's local parts concatenated are its shard of the fused weight
FUSABLE_STYLE = "colwise"

_STATE = "_gemmtune_fused"  # parent.__dict__: fused_name -> {"stash": {name: module}, "order": [...]}
_HOOKS = "_gemmtune_fuse_hooks"


def fuse_skip_reason(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> str | None:
    """Why `names` on `parent` cannot be fused (None when they can)."""
    mods = [getattr(parent, n, None) for n in names]
    for n, m in zip(names, mods):
        if m is None:
            return f"no {n}"
        why = linear_skip_reason(m)
        if why:
            return f"{n}: {why}"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{n} has forward hooks that a fused GEMM would bypass"
    first = mods[0].weight
    for n, m in zip(names, mods):
        if m.in_features != mods[0].in_features:
            return f"{n} reads {m.in_features} features, {names[0]} {mods[0].in_features}"
        if m.weight.dtype != first.dtype or m.weight.device != first.device:
            return f"{n} is {m.weight.dtype} on {m.weight.device}, {names[0]} {first.dtype} on {first.device}"
        if m.bias is not None and (m.bias.dtype != first.dtype or m.bias.device != first.device):
            return f"{n}.bias dtype/device differs from the weights"
        if m.weight.requires_grad != first.requires_grad:
            return "the parts differ in requires_grad"
    if fused_name in parent._modules or fused_name in parent.__dict__:
        return f"{type(parent).__name__} already has an attribute {fused_name!r}"
    return None


def _reorder(parent: nn.Module, order: list[str], replace: dict[str, str | None], new: dict) -> None:
    """Rebuild parent._modules in `order`, swapping names per `replace` (old -> new name or None)."""
    mods = dict(parent._modules)
    mods.update(new)
    out = {}
    for k in order:
        if k in replace:
            target = replace[k]
            if target is not None:
                out[target] = mods[target]
        elif k in mods:
            out[k] = mods[k]
    for k, v in mods.items():  # anything added meanwhile stays, at the end
        if k not in out and k not in replace:
            out[k] = v
    parent._modules.clear()
    parent._modules.update(out)


def fuse(parent: nn.Module, names: tuple[str, ...], fused_name: str, opts: RouteOptions) -> FusedLinear:
    """Replace parent.<names> by parent.<fused_name> (call fuse_skip_reason first)."""
    mods = [getattr(parent, n) for n in names]
    has_bias = [m.bias is not None for m in mods]
    with torch.no_grad():
        w = torch.cat([m.weight for m in mods], 0)
        b = None
        if any(has_bias):
            b = torch.cat([
                m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in mods
            ])  # fmt: skip
    rg = mods[0].weight.requires_grad
    fused = FusedLinear(
        nn.Parameter(w, requires_grad=rg),
        None if b is None else nn.Parameter(b, requires_grad=rg),
        [(n, m.out_features, hb) for n, m, hb in zip(names, mods, has_bias)],
        opts,
    )
    order = list(parent._modules)
    for m in mods:  # drop the parameters: the fused copy is now the only one
        m.weight = None
        if m.bias is not None:
            m.bias = None
    replace = {names[0]: fused_name, **{n: None for n in names[1:]}}
    _reorder(parent, order, replace, {fused_name: fused})
    state = {"stash": dict(zip(names, mods)), "order": order, "fused": fused}
    parent.__dict__.setdefault(_STATE, {})[fused_name] = state
    if _HOOKS not in parent.__dict__:
        parent.__dict__[_HOOKS] = (
            parent._register_state_dict_hook(_split_state_dict),
            parent._register_load_state_dict_pre_hook(_fuse_state_dict, with_module=True),
        )
    return fused


def unfuse(parent: nn.Module, fused_name: str) -> str | None:
    """Put the original projections back, their weights views of the fused weight (no copy). Returns why
    they could not be put back (None when they were): the fused module was replaced or removed since."""
    state = parent.__dict__.get(_STATE, {}).pop(fused_name, None)
    if state is None:
        return f"{fused_name} is not fused here (the module was replaced after optimize())"
    fused = parent._modules.get(fused_name)
    if fused is not state["fused"]:  # the user's module stays; the state-dict hooks must not split it
        _drop_hooks(parent)
        what = "replaced" if fused is not None else "removed"
        return f"{fused_name} was {what} after optimize(): {', '.join(state['stash'])} not put back"
    w, b = fused.weight, fused.bias
    off = 0
    for name, size, had_bias in fused.parts:
        m = state["stash"][name]
        m.weight = nn.Parameter(w.data[off : off + size], requires_grad=w.requires_grad)
        if had_bias:
            m.bias = nn.Parameter(b.data[off : off + size], requires_grad=b.requires_grad)
        off += size
    del parent._modules[fused_name]
    _reorder(parent, state["order"], {}, state["stash"])
    _drop_hooks(parent)
    return None


class Fusion(Rewrite):
    """Projections of one module fused into one Linear (change.data: names, fused name, RouteOptions).
    Subclasses plan it; `remedy` is the option that leaves it out."""

    kind = "fuse"
    what = ""  # what makes the new weight tensor, for optimize()'s refusal in training
    remedy = ""

    def apply(self, model: nn.Module, change: Change, report) -> None:
        fuse(find(model, change.path), change.data["names"], change.data["fused"], change.data["route"])

    def undo(self, model: nn.Module, change: Change) -> str | None:
        parent = find(model, change.path)
        return None if parent is None else unfuse(parent, change.data["fused"])

    def new_weights(self, change: Change) -> tuple[str, str] | None:
        return self.what, self.remedy

    def on_sharded(self, model, sharding, change: Change):
        names = change.data["names"]
        styles = [sharding.hooked_style(join(change.path, n)) for n in names]
        if all(s is None for s in styles):
            return None, None
        if any(s != FUSABLE_STYLE for s in styles):
            shown = ", ".join(f"{n} {s!r}" for n, s in zip(names, styles))
            return f"tensor parallel: fusing needs every part {FUSABLE_STYLE!r}, the plan has {shown}", None
        return None, ShardedChange(sharding, local=tuple(names))


def _drop_hooks(parent: nn.Module) -> None:
    """Remove the state-dict hooks once nothing on `parent` is fused."""
    if parent.__dict__.get(_STATE):
        return
    parent.__dict__.pop(_STATE, None)
    for handle in parent.__dict__.pop(_HOOKS, ()):
        handle.remove()


def fused_parts(parent: nn.Module):
    """(fused_name, FusedLinear) pairs fused on this parent."""
    for name in parent.__dict__.get(_STATE, {}):
        yield name, parent._modules[name]


def _split_state_dict(module, state_dict, prefix, local_metadata):
    with torch.no_grad():
        for name, fused in fused_parts(module):
            w = state_dict.pop(prefix + name + ".weight", None)
            b = state_dict.pop(prefix + name + ".bias", None)
            if w is None:
                continue
            off = 0
            for part, size, had_bias in fused.parts:
                state_dict[prefix + part + ".weight"] = w[off : off + size]
                if had_bias and b is not None:
                    state_dict[prefix + part + ".bias"] = b[off : off + size]
                off += size
    return state_dict


def _fuse_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for name, fused in fused_parts(module):
        wkeys = [prefix + p + ".weight" for p, _, _ in fused.parts]
        present = [k for k in wkeys if k in state_dict]
        if not present:
            continue
        if len(present) != len(wkeys):
            error_msgs.append(
                f"gemmtune fused {', '.join(wkeys)} into {prefix}{name}.weight; the state dict has only "
                f"{', '.join(present)}. Load all parts, or gemmtune.restore(model) before loading."
            )
            continue
        state_dict[prefix + name + ".weight"] = torch.cat([state_dict.pop(k) for k in wkeys], 0)
        if fused.bias is None:
            continue
        bkeys = {p: prefix + p + ".bias" for p, _, had_bias in fused.parts if had_bias}
        if not all(k in state_dict for k in bkeys.values()):
            continue  # load_state_dict reports the fused bias as missing
        got = {p: state_dict.pop(k) for p, k in bkeys.items()}
        ref = next(iter(got.values()))
        state_dict[prefix + name + ".bias"] = torch.cat([
            got[p] if p in got else torch.zeros(size, dtype=ref.dtype, device=ref.device)
            for p, size, _ in fused.parts
        ])  # fmt: skip
