"""The GEMM key a config row is tuned for, and the dtype spellings aiter's CSVs use."""

from __future__ import annotations

from typing import NamedTuple

import torch

# aiter writes dtypes as str(torch.dtype); accept a few short spellings too.
_DTYPES: dict[str, torch.dtype] = {
    "torch.bfloat16": torch.bfloat16,
    "torch.float16": torch.float16,
    "torch.float32": torch.float32,
    "torch.half": torch.float16,
    "torch.float": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
for _name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "int8", "int32"):
    if hasattr(torch, _name):
        _DTYPES[f"torch.{_name}"] = getattr(torch, _name)
        _DTYPES[_name] = getattr(torch, _name)


def parse_dtype(text: str) -> torch.dtype:
    """'torch.bfloat16' (aiter's spelling) or 'bf16' -> torch.bfloat16; ValueError names the text."""
    try:
        return _DTYPES[text.strip()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} (expected e.g. torch.bfloat16, torch.float16)") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'torch.bfloat16', the spelling aiter writes."""
    return str(dtype)


_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no", ""}


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected True or False, got {text!r}")


class GemmKey(NamedTuple):
    """What a tuned row is for: y[M, N] = x[M, K] @ w[N, K]^T (+ bias)."""

    M: int
    N: int
    K: int
    bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    outdtype: torch.dtype = torch.bfloat16
    scaleAB: bool = False
    bpreshuffle: bool = False

    def shape_family(self) -> tuple:
        """Everything but M: rows of one family answer untuned Ms of that family."""
        return (self.N, self.K, self.bias, self.dtype, self.outdtype, self.scaleAB, self.bpreshuffle)

    def describe(self) -> str:
        b = "+bias" if self.bias else ""
        return f"M={self.M} N={self.N} K={self.K}{b} {dtype_name(self.dtype)}->{dtype_name(self.outdtype)}"
