"""The one rule for the files gemmtune reads and writes (docs/files.md).

Reading: only a regular file is read. A FIFO would block forever, /dev/zero never ends, a device or a
folder is no table: each is refused by its type before it is opened, and again on the open file.

Writing (tuned tables, online tables, shape lists, capture files, bench / profile / bench-model reports):
- the file is written where its name leads: through a symlink to the file it names (the link stays);
- a file with other hard links keeps its inode, so every name sees the new text: the text goes to a temp
  file beside it first (a full disk fails there, the file untouched), then over the file in place;
- any other file gets a temp file in its folder renamed onto it: readers see the old text or the new;
- no folder is made; the folder must be writable and the file, if there, a writable regular file;
- an output is never an input of the same command, and never replaces a file of another kind (a bench
  report over a tuned table, a shape list over a capture file): refused naming both, before any work.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

from filelock import FileLock, Timeout

from .. import families
from ..errors import GemmtuneError, OutputFileError, ReadOnlyPathError
from .recognize import TUNED_ONLY, foreign_kind

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SNIFF_BYTES = 1 << 16


def _type_name(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(path: str, error: type[Exception] = OutputFileError, what: str = "a file") -> os.stat_result:
    """The stat of `path`, a regular file (symlinks followed); else `error` naming it and its type."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is {_type_name(st.st_mode)}, not a regular file; expected {what}")
    return st


def open_regular(path: str, error: type[Exception] = OutputFileError, what: str = "a file", mode: str = "r",
                 **kwargs) -> IO:  # fmt: skip
    """`open(path, mode, **kwargs)` (a read mode) of a regular file only: checked by type before the open,
    and on the open file (a FIFO put there in between is opened without blocking, then refused)."""
    check_regular(path, error, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise error(f"{path} is {_type_name(st_mode)}, not a regular file; expected {what}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def target(path: str) -> str:
    """The file `path` names, symlinks resolved: what is written and locked."""
    return os.path.realpath(path)


def writable(path: str) -> bool:
    """May this process create files in folder `path` (or write file `path`)? The one probe every check
    asks, so a test can fake an unwritable folder (root passes os.access whatever the mode bits say)."""
    return os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0))


def same_file(a: str, b: str) -> bool:
    """Do `a` and `b` name one file (the same path, a symlink to it, or another hard link)?"""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return target(a) == target(b)


def _read_only(error: type[Exception]) -> type[Exception]:
    """ReadOnlyPathError where the caller asked for the default error (online tuning tells it apart)."""
    return ReadOnlyPathError if error is OutputFileError else error


def check_writable_folder(path: str, error: type[Exception] = OutputFileError) -> None:
    """`error` naming `path` unless it is a writable folder, or may be made as one inside a writable folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{path!r} is a file; expected a folder")
    probe = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(os.path.normpath(path)))
    if not os.path.isdir(probe):
        raise error(f"{path!r}: folder {probe} does not exist (create it first; gemmtune makes no folders)")
    if not writable(probe):
        raise _read_only(error)(f"{path!r}: folder {probe} is not writable; write elsewhere")


def check_writable(path: str, error: type[Exception] = OutputFileError) -> str:
    """The real file `path` writes (symlinks resolved); `error` naming `path` unless its folder exists and
    is writable (the file and its lock go there) and the file, if there, is a writable regular file."""
    real = target(path)
    folder = os.path.dirname(real)
    via = f" (via the link to {real})" if real != os.path.abspath(path) else ""
    if not os.path.isdir(folder):
        raise error(f"{path}: folder {folder} does not exist{via}; create it first (gemmtune makes no folders)")
    if os.path.lexists(real):
        mode = os.stat(real).st_mode if os.path.exists(real) else 0
        if not stat.S_ISREG(mode):
            raise error(f"{path}{via} is {_type_name(mode)}, not a regular file; write to a file")
        if not writable(real):
            raise _read_only(error)(f"{path}{via}: the file is read-only; make it writable or write elsewhere")
    if not writable(folder):
        raise _read_only(error)(f"{path}: folder {folder} is not writable (the file and its lock file {real}.lock go "
                    "there); write elsewhere")  # fmt: skip
    return real


@dataclass(frozen=True)
class Kind:
    """What an output file is: `mine(path)` says whether an existing file is one (written by its writer)."""

    name: str
    mine: Callable[[str], bool]


def _head(path: str, n: int = _SNIFF_BYTES) -> bytes:
    try:
        with open_regular(path, OSError, mode="rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def head_text(path: str) -> str:
    """The opening of a text file (a BOM dropped), '' when unreadable."""
    return _head(path).decode("utf-8", errors="replace").lstrip("\ufeff")


def first_line(path: str) -> str:
    """The first line of a text file (a BOM dropped), '' when unreadable."""
    text = head_text(path)
    return text.splitlines()[0] if text.strip() else ""


def csv_header(path: str) -> list[str]:
    import csv

    return [h.strip() for h in next(csv.reader([first_line(path)]), [])]


def is_png(path: str) -> bool:
    return _head(path, len(PNG_SIGNATURE)) == PNG_SIGNATURE


def json_object_with(path: str, keys: Iterable[str]) -> bool:
    """Is `path` a JSON object with all of `keys` (a file too large to parse is judged by its text)?"""
    keys = list(keys)
    try:
        size = os.path.getsize(path)
        if size > 64 * _SNIFF_BYTES:
            head = head_text(path).lstrip()
            return head.startswith("{") and all(f'"{k}"' in head for k in keys)
        with open_regular(path, OSError, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in keys)


def table_kind(path: str) -> str | None:
    """'tuned table', 'capture file' or 'shape list' when `path` is one (by its header), else None. A shape
    list has only its family's shape columns (a bench CSV has M, N, K too, and more); capture adds count."""
    header = csv_header(path)
    if not header or foreign_kind(header, path):
        return None
    try:
        fitting = [f for f in families.all_families() if families.fits(f, header)]
    except GemmtuneError:
        return None
    if fitting and TUNED_ONLY & set(header):
        return "tuned table"
    extras = [set(families.normalize(f, header)) - set(f.untuned_columns) for f in fitting]
    if set() in extras:
        return "shape list"
    return "capture file" if {"count"} in extras else None


