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
import zlib

import pytest
import torch

# The interpreter subprocess's cases, as a JSON list of their reprs (all of them when unset).
CASES_ENV = "KERNEL_CASES"


def kernel_results(test_file: str, run_cases, cases, gpu_cases, request=None):
    """run_cases on the GPU, else in the interpreter subprocess. Given the module fixture's `request`, only
    the cases that some selected test of the module takes as a parameter run, so a case in the slow tier
    costs nothing in the default run; the file's `__main__` passes its cases through chosen_cases()."""
    if request is not None:
        cases, gpu_cases = selected_cases(request, cases), selected_cases(request, gpu_cases)
    if torch.cuda.is_available():
        return run_cases(cases + gpu_cases, "cuda")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if request is not None:
        env[CASES_ENV] = json.dumps([repr(c) for c in cases])  # already the selected ones
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def selected_cases(request, cases) -> list:
    """The cases that some selected test of the requesting module takes as a parameter, in their order."""
    wanted = {
        repr(v)
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
        for v in item.callspec.params.values()
    }
    return [c for c in cases if repr(c) in wanted]


def selected_cases_env(request, cases) -> dict:
    """The environment entry that makes chosen_cases() in a subprocess give selected_cases(request, cases)."""
    return {CASES_ENV: json.dumps([repr(c) for c in selected_cases(request, cases)])}


def chosen_cases(cases) -> list:
    """In the interpreter subprocess: the cases kernel_results asked for, in their order."""
    if CASES_ENV not in os.environ:
        return list(cases)
    wanted = set(json.loads(os.environ[CASES_ENV]))
    return [c for c in cases if repr(c) in wanted]


def interpreter_gap() -> str | None:
    """Why this Triton's interpreter cannot run the GEMM kernels' loops here, else None; call it where
    TRITON_INTERPRET is set. Triton 3.6's interpreter turns a loop bound computed from tl.program_id into
    an int through a one-element numpy array, which numpy 2.4 refuses; later Triton runs it."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_from_program_id(out, n):
        count = 0
        for _ in range(tl.program_id(0), n):
            count += 1
        tl.store(out, count)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_from_program_id[(1,)](out, 3)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe is the interpreter's gap
        return (f"Triton {triton.__version__}'s interpreter cannot loop from a program id with numpy "
                f"{numpy.__version__} ({type(exc).__name__}); on a GPU the kernels run natively")  # fmt: skip
    return None if out.item() == 3 else f"the interpreter's probe loop ran {out.item()} times, not 3"


def compare(y, y_ref, y32, shape, dtype, scale: float) -> dict:
    """A kernel output against its same-dtype reference and an fp32 one, errors relative to `scale`."""
    return {
        "shape_ok": tuple(y.shape) == tuple(shape) and y.dtype == dtype,
        "nan": bool(torch.isnan(y).any().item()),
        "vs_ref": (y.float() - y_ref.float()).abs().max().item() / scale,
        "vs_fp32": (y.float() - y32).abs().max().item() / scale,
    }


# Relative error bounds of an 8-bit GEMM against its dequantized fp32 reference, by output dtype: fp32,
# the accumulation order only; fp16 / bf16, the output rounding (unit roundoff 2^-11 / 2^-8).
REL_ERR = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 6e-3}


def quantized_operands(m, n, k, scales, dt, g):
    """8-bit xq [M, K], wq [N, K] and their fp32 scales from random x, w (unit-variance output): scales
    per_tensor, per_token (x per row, w per channel), mixed (one x scale, w per channel) or mixed_w
    (x per row, one w scale)."""
    from gemmtune.quant import quantize as Q

    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    x_rows, w_cols = scales in ("per_token", "mixed_w"), scales in ("per_token", "mixed")
    xq, xs = (Q.quantize_per_token if x_rows else Q.quantize_per_tensor)(x, dt)
    wq, ws = (Q.quantize_per_channel if w_cols else Q.quantize_per_tensor)(w, dt)
    return xq, wq, xs, ws


def quantized_args(seed_key, m, n, k, scales, dt, out, bias: bool, device) -> list:
    """[xq, wq, xs, ws, bias or None] on `device` (quantized_operands, then a bias in `out`), drawn from a
    generator seeded by repr(seed_key)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_key).encode()))
    xq, wq, xs, ws = quantized_operands(m, n, k, scales, dt, g)
    b = torch.randn(n, generator=g).to(out) if bias else None
    return [t.to(device) if t is not None else None for t in (xq, wq, xs, ws, b)]


