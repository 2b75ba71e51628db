"""Run a test module's kernel cases on the GPU, or without one under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so the interpreter run happens in a
subprocess that executes the test file itself (its `__main__` block prints the results as JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch


def kernel_results(test_file: str, run_cases, cases, gpu_cases):
    if torch.cuda.is_available():
        return run_cases(cases + gpu_cases, "cuda")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(y, y_ref, y32, shape, dtype, scale: float) -> dict:
    """A kernel output against its same-dtype reference and an fp32 one, errors relative to `scale`."""
    return {
        "shape_ok": tuple(y.shape) == tuple(shape) and y.dtype == dtype,
        "nan": bool(torch.isnan(y).any().item()),
        "vs_ref": (y.float() - y_ref.float()).abs().max().item() / scale,
        "vs_fp32": (y.float() - y32).abs().max().item() / scale,
    }


@contextlib.contextmanager
def nan_outputs(module):
    """Make `module._empty` hand out NaN-filled outputs, so an element a kernel skips fails the check."""
    saved = module._empty
    module._empty = lambda shape, like: torch.full(shape, float("nan"), device=like.device, dtype=like.dtype)
    try:
        yield
    finally:
        module._empty = saved


def assert_replays_bit_equal(run, args, eager: torch.Tensor, name: str, replays: int = 3) -> None:
    """Capture run(*args) in a CUDA graph; every replay into the NaN-filled output must equal `eager`
    bit for bit (split-K arrival counters re-armed, nothing left unwritten)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*args)
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{name}: graph replay differs from eager"
