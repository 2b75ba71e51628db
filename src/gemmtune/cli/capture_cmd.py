"""`gemmtune capture -o shapes.csv -- CMD ...`: run CMD with GEMMTUNE_CAPTURE set, then summarize."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from .. import settings
from ..capture import check_capture_targets, read_shape_list
from ..errors import GemmtuneError
from . import _validate as v


@click.command("capture", context_settings={"ignore_unknown_options": True})
@v.output_file_option("-o", "--output", required=True, help="Shapes CSV to write/merge into.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def capture(output: str, command: tuple[str, ...]) -> None:
    """Run COMMAND and record every GEMM shape it dispatches through gemmtune (with call counts).

    The file is aiter's untuned CSV (M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle) plus a count
    column; other GEMM families go beside it (OUTPUT.batched.csv ...). Several runs (or processes)
    merge into the same files. Capture merges only into files it wrote (exactly its columns): a tuned table,
    bench output or a shape list with other columns is refused before COMMAND runs. Example:

        gemmtune capture -o shapes.csv -- python serve.py --model ...
    """
    try:
        check_capture_targets(output)  # before COMMAND runs: a refused file is left as it was
    except GemmtuneError as exc:
        raise click.BadParameter(str(exc), param_hint="'-o' / '--output'") from None
    env = {**os.environ, settings.CAPTURE.name: os.path.abspath(output)}
    try:
        rc = subprocess.call(list(command), env=env)
    except OSError as exc:
        raise _cannot_run(command[0], exc) from None
    written = [p for p in _family_files(output) if os.path.exists(p)]
    for path in written:
        fam, shapes = read_shape_list(path)
        calls = sum(c for _, c in shapes)
        click.echo(f"gemmtune: {len(shapes)} distinct shapes, {calls} calls recorded in {path} ({fam.name})", err=True)
    if not written:
        click.echo(f"gemmtune: no GEMM went through gemmtune; {output} not written. Capture sees only GEMMs "
                   "gemmtune dispatches: gemmtune.optimize(model) routes a transformers model's Linear layers, "
                   "or call gemmtune.gemm", err=True)  # fmt: skip
    sys.exit(shell_exit_status(rc))


def _cannot_run(name: str, exc: OSError) -> click.ClickException:
    """COMMAND could not start: one line, and the status a shell gives (127 not found, 126 not runnable)."""
    found = not isinstance(exc, FileNotFoundError)
    error = click.ClickException(f"cannot run {name}: {exc.strerror}" if found else f"command not found: {name}")
    error.exit_code = 126 if found else 127
    return error


def shell_exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N gives 128 + N (137 for SIGKILL)."""
    return 128 - returncode if returncode < 0 else returncode


def _family_files(output: str) -> list[str]:
    from .. import families
    from ..capture import capture_path

    return [capture_path(output, f) for f in families.all_families()]
