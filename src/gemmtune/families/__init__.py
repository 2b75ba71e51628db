"""The GEMM families: one module each, registered here; detection of a CSV's family from its header.

Detection: a header belongs to every family whose `signature` columns it has and whose `excludes` it
lacks. Several can match one header (aiter's bf16 and a8w8 batched tables share theirs; an `M,N,K`
list fits a16w16 and block-scale alike): the file name's hints settle it (`a8w8_tuned_batched_gemm.csv`),
then the kernel names in the rows, then the most specific family (one whose signature holds another
match's and more: a plugin's `M,N,K,<own column>` is not an a16w16 list), then the family that ranks first
here (builtins in the order below, plugins after them). An env var or `--family` names the family outright
(the header must still fit it).

Plugin families (GEMMTUNE_PLUGINS) are imported before the registry is listed or names a family unknown,
so their tables load in any process, not only in the tuner.
"""

from __future__ import annotations

import os

from ..concurrency import Once
from ..errors import ConfigError
from ..plugins import import_plugins
from .base import Column, Family, Roles

_REGISTRY: dict[str, Family] = {}
_builtins = Once()  # the builtin family modules, registered by the first look-up of any thread


def register(family: Family) -> Family:
    if not family.name:
        raise ValueError(f"family {type(family).__name__} has no name")
    _REGISTRY[family.name] = family
    return family


def _load_builtins() -> None:
    _builtins.run(_register_builtins)


def _register_builtins() -> None:
    from . import a16w16, aiter_moe, batched, epilogue, fmoe, quantized, sparse

    for fam in (
        a16w16.FAMILY,
        batched.FAMILY,
        *quantized.FAMILIES,
        fmoe.FAMILY,
        epilogue.FAMILY,
        sparse.FAMILY,
        *aiter_moe.FAMILIES,
    ):
        _REGISTRY.setdefault(fam.name, fam)


def get(name: str) -> Family:
    """The family called `name` (a plugin's too); ConfigError listing the known ones otherwise."""
    _load_builtins()
    fam = _REGISTRY.get(name)
    if fam is None:
        import_plugins()
        fam = _REGISTRY.get(name)
    if fam is None:
        raise ConfigError(f"unknown GEMM family {name!r} (known: {', '.join(_REGISTRY)})")
    return fam


def all_families() -> list[Family]:
    """Every family: the builtins, then the plugins' (GEMMTUNE_PLUGINS is imported first)."""
    _load_builtins()
    import_plugins()
    return list(_REGISTRY.values())


def normalize(family: Family, header: list[str]) -> list[str]:
    return [family.column_aliases.get(h, h) for h in header]


def fits(family: Family, header: list[str]) -> bool:
    cols = set(normalize(family, header))
    return family.signature <= cols and not (family.excludes & cols)


def detect(header: list[str], path: str = "", kernel_names: list[str] | None = None) -> Family:
    """The family a CSV with `header` belongs to (tuned table or shape list)."""
    matches = [f for f in all_families() if fits(f, header)]
    if not matches:
        cols = set(header)
        near = max(all_families(), key=lambda f: (len(f.signature & cols), -len(f.excludes & cols)))
        missing = sorted(near.signature - cols)
        why = (f"missing column(s) {', '.join(missing)}" if missing
               else f"column(s) {', '.join(sorted(near.excludes & cols))} do not belong")  # fmt: skip
        raise ConfigError(
            f"{path}:1: columns {','.join(header)} fit no GEMM family: {why} for the nearest, {near.name} "
            f"(aiter's columns {','.join(near.tuned_columns)}; other families: "
            + "; ".join(f"{f.name} needs {','.join(sorted(f.signature))}" for f in all_families() if f is not near)
            + ")"
        )
    if len(matches) == 1:
        return matches[0]
    base = os.path.basename(path).lower()
    for hint_len in sorted({len(h) for f in matches for h in f.name_hints}, reverse=True):
        # The longest matching file-name hint wins ("a8w8_blockscale_bpreshuffle" over "blockscale").
        named = [f for f in matches if any(len(h) == hint_len and h.lower() in base for h in f.name_hints)]
        if len(named) == 1:
            return named[0]
    if kernel_names:
        # The family whose kernel-name hints match the most rows (a pre-shuffled block-scale table's
        # kernels also carry the plain block-scale hint, but not on every row).
        score = {f.name: sum(any(h in k for h in f.kernel_hints) for k in kernel_names) for f in matches}
        best = max(matches, key=lambda f: score[f.name])
        if score[best.name]:
            return best
    specific = [f for f in matches if not any(f.signature < g.signature for g in matches)]
    return specific[0]


__all__ = ["Column", "Family", "Roles", "all_families", "detect", "fits", "get", "normalize",
           "register"]  # fmt: skip
