"""`gemmtune profile -o DIR -- python script.py ...`: time by category, top kernels, GEMM table."""

from __future__ import annotations

import os
import sys
import tempfile

import click

from . import _validate as v


def _device(ctx, param, value):
    # A GPU this torch cannot use is refused here; profiling the CPU instead would answer another question.
    return None if value is None else v.device(ctx, param, value).type


@click.command("profile", context_settings={"ignore_unknown_options": True})
@click.option("-o", "--out", "out_dir", default="gemmtune-profile", show_default=True,
              type=click.Path(file_okay=False), callback=v.output_folder,
              help="Folder for profile.json, trace.json, profile.png.")  # fmt: skip
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, callback=_device,
              help="Profile CUDA activity or only the CPU (default: CUDA when available).")  # fmt: skip
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Kernels listed per category.")
@click.option("--no-annotate", is_flag=True, help="Do not name gemmtune.gemm calls by their shape in the trace.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(out_dir, device, top, no_annotate, command) -> None:
    """Run a Python script under torch.profiler, in this process, and report where the time goes.

    GPU time (CPU time without a GPU) by category: GEMM, attention, elementwise/norm, memory copies,
    idle gaps between kernels (launch overhead), other; the top kernels of each; and every GEMM shape
    the run executed with its time share, calls and what the tuned tables in effect run for it.
    The steps measured are the script's `with gemmtune.profiling.step():` blocks, else the whole run.
    Example:

        gemmtune profile -o prof -- python serve_one_batch.py --model ...
    """
    from ..errors import MissingExtraError
    from ..profiling import profile_script
    from ..profiling.report import profile_outputs

    v.outputs_checked(profile_outputs(out_dir), folder=out_dir)  # before the script runs (files.py)
    # The trace goes to a scratch folder first: out_dir only receives a profile worth keeping, atomically.
    with tempfile.TemporaryDirectory(prefix="gemmtune-profile-") as scratch:
        try:
            prof, code = profile_script(list(command), device=device, trace=os.path.join(scratch, "trace.json"),
                                        annotate=not no_annotate)  # fmt: skip
        except MissingExtraError as exc:
            raise v.missing_extra_usage(exc) from None
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        ran = any(i.category != "idle" for i in prof.breakdown.items)
        if code and not ran:  # an empty profile would only chart the host time of a failed start
            click.echo(f"Error: the script exited with status {code} before running any op: no profile written",
                       err=True)  # fmt: skip
            sys.exit(code)
        title = " ".join(command)[-60:]
        if code:
            prof.breakdown.notes.append(f"the script exited with status {code}: this profile covers what ran before")
            title += f" [exited {code}: partial]"
        click.echo(prof.table(top))
        for note in prof.save(out_dir, title=title):
            click.echo(note, err=True)
    sys.exit(code)
