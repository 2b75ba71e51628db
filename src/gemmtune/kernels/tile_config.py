"""The fields, name and checks that every explicit Triton GEMM tile config shares.

A config's name is the stable id stored in tables:
`<PREFIX>_bm<BM>_bn<BN>_bk<BK>_g<GROUP_M>_w<warps>_s<stages>_sk<split><mode>` followed by the tail of
the subclass's own fields. A subclass sets PREFIX (and MAX_SPLIT_K where a grid dimension bounds it)
and adds only its own fields, their name tail (`name_tail` / TAIL_PATTERN / `tail_fields`) and
their checks (`validate_own`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, TypeVar

_C = TypeVar("_C", bound="GemmTileConfig")

# Groups 1-8: bm, bn, bk, group_m, warps, stages, split_k, sk_mode ('' | 'r' | 'f').
_TILE_PATTERN = r"bm(\d+)_bn(\d+)_bk(\d+)_g(\d+)_w(\d+)_s(\d+)_sk(\d+)([rf]?)"
_TILE_GROUPS = 8


@dataclass(frozen=True)
class GemmTileConfig:
    """One explicit kernel config; `name` is the stable id stored in tables."""

    PREFIX: ClassVar[str] = ""
    TAIL_PATTERN: ClassVar[str] = ""  # regex of the subclass's name tail, its groups read by tail_fields
    MAX_SPLIT_K: ClassVar[int | None] = None

    bm: int
    bn: int
    bk: int
    group_m: int = 8
    warps: int = 4
    stages: int = 3
    split_k: int = 1
    sk_mode: str = ""  # '' when split_k == 1, else 'r' (reduce kernel) or 'f' (in-kernel fixup)

    @property
    def name(self) -> str:
        sk = f"sk{self.split_k}{self.sk_mode}" if self.split_k > 1 else "sk1"
        tiles = f"bm{self.bm}_bn{self.bn}_bk{self.bk}_g{self.group_m}_w{self.warps}_s{self.stages}"
        return f"{self.PREFIX}_{tiles}_{sk}{self.name_tail()}"

    def name_tail(self) -> str:
        return ""

    def smem_bytes(self, elem_bytes: int) -> int:
        """Shared memory of the pipelined operand buffers (the epilogue reuses them)."""
        return self.stages * (self.bm + self.bn) * self.bk * elem_bytes

    def validate(self: _C) -> _C:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0
        if not (pow2(self.bm) and pow2(self.bn) and pow2(self.bk)) or min(self.bm, self.bn, self.bk) < 16:
            raise ValueError(f"{self.name}: block sizes must be powers of two >= 16")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1 or self.group_m < 1:
            raise ValueError(f"{self.name}: bad warps/stages/group")
        if self.split_k < 1 or (self.MAX_SPLIT_K is not None and self.split_k > self.MAX_SPLIT_K):
            raise ValueError(f"{self.name}: split-K must be in 1..{self.MAX_SPLIT_K or ''}")
        if (self.split_k > 1) != (self.sk_mode in ("r", "f")) or self.sk_mode not in ("", "r", "f"):
            raise ValueError(f"{self.name}: split-K > 1 needs mode 'r' or 'f', split-K 1 none")
        self.validate_own()
        return self

    def validate_own(self) -> None:
        """Raise ValueError for a bad value of the subclass's own fields."""

    @classmethod
    def tail_fields(cls, groups: tuple) -> tuple:
        """The subclass's own field values from TAIL_PATTERN's groups."""
        return ()

    @classmethod
    def parse(cls: type[_C], name: str) -> _C | None:
        """The config a kernel name spells, or None when it is not one of ours or not canonical
        ("sk01", "sk1r", "_pdl0" spell a config, but not its name)."""
        name = name.strip()
        m = re.match(rf"^{cls.PREFIX}_{_TILE_PATTERN}{cls.TAIL_PATTERN}$", name)
        if m is None:
            return None
        groups = m.groups()
        try:
            tiles = (*(int(v) for v in groups[: _TILE_GROUPS - 1]), groups[_TILE_GROUPS - 1])
            cfg = cls(*tiles, *cls.tail_fields(groups[_TILE_GROUPS:])).validate()
        except ValueError:
            return None
        return cfg if cfg.name == name else None
