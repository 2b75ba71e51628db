"""optimize(): a forward whose position ids the model makes itself builds its causal mask without
transformers' packed-sequence check.

transformers (5.x) hands the position ids to its mask builders, and when a forward has neither an
attention mask nor a cache (a prefill with use_cache=False) it looks for packed sequences in them:
`(packed[:, -1] == 0).all()` in find_packed_sequence_indices, a device-to-host sync every forward. On
the positions the model makes itself (an arange from the cache's length) the answer is always "not
packed", so the sync decides nothing; it only stops the host from running ahead of the GPU, which an
eager forward with fast kernels needs (its host work then shows in every call).

A stack optimize() patched marks the forwards whose caller gave no position ids (a context variable);
the mask builders of its modeling module, wrapped once, drop the position ids in those calls alone.
Every other call, of any model, goes through as before: a caller's own position ids (packed sequences)
are still checked. Under torch.compile nothing changes (transformers skips the check there itself).
"""

from __future__ import annotations

import contextvars
import functools
import sys
import types

import torch
from torch import nn

from .architectures import named_params
from .bind import bind
from .rewrite import Change, ForwardSwap, PlanContext

MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
_OWN_POSITIONS = contextvars.ContextVar("gemmtune_own_positions", default=False)
_ORIGINAL = "_gemmtune_original"  # on a wrapped builder: the function it wraps
_SPEC = "_gemmtune_positions"  # on a patched stack: the position of position_ids among its forward's arguments


def _wrap(build):
    @functools.wraps(build)
    def build_mask(*args, **kwargs):
        # (dynamo cannot trace a ContextVar; under torch.compile transformers skips the check itself)
        if not torch.compiler.is_compiling() and _OWN_POSITIONS.get() and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = None  # the model's own arange: never packed
        return build(*args, **kwargs)

    setattr(build_mask, _ORIGINAL, build)
    return build_mask


def _builders(stack: nn.Module) -> tuple[types.ModuleType | None, list[str]]:
    module = sys.modules.get(type(stack).__module__)
    return module, [n for n in MASK_BUILDERS if callable(getattr(module, n, None))]


def plan(stack: nn.Module) -> int | str:
    """The index of `position_ids` among the stack forward's arguments, or the reason it is left alone."""
    _, names = _builders(stack)
    if not names:
        return f"{type(stack).__module__} builds no causal mask by name ({', '.join(MASK_BUILDERS)})"
    if "forward" in stack.__dict__:
        return "its forward is already overridden on the instance"
    params = named_params(type(stack).forward)
    if isinstance(params, str):
        return params
    if "position_ids" not in params[0]:
        return "its forward takes no position_ids"
    return params[0].index("position_ids")


def _forward(self, *args, **kwargs):
    own = kwargs.get("position_ids") is None and len(args) <= getattr(self, _SPEC)
    if not own or torch.compiler.is_compiling():
        return type(self).forward(self, *args, **kwargs)
    token = _OWN_POSITIONS.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _OWN_POSITIONS.reset(token)


def apply(stack: nn.Module, index: int) -> None:
    module, names = _builders(stack)
    for name in names:
        build = getattr(module, name)
        if not hasattr(build, _ORIGINAL):
            setattr(module, name, _wrap(build))
    setattr(stack, _SPEC, index)
    stack.forward = bind(_forward, stack)


UNDO_ATTRS = ("forward", _SPEC)


class OwnPositions(ForwardSwap):
    """The decoder stack's forward marks the calls whose position ids the model makes itself."""

    kind = "positions"
    attrs = UNDO_ATTRS

    def applies(self, arch, opts) -> bool:
        return arch is not None

    def plan(self, ctx: PlanContext) -> None:
        if ctx.stack is None:
            return
        spath, smod = ctx.stack
        index = plan(smod) if ctx.opts["fused_ops"] else "fused_ops=False"
        if isinstance(index, str):
            ctx.skip("positions", spath, smod, index)
        else:
            ctx.add(self, spath, smod, "causal mask without transformers' packed-sequence check (a host sync) "
                    "when the model makes its own position ids", index=index)  # fmt: skip

    def install(self, mod: nn.Module, change: Change) -> None:
        apply(mod, change.data["index"])

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)