TUNED_TABLE = Kind("tuned table", lambda p: table_kind(p) == "tuned table")
SHAPE_LIST = Kind("shape list", lambda p: table_kind(p) == "shape list")
PNG = Kind("PNG plot", is_png)


def describe(path: str) -> str:
    """What an existing file is, for a refusal: 'a tuned table', 'a capture file', ... or its first line."""
    if is_png(path):
        return "a PNG image"
    kind = table_kind(path)
    if kind == "tuned table":
        cols = sorted(TUNED_ONLY & set(csv_header(path)))
        return f"a tuned table (it has {', '.join(cols)} columns)"
    if kind:
        return f"a {kind}"
    line = first_line(path)
    return f"a file of another kind (it begins {line[:60]!r})" if line else "a file of another kind"


def check_outputs(outputs: Iterable[tuple[str, Kind | None, str]], inputs: Iterable[str] = (),
                  error: type[Exception] = OutputFileError) -> None:  # fmt: skip
    """check_output for each (path, kind, option) of one command, and no two of them one file."""
    outs, inputs = list(outputs), list(inputs)
    for i, (path, _, option) in enumerate(outs):
        for other, _, other_option in outs[:i]:
            if same_file(path, other):
                lead = f"{option} {path}" if option else path
                raise error(f"{lead} is also {f'{other_option} ' if other_option else ''}{other}: one file cannot "
                            "hold both; write them to two files")  # fmt: skip
    for path, kind, option in outs:
        check_output(path, kind, inputs, option, error)


def check_output(path: str, kind: Kind | None = None, inputs: Iterable[str] = (), option: str = "",
                 error: type[Exception] = OutputFileError) -> str:  # fmt: skip
    """check_writable, and: `path` is none of `inputs` (the same file by any name), and an existing,
    non-empty file there is of `kind`. `option` ('-o', ...) leads the message. Returns the real target."""
    lead = f"{option} {path}" if option else path
    for src in inputs:
        if src and same_file(path, src):
            raise error(f"{lead} is the input {src}: writing there would overwrite it; write elsewhere")
    real = check_writable(path, error)
    if kind is not None and os.path.exists(real) and os.path.getsize(real) > 0 and not kind.mine(real):
        raise error(f"{lead} is {describe(real)}, not a {kind.name}: writing the {kind.name} would overwrite it; "
                    "write elsewhere")  # fmt: skip
    return real


def replace_file(path: str, data: str | bytes, kind: Kind | None = None, inputs: Iterable[str] = (),
                 error: type[Exception] = OutputFileError, encoding: str = "utf-8") -> str:  # fmt: skip
    """Write `data` as the whole content of the file `path` names, under the rule above; returns its path."""
    real = check_output(path, kind, inputs, error=error)
    raw = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=".gemmtune-", suffix=".tmp", dir=os.path.dirname(real))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        st = os.stat(real) if os.path.exists(real) else None
        if st is not None and st.st_nlink > 1:
            # Another name links this inode: a rename would leave it the old text. Write in place.
            with open(real, "r+b") as fh:
                fh.write(raw)
                fh.truncate()
                fh.flush()
                os.fsync(fh.fileno())
            os.unlink(tmp)
        else:
            os.chmod(tmp, st.st_mode & 0o777 if st is not None else 0o644)
            os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return real


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """A matplotlib figure as the PNG at `path`, under the rule (savefig would open `path` itself)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return replace_file(path, buf.getvalue(), PNG)


@contextlib.contextmanager
def locked(path: str, timeout: float = 60.0, error: type[Exception] = OutputFileError) -> Iterator[None]:
    """Hold the lock of the file `path` names (its real path + '.lock', so every symlink to one table takes
    one lock), so read-modify-write cycles of several processes serialize."""
    lock = target(path) + ".lock"
    fl = FileLock(lock, timeout=timeout)
    try:
        fl.acquire()
    except Timeout:
        raise error(f"{path}: lock file {lock} is held by another process for over {timeout:g}s") from None
    except OSError as exc:
        raise _read_only(error)(f"{path}: cannot create its lock file {lock} ({exc.strerror or exc}); the "
                                "folder must be writable") from None  # fmt: skip
    try:
        yield
    finally:
        fl.release()
