"""Click callbacks and types shared by the commands: each bad value is a usage error (exit 2) naming the
option and the value, before anything runs or is written."""

from __future__ import annotations

import math
import os

import click

from ..checks import FLOAT_DTYPES
from ..configs.files import check_writable, check_writable_folder
from ..device import parse_device
from ..errors import GemmtuneError, MissingExtraError, missing_extra
from ..keys import parse_dtype

GEMM_DTYPES = FLOAT_DTYPES


def _folder_must_exist(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise click.BadParameter(
            f"{path!r}: folder {folder} does not exist (create it first; gemmtune makes no folders)"
        )


def output_file(ctx, param, value):
    """A file to write: its folder must exist (nothing creates folders anywhere), and it is no folder."""
    if value is None:
        return None
    if os.path.isdir(value):
        raise click.BadParameter(f"{value!r} is a folder; expected a file name")
    _folder_must_exist(value)
    check_writable(value, click.BadParameter)  # a FIFO, a device, a read-only file or folder (files.py)
    return value


def output_file_option(*names: str, **kwargs):
    """A click option naming a file to write, checked by output_file."""
    return click.option(*names, type=click.Path(dir_okay=False), callback=output_file, **kwargs)


def output_folder(ctx, param, value):
    """A folder to write into: it may be made, but only inside a folder that exists."""
    if value is None:
        return None
    if os.path.exists(value) and not os.path.isdir(value):
        raise click.BadParameter(f"{value!r} is a file; expected a folder")
    _folder_must_exist(os.path.normpath(value))
    check_writable_folder(value, click.BadParameter)
    return value


def outputs_checked(outputs, inputs=(), folder: str | None = None) -> None:
    """files.check_outputs as a usage error (exit 2) naming the option and both paths, before the command
    does any work; outputs inside `folder` need only that it may be made when it does not exist yet."""
    from ..configs.files import check_outputs

    try:
        if folder is not None and not os.path.isdir(folder):
            check_writable_folder(folder)
        else:
            check_outputs(outputs, inputs)
    except GemmtuneError as exc:
        raise click.UsageError(str(exc)) from None


def device(ctx, param, value):
    """cpu / cuda / cuda:N that exists here (None: cuda when available), as a torch.device."""
    try:
        return parse_device(value)
    except GemmtuneError as exc:
        raise click.BadParameter(str(exc)) from None


def gemm_dtype(ctx, param, value):
    """A floating dtype the GEMM families compute (float16, bfloat16, float32), or None."""
    if value is None:
        return None
    try:
        dt = parse_dtype(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if dt not in GEMM_DTYPES:
        raise click.BadParameter(
            f"{value!r}: expected float16, bfloat16 or float32 (8-bit GEMMs are their own families)"
        )
    return dt


class Number(click.ParamType):
    """A finite float in [lo, hi] (or (lo, hi] with lo_open): nan, inf and out-of-range values are refused."""

    name = "number"

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        low_ok = v > self.lo if self.lo_open else v >= self.lo
        if not (math.isfinite(v) and low_ok and v <= self.hi):
            left = "(" if self.lo_open else "["
            hi = "inf)" if self.hi == math.inf else f"{self.hi:g}]"
            self.fail(f"{value!r}: expected a finite number in {left}{self.lo:g}, {hi}", param, ctx)
        return v


def plugins(ctx, param, value):
    """Import each --plugin module now, so a typo is a usage error and not a traceback mid-run."""
    from ..plugins import import_plugin

    for name in value:
        try:
            import_plugin(name, "--plugin")
        except GemmtuneError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def nsets(ctx, param, value):
    """A token-count list (comma list, LO..HI powers of two), checked now; None stays None."""
    if value is None:
        return None
    from ..tuner.model_shapes import parse_nsets

    try:
        return parse_nsets(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def missing_extra_usage(exc: MissingExtraError) -> click.UsageError:
    """A missing optional dependency as a one-line usage error naming the extra to install."""
    return click.UsageError(str(exc))


def require_module(module: str, command: str) -> None:
    """Import `module` (an extra's package) before the command runs, or fail naming the extra."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = missing_extra(exc, command)
        if missing is None:
            raise
        raise missing_extra_usage(missing) from None