def assert_bad_operands_raise(entry, who: str) -> None:
    """entry(xq, wq, xs, ws[, bias]), an 8-bit GEMM's checked entry, names what is wrong (after `who`)."""
    xq, wq = torch.zeros(2, 64, dtype=torch.int8), torch.zeros(4, 64, dtype=torch.int8)
    one = torch.ones(1)
    with pytest.raises(ValueError, match=f"{who}: xq"):
        entry(xq, wq[:, :63], one, one)
    with pytest.raises(ValueError, match="8-bit"):
        entry(xq.float(), wq.float(), one, one)
    with pytest.raises(ValueError, match="x_scale"):
        entry(xq, wq, torch.ones(3, 1), one)
    with pytest.raises(ValueError, match="w_scale"):
        entry(xq, wq, one, torch.ones(1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        entry(xq, wq, one, one, torch.zeros(5))


def rel_outcome(y: torch.Tensor, ref: torch.Tensor, shape, dtype) -> dict:
    """An output against its fp32 reference: NaN count, relative (Frobenius) error, shape and dtype ok."""
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    return {"nan": int(torch.isnan(y).sum()), "err": err, "ok": tuple(y.shape) == tuple(shape) and y.dtype == dtype}


def assert_rel_outcome(r: dict, out: str) -> None:
    assert r["nan"] == 0 and r["ok"], r
    assert r["err"] < REL_ERR[out], r


@contextlib.contextmanager
def nan_outputs(module):
    """Make `module._empty` hand out NaN-filled outputs, so an element a kernel skips fails the check."""
    saved = module._empty
    module._empty = lambda shape, like: torch.full(shape, float("nan"), device=like.device, dtype=like.dtype)
    try:
        yield
    finally:
        module._empty = saved


def split_attention_facts(y: torch.Tensor, ref: torch.Tensor, shape: tuple, dtype, mask, counters) -> dict:
    """What the split-KV attention kernels' tests check of one call: output shape and dtype, no NaN left of
    the poisoned output, max error vs the fp32 reference, sequence 0's first query token (which the cases'
    masks let see no key) all zeros, the arrival counters left zero."""
    return {
        "shape": tuple(y.shape) == tuple(shape) and y.dtype == dtype,
        "nan": bool(torch.isnan(y).any()),
        "err": (y.float() - ref).abs().max().item(),
        "blind_row_zero": mask is None or not y[0, 0].any().item(),
        "counters_zero": not counters.any().item(),
    }


SPLIT_ATTENTION_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # max abs error vs fp32


def assert_split_attention_ok(facts: dict, dtype: str) -> None:
    """split_attention_facts of one call: shaped, fully written, counters re-armed, the blind row 0 (not
    NaN), within SPLIT_ATTENTION_TOL of the fp32 reference."""
    assert facts["shape"] and not facts["nan"] and facts["counters_zero"], facts
    assert facts["blind_row_zero"], facts
    assert facts["err"] <= SPLIT_ATTENTION_TOL[dtype], facts


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


def check_every_candidate(be, fam, key, device, prefix: str = "") -> list:
    """Every candidate `be` offers for `key` (named `prefix`...) passes the tuner's check of family
    `fam` (its layout variants included) and replays bit-equal to eager in a CUDA graph. Returns them."""
    from gemmtune.tuner.check import check_runner

    sols = [s for s in be.candidates(key, device) if s.kernel_name.startswith(prefix)]
    be.precompile([(s, key) for s in sols], device, workers=8)  # compile in parallel, then load each
    inputs = fam.make_inputs(key, device, 1, seed=key.M)[0]
    ref = fam.reference(key, inputs)
    for sol in sols:
        run = be.make_runner(sol, key, device)
        verdict = check_runner(run, key, inputs, ref, family=fam)
        assert verdict.ok, (sol.kernel_name, verdict.reason)
        assert_replays_bit_equal(run, inputs, run(*inputs).clone(), sol.kernel_name, replays=2)
    return sols


def check_past_max_rows_and_dispatch(be, fam, key, device, dispatcher, op) -> None:
    """A skinny runner called past MAX_ROWS hands off to the untuned default, and a tuned row of `be`'s
    first candidate runs through `op(*inputs)` (gemmtune's custom op) within the family's threshold."""
    from gemmtune.backends.lib.skinny import MAX_ROWS
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve

    def assert_close(run, k, seed):
        inputs = fam.make_inputs(k, device, 1, seed=seed)[0]
        y, ref = run(*inputs), fam.reference(k, inputs)
        assert ((y.float() - ref).norm() / ref.norm()).item() < fam.error_threshold(key), k

    sol = be.candidates(key, device)[0]
    assert_close(be.make_runner(sol, key, device), key._replace(M=MAX_ROWS + 5), 3)
    ident = identity(device)
    row = TunedRow(ident.gfx, ident.cu_num, key, "skinny", sol.solidx, sol.splitk, 5.0, sol.kernel_name, family=fam)
    dispatcher.set_config(ConfigTable([row], family=fam.name))
    assert resolve(key, device, family=fam.name).solution == sol
    assert_close(op, key, 4)


def skinny_candidate_kinds(be, key, prefix: str) -> set:
    """Check a skinny 8-bit backend's candidates for `key` on the CPU (none run): named `prefix`skinny_...,
    solidx the crc of the name, no reduce-kernel twins, each parsed back from its row and supported, none
    past M=16. Returns the kernel kinds offered."""
    from gemmtune.backends.base import stable_solidx

    cpu = torch.device("cpu")
    sols = be.candidates(key, cpu)
    assert len(sols) >= 8
    for sol in sols:
        assert sol.libtype == "skinny" and sol.kernel_name.startswith(prefix + "skinny_")
        assert sol.solidx == stable_solidx(sol.kernel_name) and not sol.kernel_name.endswith("_rk")
        assert be.solution_from_row(sol.solidx, sol.kernel_name, sol.splitk) == sol
        assert be.supports(sol, key, cpu)
    assert be.candidates(key._replace(M=17), cpu) == []
    return {sol.kernel_name.split("_")[2] for sol in sols}


def sample_candidates(sols, n=6):
    """A blaslt backend's candidates to check on a GPU: the heuristic's first picks, split-K ones, and a
    spread of the rest."""
    split = [s for s in sols if s.splitk > 1][:2]
    spread = sols[3 :: max(1, len(sols) // n)]
    return list({s.kernel_name: s for s in sols[:3] + split + spread}.values())


def assert_tagged_names_round_trip(lt, split_name, name: str, tag: str, bad: tuple, monkeypatch, caplog,
                                   version: int = 130200) -> None:  # fmt: skip
    """A blaslt backend's table names with and without its tag: each parses back to its solution (the tag
    giving another solidx), `bad` names are refused, and a row of another cuBLASLt version falls back."""
    import logging

    from gemmtune.backends.lib import blaslt as bl

    monkeypatch.setattr(bl, "lt_version", lambda: version)
    for n in (name, name + tag):
        sol = lt.solution_from_row(0, f" {n} ", 1)
        assert sol is not None and (sol.libtype, sol.kernel_name) == ("blaslt", n)
        assert sol.solidx == bl.stable_solidx(n) and sol.splitk == 1
        assert split_name(n) == (bl.AlgoSpec.parse(name), n[len(name) :])
    assert lt.solution_from_row(0, name + tag, 1).solidx != lt.solution_from_row(0, name, 1).solidx
    for b in bad:
        assert lt.solution_from_row(0, b, 0) is None, b
    monkeypatch.setattr(bl, "lt_version", lambda: version + 100)
    with caplog.at_level(logging.WARNING, logger=bl.__name__):
        assert lt.solution_from_row(0, name + tag, 1) is None
    assert str(version) in caplog.text and str(version + 100) in caplog.text and "falling back" in caplog.text
