"""The argument checks of every public function: one rule, one message.

A bad value raises TypeError (the wrong kind of value) or ValueError (the right kind, out of range or not
one of the choices), one line naming the function, the argument and the value:

    gemmtune.gemm_bias: transpose_weight must be a bool, got 'no'

Booleans are bool (not 'no', not 0 / 1), integers int (not bool, not 2.0), numbers finite int / float,
choices one of a fixed tuple, lists checked element by element. Each check is a few isinstance tests and
comparisons and returns the value, so it fits a call path; `fn` is the function's name under gemmtune.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence

import torch

# The dtypes the 16-bit GEMM families compute, in and out (8-bit GEMMs are their own families).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SHOWN = 80  # characters of a value's repr in a message


def show(value) -> str:
    """The value as a message shows it: its repr (a tensor's shape and dtype), cut to one short line."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    text = repr(value).replace("\n", " ")
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def bad(fn: str, name: str, expected: str, value, error: type[Exception] = ValueError) -> Exception:
    """The error for argument `name` of gemmtune.`fn`: 'gemmtune.fn: name must be <expected>, got <value>'."""
    return error(f"gemmtune.{fn}: {name} must be {expected}, got {show(value)}")


def _or_none(expected: str, optional: bool) -> str:
    return f"{expected} or None" if optional else expected


def check_bool(fn: str, name: str, value, *, optional: bool = False):
    """True or False (None too when optional)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    raise bad(fn, name, _or_none("a bool", optional), value, TypeError)


def check_int(fn: str, name: str, value, *, lo: int | None = 1, optional: bool = False):
    """An int (never a bool) >= lo (lo None: any int); None too when optional."""
    if optional and value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(fn, name, _or_none("an int", optional), value, TypeError)
    if lo is not None and value < lo:
        raise bad(fn, name, _or_none(f"an int >= {lo}", optional), value)
    return value


def check_number(fn: str, name: str, value, *, lo: float = -math.inf, lo_open: bool = False,
                 optional: bool = False):  # fmt: skip
    """A finite real number (int or float, never a bool or a tensor) >= lo (> lo with lo_open)."""
    if optional and value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise bad(fn, name, _or_none("a number", optional), value, TypeError)
    above = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and above):
        bound = "" if lo == -math.inf else f" {'>' if lo_open else '>='} {lo:g}"
        raise bad(fn, name, _or_none(f"a finite number{bound}", optional), value)
    return value


def check_choice(fn: str, name: str, value, choices: Sequence, *, optional: bool = False):
    """One of `choices` (compared by type and value: True is not 1, 'x' is not b'x')."""
    if optional and value is None:
        return value
    for c in choices:
        if type(value) is type(c) and value == c:
            return value
    listed = ", ".join(c if isinstance(c, str) else repr(c) for c in choices)
    raise bad(fn, name, _or_none(f"one of {listed}", optional), value)


def check_dtype(fn: str, name: str, value, choices: Sequence[torch.dtype] | None = None, *,
                optional: bool = False):  # fmt: skip
    """A torch.dtype (not its name), one of `choices` when given."""
    if optional and value is None:
        return value
    if not isinstance(value, torch.dtype):
        raise bad(fn, name, _or_none("a torch.dtype", optional), value, TypeError)
    if choices is not None and value not in choices:
        names = ", ".join(str(d).removeprefix("torch.") for d in choices)
        raise bad(fn, name, _or_none(f"one of {names}", optional), value)
    return value


def check_tensor(fn: str, name: str, value, *, optional: bool = False):
    """A torch.Tensor (None too when optional); the message names the value's type, not a repr."""
    if isinstance(value, torch.Tensor) or (optional and value is None):
        return value
    raise TypeError(f"gemmtune.{fn}: {name} must be {_or_none('a tensor', optional)}, got {type(value).__name__}")


def check_list(fn: str, name: str, value, check_item: Callable[[str, str, object], object], *,
               optional: bool = False, nonempty: bool = False) -> list | None:  # fmt: skip
    """A list or tuple (never a str) whose items pass `check_item(fn, f"{name}[i]", item)`; a new list."""
    if optional and value is None:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad(fn, name, _or_none("a list", optional), value, TypeError)
    if nonempty and not value:
        raise bad(fn, name, "a non-empty list", value)
    return [check_item(fn, f"{name}[{i}]", item) for i, item in enumerate(value)]


def check_str(fn: str, name: str, value, *, optional: bool = False, nonempty: bool = True):
    """A str (non-empty unless told), None too when optional."""
    if optional and value is None:
        return value
    if not isinstance(value, str):
        raise bad(fn, name, _or_none("a str", optional), value, TypeError)
    if nonempty and not value.strip():
        raise bad(fn, name, "a non-empty str", value)
    return value


def check_path(fn: str, name: str, value, *, optional: bool = False):
    """A file name: a non-empty str or os.PathLike, returned as a str."""
    if optional and value is None:
        return value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise bad(fn, name, _or_none("a path (str or os.PathLike)", optional), value, TypeError)
    if not value.strip():
        raise bad(fn, name, "a non-empty path", value)
    return value


def check_paths(fn: str, name: str, value) -> list[str] | str:
    """One path (a str may be ':'-separated, as the GEMMTUNE_CONFIG variables are) or a list of paths."""
    if isinstance(value, (list, tuple)):
        return check_list(fn, name, value, check_path)
    if not isinstance(value, (str, os.PathLike)):
        raise bad(fn, name, "a path (str or os.PathLike) or a list of paths", value, TypeError)
    return check_path(fn, name, value)


def check_callable(fn: str, name: str, value):
    if callable(value):
        return value
    raise bad(fn, name, "callable", value, TypeError)
