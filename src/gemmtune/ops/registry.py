"""Every public op and helper of gemmtune.ops, as its module declares it.

The op modules record their public functions here when imported (ops/hot_path.py's public_op, spelling_of,
public_helper); the package exports, `gemmtune.__all__`, tuned_gemm's aiter names and profiling's list of GEMM
ops are read from this record, so adding an op touches only its own module and ops/__init__'s module list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PublicOp:
    """A public function of gemmtune.ops: an op, a spelling of one (gemm_bias -> gemm_epilogue) or a helper."""

    name: str  # gemmtune.<name>
    fn: Callable
    custom_op: str | None  # the gemmtune:: op it runs as under torch.compile; None for a helper
    family: str | None  # the GEMM family whose tables answer it; None when it is no GEMM (attention)
    aiter_names: tuple[str, ...] = ()  # its names in aiter's tuned_gemm (same arguments), re-exported there

    @property
    def is_gemm_op(self) -> bool:
        return self.custom_op is not None and self.family is not None


_recorded: dict[str, PublicOp] = {}


def record(
    fn: Callable,
    *,
    custom_op: str | None,
    family: str | None,
    aiter_names: tuple[str, ...] = (),
    name: str | None = None,
) -> Callable:
    """Declare `fn` public under `name` (default its own); returns fn, so it reads as a decorator call."""
    entry = PublicOp(name or fn.__name__, fn, custom_op, family, tuple(aiter_names))
    if custom_op is not None and not custom_op.startswith("gemmtune::"):
        raise ValueError(f"ops.registry: custom_op must be a gemmtune:: op, got {custom_op!r}")
    old = _recorded.get(entry.name)
    if old is not None and old.fn.__module__ != fn.__module__:
        raise ValueError(f"ops.registry: {entry.name!r} is declared by {old.fn.__module__} and {fn.__module__}")
    _recorded[entry.name] = entry
    return fn


def entry(name: str) -> PublicOp:
    return _recorded[name]


def public_ops() -> tuple[PublicOp, ...]:
    """Everything recorded, by name."""
    return tuple(sorted(_recorded.values(), key=lambda e: e.name))


def exports() -> dict[str, Callable]:
    """{public name: function} for the package namespaces (gemmtune.ops, gemmtune)."""
    return {e.name: e.fn for e in public_ops()}


def aiter_exports() -> dict[str, Callable]:
    """{aiter's name: function} for gemmtune.tuned_gemm."""
    return {alias: e.fn for e in public_ops() for alias in e.aiter_names}


def gemm_custom_ops() -> frozenset[str]:
    """The gemmtune:: custom ops that run a GEMM family (what a profiler trace shows for them)."""
    return frozenset(e.custom_op for e in public_ops() if e.is_gemm_op)
