"""What a CSV is before it is read as a table: a tuned table, a shape list (aiter's untuned CSV), or one
of aiter's other CSVs that is no GEMM table at all (each named, so the error says where it belongs)."""

from __future__ import annotations

import os

from ..errors import ConfigError

# Columns only a tuned table has: a file with none of them is a shape list.
TUNED_ONLY = frozenset({"us", "libtype", "kernelName", "solidx", "kernelId", "us1", "kernelName1"})
_SOLUTION = frozenset({"gfx", "cu_num", "libtype", "kernelName", "kernelId", "solidx"})


class NotATable(ConfigError):
    """The file is readable but is not a tuned table of the family asked for (a folder skips it)."""


def _asm_list(cols: set[str], base: str) -> bool:
    return {"M", "N", "K", "splitK", "us"} <= cols and not (_SOLUTION & cols)


def _gdn(cols: set[str], base: str) -> bool:
    return {"Hg", "is_varlen"} <= cols or "chunk_gdn" in base


_FOREIGN = (
    (_asm_list, "aiter's list of its a8w8 assembly kernels (asm_a8w8_gemm.csv: the splitK of each asm kernel "
                "shape, read only by aiter's gemm_a8w8_ASM)"),
    (_gdn, "aiter's table of its gated-delta-net chunk kernel (chunk_gdn_h_opt, AITER_CONFIG_GDN_K5_OPT)"),
)  # fmt: skip


def foreign_kind(header: list[str], path: str) -> str | None:
    """What `path` is when it is one of aiter's non-GEMM CSVs (None: it is not one)."""
    cols, base = set(header), os.path.basename(path).lower()
    return next((what for test, what in _FOREIGN if test(cols, base)), None)


def refuse_foreign(header: list[str], path: str) -> None:
    what = foreign_kind(header, path)
    if what:
        raise NotATable(
            f"{path}: {what}; not a GEMM table or shape list, gemmtune has no use for it (leave it to aiter)"
        )


def is_shape_list(header: list[str]) -> bool:
    return not (TUNED_ONLY & set(header))
