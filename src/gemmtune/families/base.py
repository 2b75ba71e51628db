"""What a GEMM family is: one member of aiter's GEMM system (its op, key, tuned/untuned CSV schemas, env
var, reference, timing inputs and roofline), so the config store, dispatch, tuner, bench, capture and
show-config are written once against this interface.

A family's key is a NamedTuple with an `M` field (the token dimension the untuned-M rule walks; the
fused-MoE family calls it `token` and sets `m_field`). Its runners are called as `runner(*inputs)`
with one input set made by `make_inputs` (the same tuple the family's op hands its runner).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..checks import bad
from ..errors import NotRunnableError
from ..keys import dtype_name, parse_bool, parse_dtype

Inputs = tuple  # one input set of a family's runner: runner(*inputs) -> output
# Largest accepted ||y - ref|| / ||ref|| by output dtype: ~4x what output rounding alone gives
# (2^-8 for bf16, 2^-11 for fp16); fp32 outputs must carry fp32 accumulation (TF32's ~1e-3 fails).
THRESHOLDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise ValueError("must be a positive integer")
    return v


def nonneg_float(text: str) -> float:
    v = float(text)
    if not v >= 0:  # also rejects NaN
        raise ValueError("must be a number >= 0")
    return v


def fmt_float(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") if v else "0"


# What check_key asks of a field, by its column's parser.
_EXPECTED: dict[Callable, str] = {}


class Column(NamedTuple):
    """A key column: its CSV header, the key field it fills, how to read and write it, its default
    (None: required) when a file lacks the column or leaves it empty."""

    name: str
    field: str
    parse: Callable[[str], Any]
    fmt: Callable[[Any], str] = str
    default: Any = None


def int_col(name: str, field: str | None = None, default: int | None = None) -> Column:
    return Column(name, field or name, positive_int, str, default)


def bool_col(name: str, field: str | None = None, default: bool = False) -> Column:
    return Column(name, field or name, parse_bool, str, default)


def dtype_col(name: str, field: str | None = None, default: torch.dtype | None = torch.bfloat16) -> Column:
    return Column(name, field or name, parse_dtype, dtype_name, default)


# 4-bit (fp4 e2m1 packed two per byte, int4) and MX e8m0 dtypes: aiter's fp4 / int4 MoE tables name
# them for quantized operands only (absent from older torch builds).
_LOW_BIT_NAMES = ("float4_e2m1fn_x2", "int4", "uint4", "float8_e8m0fnu")
LOW_BIT: dict[str, torch.dtype] = {f"torch.{n}": getattr(torch, n) for n in _LOW_BIT_NAMES if hasattr(torch, n)}


def parse_quant_dtype(text: str) -> torch.dtype:
    """A quantized operand's dtype: any parse_dtype spelling, or one of the 4-bit / MX ones."""
    return LOW_BIT.get(text.strip()) or parse_dtype(text)


_EXPECTED.update({positive_int: "an int >= 1", parse_bool: "a bool", parse_dtype: "a torch.dtype",
                  parse_quant_dtype: "a torch.dtype"})  # fmt: skip


def quant_dtype_col(name: str, default: torch.dtype | None = torch.bfloat16) -> Column:
    return Column(name, name, parse_quant_dtype, dtype_name, default)


@dataclass(frozen=True)
class Roles:
    """Header names of the solution and metric columns (aiter spells them differently per table)."""

    libtype: str | None = "libtype"  # None: the table has no libtype column (aiter's own kernels only)
    solidx: str = "solidx"  # 'kernelId' in the quantized / batched tables
    splitk: str = "splitK"
    us: str = "us"
    kernel_name: str = "kernelName"
    err_ratio: str = "err_ratio"  # 'errRatio' in most non-bf16 tables
    tflops: str = "tflops"
    bw: str = "bw"


