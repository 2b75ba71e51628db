"""What every public op shares: its runner cache and miss path (OpCache), the registration of its custom
op (custom_op) and its entry in the registry (public_op). The op's eager function is written out in its
module and calls these: `gemm` in ops/gemm.py is the form every op follows (docs/extending.md walks
through it).

- signature(*args) -> a hashable tuple of everything validate() depends on: a signature found in the
  cache was validated when first seen.
- validate(*args) raises naming the bad argument: on a miss, and when the signature cannot be built from
  the arguments (a non-tensor, an unhashable value).
- bind(*args) -> the call to cache for this signature, after validate: usually the family's runner from
  `get_dispatcher().runner_for(key, ...)`, or a closure making the views that runner takes.

The hot path is one frame for the signature, one dict lookup, the cached call: keep it so (no helper
frame around the lookup; a try costs nothing when nothing raises).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..dispatch import get_dispatcher
from . import registry


class OpCache:
    """One op's validated calls: {signature: the bound call}, in the dispatcher's runner cache."""

    __slots__ = ("name", "family", "get", "_runners", "_validate", "_bind")

    def __init__(self, name: str, *, family: str, validate: Callable, bind: Callable, cache: str | None = None):
        """name: the public op's (its custom op is gemmtune::<name>); cache: the dispatcher's runner
        cache (default the family's)."""
        self.name, self.family = name, family
        self._runners = get_dispatcher().cache(cache or family)  # cleared in place by the dispatcher, never rebound
        self.get = self._runners.get  # the hot path's one lookup: a bound dict method, no frame of ours
        self._validate, self._bind = validate, bind

    def miss(self, sig, *args) -> Callable:
        """The call for a signature not seen yet: validate, bind, store."""
        self._validate(*args)
        bound = self._bind(*args)
        self._runners[sig] = bound
        return bound

    def reject(self, *args) -> None:
        """The arguments' signature could not be built: validate raises naming the bad one (if it does
        not, the caller re-raises the signature's error)."""
        self._validate(*args)


def public_op(cache: OpCache, *, aiter_names: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declare the op's eager function (returned as it is): it runs as gemmtune::<cache.name> under
    torch.compile and reads its family's tables; aiter_names: its names in aiter's tuned_gemm
    (gemmtune.tuned_gemm re-exports it under them)."""

    def record(fn: Callable) -> Callable:
        if fn.__name__ != cache.name:
            raise TypeError(f"public_op: {fn.__name__} is declared with the cache of {cache.name}")
        return registry.record(
            fn, custom_op=f"gemmtune::{cache.name}", family=cache.family, aiter_names=tuple(aiter_names)
        )

    return record


def custom_op(
    cache: OpCache,
    *,
    fake: Callable,
    autograd: tuple[Callable, Callable] | None = None,
) -> Callable[[Callable], Callable]:
    """Register `body` as the custom op gemmtune::<cache.name> (what torch.compile and export see): its
    schema is the body's annotated parameters; it runs without grad (the op's autograd, where it has one,
    is registered on the op: (backward, setup_context)); fake(*op_args) -> the output's empty tensor when
    tracing. Returns the op."""

    def register(body: Callable):
        schema = torch.library.infer_schema(body, mutates_args=())  # body's annotations, read in its module

        def run(*args, **kwargs):
            with torch.no_grad():
                return body(*args, **kwargs)

        opdef = torch.library.custom_op(f"gemmtune::{cache.name}", run, mutates_args=(), schema=schema)
        opdef.register_fake(fake)
        if autograd is not None:
            opdef.register_autograd(autograd[0], setup_context=autograd[1])
        return getattr(torch.ops.gemmtune, cache.name)

    return register


def spelling_of(op: Callable, *, aiter_names: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declare a public function that only re-spells `op` (gemm_bias of gemm_epilogue): it runs as op's
    custom op and reads op's family's tables."""

    def record(fn: Callable) -> Callable:
        entry = registry.entry(op.__name__)
        return registry.record(fn, custom_op=entry.custom_op, family=entry.family, aiter_names=tuple(aiter_names))

    return record


def public_helper(*, family: str | None) -> Callable[[Callable], Callable]:
    """Declare a public function of an op module that is no op (prune_2_4, prepare_expert_weights)."""
    return lambda fn: registry.record(fn, custom_op=None, family=family)
