"""Run a callable or a Python script under torch.profiler and break its time down.

`profile(fn)` calls fn `warmup` times, then `iters` profiled steps, each inside a `gemmtune.step`
range that ends with a device synchronize. `profile_script(argv)` runs a script in this process (as
`python script.py args` would, via runpy): its `with gemmtune.profiling.step():` blocks are the steps,
else the whole run is one.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch

from ..checks import bad, check_bool, check_callable, check_int, check_path
from ..device import default_device
from ..errors import missing_extra
from .breakdown import SCRIPT, STEP, analyze
from .gemms import annotate_gemms
from .report import Profile
from .timeline import build


def _cuda_in_use(device, fn: str) -> bool:
    """Whether `device` (None: the default one) profiles CUDA; a device other than cpu / cuda is refused."""
    if device is None:
        return default_device().type == "cuda"
    named = isinstance(device, (str, torch.device))
    kind = None
    if named:
        with contextlib.suppress(RuntimeError):
            kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise bad(fn, "device", "'cuda', 'cpu', a torch.device of either or None", device,
                  ValueError if named else TypeError)  # fmt: skip
    return kind == "cuda"


def _activities(cuda: bool):
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]


# Kineto writes these to fd 2 at every profiler start and stop, whatever KINETO_LOG_LEVEL says.
_KINETO_CHATTER = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_kineto_chatter():
    """fd 2 held in a temporary file while the profiler starts or stops; what it wrote goes back to
    stderr less Kineto's own start/stop lines."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 to hold: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [ln for ln in held.read().decode(errors="replace").splitlines(True) if not _KINETO_CHATTER.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def _profiling(cuda: bool):
    """torch.profiler over the block (CPU activity, CUDA too when `cuda`), recording shapes."""
    from torch.profiler import profile as tprofile

    prof = tprofile(activities=_activities(cuda), record_shapes=True)
    with _without_kineto_chatter():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_kineto_chatter():
            prof.__exit__(None, None, None)


def _sync(cuda: bool) -> None:
    if cuda and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def step():
    """Mark one step of a script for `gemmtune profile` (a no-op range when nothing profiles)."""
    with torch.profiler.record_function(STEP):
        yield
        if torch.autograd._profiler_enabled() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def profile(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    iters: int = 5,
    device: str | torch.device | None = None,
    hints: dict[str, str] | None = None,
    annotate: bool = True,
    trace: str | None = None,
) -> Profile:
    """Profile `iters` calls of `fn` (after `warmup` unprofiled ones); GPU time by category per call.

    device: "cuda" or "cpu" activity (default: CUDA when available). hints: kernel name -> category
    for kernels without a launch site (see Breakdown.kernel_categories). annotate: name eager
    gemmtune.gemm calls by their key (adds a profiler range, ~1-2 us host time, per call).
    trace: write the chrome trace there.
    """
    check_callable("profile", "fn", fn)
    check_int("profile", "warmup", warmup, lo=0)
    check_int("profile", "iters", iters, lo=1)
    check_bool("profile", "annotate", annotate)
    check_path("profile", "trace", trace, optional=True)
    names = (*hints, *hints.values()) if isinstance(hints, dict) else (None,)
    if hints is not None and not all(isinstance(v, str) for v in names):
        raise bad("profile", "hints", "a dict of kernel name -> category (str -> str) or None", hints, TypeError)
    cuda = _cuda_in_use(device, "profile")
    for _ in range(warmup):
        fn()
    _sync(cuda)
    hook = annotate_gemms() if annotate else contextlib.nullcontext(False)
    with hook as annotated, _profiling(cuda) as prof:
        for _ in range(iters):
            with torch.profiler.record_function(STEP):
                fn()
                _sync(cuda)
    return _finish(prof, hints, trace, annotated)


def _finish(prof, hints, trace, annotated) -> Profile:
    if trace:
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
        prof.export_chrome_trace(trace)
    bd = analyze(build(prof), hints)
    if not annotated:
        bd.notes.append("gemmtune.gemm calls were not annotated: Triton GEMM kernels show without shapes")
    return Profile(bd, trace=trace)


def _script_argv(command: list[str]) -> tuple[str, str, list[str]]:
    """('path'|'module', target, argv) for `python script.py args`, `python -m mod args` or `script.py args`."""
    if not command:
        raise ValueError("profile: no command given (use: gemmtune profile -- python script.py ...)")
    args = list(command)
    exe = os.path.basename(args[0])
    if exe.startswith("python") or os.path.abspath(args[0]) == os.path.abspath(sys.executable):
        args = args[1:]
    if args and args[0] == "-m":
        if len(args) < 2:
            raise ValueError("profile: -m needs a module name")
        return "module", args[1], [args[1], *args[2:]]
    if args and args[0].endswith(".py") and not os.path.isfile(args[0]):
        raise ValueError(f"profile: no such file: {args[0]!r} (in {os.getcwd()})")
    if not args or not args[0].endswith(".py"):
        raise ValueError(
            f"profile runs a Python script in this process: expected `python script.py ...` or "
            f"`python -m module ...`, got {' '.join(command)!r}"
        )
    return "path", args[0], args


def profile_script(command: list[str], *, device=None, trace: str | None = None, annotate: bool = True):
    """Run `python script.py args` (or `python -m module args`) in-process under the profiler.

    Returns (Profile, exit code of the script: 1 if it raised, after printing the traceback). A script
    that fails importing the package of a gemmtune extra (transformers ...) raises MissingExtraError.
    """
    kind, target, argv = _script_argv(command)
    cuda = _cuda_in_use(device, "profile_script")

    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = argv
    if kind == "path":
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    code = 0
    hook = annotate_gemms() if annotate else contextlib.nullcontext(False)
    try:
        with hook as annotated, _profiling(cuda) as prof:
            with torch.profiler.record_function(SCRIPT):
                try:
                    if kind == "path":
                        runpy.run_path(target, run_name="__main__")
                    else:
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except ImportError as exc:
                    missing = missing_extra(exc, "the profiled script")
                    if missing is not None:
                        raise missing from None  # nothing worth profiling ran: say what to install
                    traceback.print_exc()
                    code = 1
                except Exception:  # noqa: BLE001 - the profile of what ran is still written
                    traceback.print_exc()
                    code = 1
                _sync(cuda)
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return _finish(prof, None, trace, annotated), code