class Family:
    """Base class; one module per family subclasses it and registers an instance (families/__init__)."""

    name: str = ""  # e.g. "a16w16", "batched"
    description: str = ""
    ops: tuple[str, ...] = ()  # the public op names (aiter's spellings)
    env_var: str = ""  # GEMMTUNE_CONFIG_<NAME>; a16w16 keeps GEMMTUNE_CONFIG
    aiter_tables: tuple[str, ...] = ()  # aiter's file names for this family (detection hint, docs)
    key_type: type = tuple
    key_columns: tuple[Column, ...] = ()
    m_field: str = "M"
    roles: Roles = Roles()
    # Columns a new tuned file of this family gets (aiter's order, gemmtune's extra columns after).
    tuned_columns: tuple[str, ...] = ()
    untuned_columns: tuple[str, ...] = ()
    # Detection: a header belongs here if it has every `signature` column and none of `excludes`.
    signature: frozenset[str] = frozenset()
    excludes: frozenset[str] = frozenset()
    # Substrings of a file name or of kernel names that settle a tie between families with one header.
    name_hints: tuple[str, ...] = ()
    kernel_hints: tuple[str, ...] = ()
    column_aliases: dict[str, str] = {"errRatio": "err_ratio"}  # header spelling -> normalized name
    # Rows of a file without a libtype column name aiter's own kernels by this libtype.
    implied_libtype: str = "aiter"
    # What an untuned key runs is the family's default policy: backends/<group>/policy.py (backends sit
    # above families, and the policy names backends), reached through backends.default().
    # Why the family's op cannot run in this build (None: it can); tables still load either way.
    unrunnable: str | None = None
    # aiter's tables of some families carry no timing (hand-picked kernels): their rows read as overrides.
    us_required: bool = True
    # A table without cu_num (aiter's mxscale table) applies to every CU count of its gfx (cu_num 0).
    cu_num_required: bool = True
    # Two-stage families (fmoe): the tuner times each stage's kernels apart, then the best pairs whole
    # (tuner/stages.py). `stages` numbers them; stage_columns names each one's (us, kernel, err) columns.
    stages: tuple[int, ...] = ()
    stage_columns: dict[int, tuple[str, str, str]] = {}

    # The dtypes the family's op computes, by dtype column: a shape list's row outside them cannot be tuned
    # (a tuned table may still hold one, aiter's fp8 scaleAB rows; it falls back at dispatch).
    computed_dtypes: dict[str, tuple[torch.dtype, ...]] = {}

    # ---- keys ---------------------------------------------------------------------------------
    def untunable(self, key) -> tuple[str, str] | None:
        """(column, why) when the family's op cannot compute `key`'s dtypes, so no tuner run may time it."""
        for c in self.key_columns:
            allowed = self.computed_dtypes.get(c.name)
            value = getattr(key, c.field)
            if allowed is not None and value not in allowed:
                names = ", ".join(dtype_name(d) for d in allowed)
                return c.name, f"{dtype_name(value)} is not a dtype the {self.name} family computes ({names})"
        return None

    def parse_key(self, raw: dict[str, str], parse_column) -> tuple:
        """A key from a record; `parse_column(name, conv, default)` names file:line:column on errors."""
        return self.key_type(**self.parse_columns(parse_column))

    def parse_columns(self, parse_column, skip: frozenset[str] = frozenset()) -> dict:
        """{field: value} of the key columns but `skip`. An `outdtype` column left out or empty takes the
        row's `dtype`, as in aiter's tables (its default only applies when there is no dtype column)."""
        by_name = {c.name: c for c in self.key_columns}
        dtype = parse_column("dtype", by_name["dtype"].parse, by_name["dtype"].default) if "dtype" in by_name else None
        return {c.field: parse_column(c.name, c.parse, dtype if c.name == "outdtype" and dtype else c.default)
                for c in self.key_columns if c.name not in skip}  # fmt: skip

    def check_key(self, key, fn: str) -> None:
        """TypeError / ValueError naming gemmtune.`fn`, the field and its value unless `key` is one this
        family's tables could hold: its key type, each column of the type its CSV column reads back as
        (M an int >= 1, dtype a torch.dtype, bias a bool ...) and a value that column accepts."""
        if not isinstance(key, self.key_type):
            raise bad(fn, "key", f"a {self.key_type.__name__} (family {self.name})", key, TypeError)
        for c in self.key_columns:
            value = getattr(key, c.field)
            try:
                back = c.parse(c.fmt(value))
            except (TypeError, ValueError, AttributeError) as exc:
                raise bad(fn, f"key.{c.field}", _EXPECTED.get(c.parse, f"a valid {c.name}"), value) from exc
            if back.__class__ is not value.__class__:
                expected = _EXPECTED.get(c.parse, f"a {type(back).__name__}")
                raise bad(fn, f"key.{c.field}", expected, value, TypeError)

    def key_record(self, key) -> dict[str, str]:
        """The key's columns as written in a CSV."""
        return {c.name: c.fmt(getattr(key, c.field)) for c in self.key_columns}

    def m_of(self, key) -> int:
        return getattr(key, self.m_field)

    @property
    def range_columns(self) -> tuple[str, str]:
        """Columns of the M range a row was verified on (written by gemmtune's tuner, absent in aiter's)."""
        return (f"{self.m_field}_lo", f"{self.m_field}_hi")

    def table_columns(self) -> tuple[str, ...]:
        """The header of a table gemmtune writes: the family's columns, then the verified M range."""
        return (*self.tuned_columns, *(c for c in self.range_columns if c not in self.tuned_columns))

    def with_m(self, key, m: int):
        return key._replace(**{self.m_field: m})

    def shape_family(self, key) -> tuple:
        """Everything but M: rows with one shape family answer each other's untuned Ms."""
        return tuple(v for f, v in zip(key._fields, key) if f != self.m_field)

    def describe(self, key) -> str:
        """The key as people read it: its own describe() where the key type has one, else its columns."""
        if callable(getattr(key, "describe", None)):
            return key.describe()
        return f"{self.name} " + " ".join(f"{c.name}={c.fmt(getattr(key, c.field))}" for c in self.key_columns)

    def why_not_here(self, key) -> str | None:
        """Why no kernel of this build computes `key` (None: one does); its rows then fall back."""
        return self.unrunnable

    # ---- solution columns ---------------------------------------------------------------------
    def libtype_of(self, raw: dict[str, str]) -> str:
        """The backend a tuned record names: its libtype column, else `implied_libtype`."""
        text = raw.get(self.roles.libtype, "").strip() if self.roles.libtype else ""
        return text or self.implied_libtype

    def kernel_name_of(self, raw: dict[str, str]) -> str:
        """The solution's kernel name as the backend's solution_from_row reads it."""
        return raw.get(self.roles.kernel_name, "").strip()

    def solution_record(self, libtype: str, kernel_name: str) -> dict[str, str]:
        """The solution columns a new row writes (inverse of libtype_of / kernel_name_of)."""
        out = {self.roles.kernel_name: kernel_name}
        if self.roles.libtype:
            out[self.roles.libtype] = libtype
        return out

    # ---- computing ------------------------------------------------------------------------------
    def make_inputs(self, key, device: torch.device, sets: int, seed: int) -> list[Inputs]:
        """`sets` random input sets (fresh tensors each: rotating them keeps the weights cold)."""
        raise NotRunnableError(f"family {self.name} has no runnable op here ({self.unrunnable})")

    def set_bytes(self, key) -> int:
        """Bytes of one input set (to size the rotation past 2x L2)."""
        return self.bytes(key)

    def reference(self, key, inputs: Inputs) -> torch.Tensor:
        """The exact result in fp32 (TF32 off), from the same rounded inputs."""
        raise NotRunnableError(f"family {self.name} has no reference here ({self.unrunnable})")

    def output_shape(self, key) -> tuple[int, ...]:
        raise NotRunnableError(f"family {self.name} computes no output here ({self.unrunnable})")

    def out_dtype(self, key) -> torch.dtype:
        return getattr(key, "outdtype", torch.bfloat16)

    def check_variants(self, key, inputs: Inputs) -> list[tuple[str, Inputs, tuple[int, ...]]]:
        """Other ways the op may call a runner (non-contiguous views ...): (what, inputs, output shape)."""
        return []

    def error_threshold(self, key) -> float:
        """Largest accepted ||y - ref|| / ||ref||."""
        return THRESHOLDS.get(self.out_dtype(key), 1e-2)

    def bytes(self, key) -> int:
        """Bytes the op must move at least (roofline)."""
        raise NotRunnableError(f"family {self.name} has no roofline here ({self.unrunnable})")

    def flops(self, key) -> int:
        raise NotRunnableError(f"family {self.name} has no roofline here ({self.unrunnable})")

    def roof_us(self, key, read_bw: float, matmul_flops: float) -> float:
        """max(compute at the ceiling, bytes at the read bandwidth), microseconds. Families on faster
        tensor-core rates (fp8/int8) scale `matmul_flops` in their override."""
        return max(self.flops(key) / matmul_flops, self.bytes(key) / read_bw) * 1e6

    def throughput(self, key, us: float) -> tuple[float, float]:
        """(TFLOP/s, GB/s) as aiter writes them."""
        if not us > 0:
            return 0.0, 0.0
        return self.flops(key) / (us * 1e6), self.bytes(key) / (us * 1e-6) / 1e9

    # ---- stages (families with `stages` only) -------------------------------------------------------
    def stage_names(self, kernel_name: str) -> tuple[str, ...]:
        """A solution's kernel name split into its stages' names."""
        raise NotImplementedError(f"family {self.name} has no stages")

    def stage_inputs(self, key, stage: int, sets: list[Inputs]) -> list[Inputs]:
        """The input sets a stage's runners take, made from the family's own input sets."""
        raise NotImplementedError(f"family {self.name} has no stages")

    def stage_reference(self, key, stage: int, inputs: Inputs) -> torch.Tensor:
        """fp32 result of one stage on its inputs, as stage_result presents a runner's output."""
        raise NotImplementedError(f"family {self.name} has no stages")

    def stage_output_shape(self, key, stage: int) -> tuple[int, ...]:
        raise NotImplementedError(f"family {self.name} has no stages")

    def stage_result(self, key, stage: int, out, inputs: Inputs) -> torch.Tensor:
        """A stage runner's output as a tensor comparable with stage_reference."""
        return out

    # ---- shape sources --------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<family {self.name}>"


def randn(shape, device, gen, dtype, scale: float = 1.0) -> torch.Tensor:
    """Random data in fp32 rounded to `dtype` (zeros run faster on GPUs: never time them)."""
    t = torch.randn(*shape, device=device, dtype=torch.float32, generator=gen)
    return (t * scale if scale != 1.0 else t).to(dtype)


def generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def inv_sqrt(k: int) -> float:
    return 1.0 / math.sqrt(max(k, 1))
