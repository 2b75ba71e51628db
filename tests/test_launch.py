"""kernels/launch.py: a BoundLaunch repeats its kernel on new tensors (through the compiled kernel's own
launcher on a GPU, through JITFunction under the interpreter), binds again when a tensor's alignment
changes, and leaves launches to JITFunction while a launch hook is set. On a GPU the elementwise
wrappers that keep their launches this way give their references' results on a second call of one
signature (the first call binds, the second runs the kept launch).

Without a GPU the cases run under the Triton interpreter in a subprocess (kernel_cases.py).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from kernel_cases import kernel_results

from gemmtune.kernels import launch as L

HAS_GPU = torch.cuda.is_available()

if L.HAS_TRITON:
    from gemmtune.kernels._common import tl, triton

    @triton.jit
    def _axpb(X, Y, a, b, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * a + b, mask=offs < n)


N, A, B = 1000, 2.5, 3


def _poisoned(device):
    return torch.full((N,), float("nan"), device=device)


def _err(x, y) -> float:
    return (y - (x * A + B)).abs().max().item()


def run_cases(device: str) -> dict:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(N, generator=g).to(device) for _ in range(3)]
    out = {}
    y = _poisoned(device)
    bound = L.bind(_axpb, (triton.cdiv(N, 128),), xs[0], y, A, B, N, BLOCK=128)
    out["first"] = _err(xs[0], y)
    aligned = bound.facts
    y = _poisoned(device)
    bound(xs[1], y)
    out["second"], out["direct"] = _err(xs[1], y), bound.direct is not None
    # A view one float in: 4-byte aligned, a pointer Triton specializes otherwise.
    odd = torch.randn(N + 1, generator=g).to(device)[1:]
    y = _poisoned(device)
    bound(odd, y)
    out["misaligned"], out["rebound"] = _err(odd, y), bound.facts != aligned
    y = _poisoned(device)
    bound(xs[2], y)
    out["aligned_again"] = _err(xs[2], y)
    plans = L.Plans()
    for i in (0, 1):
        y = _poisoned(device)
        L.cached_launch(plans, "sig", _axpb, (triton.cdiv(N, 128),), xs[i], y, A, B, N, BLOCK=128)
        out[f"plans_{i}"] = _err(xs[i], y)
    out["plans_kept"] = len(plans)
    return out


@pytest.fixture(scope="module")
def results():
    return kernel_results(__file__, lambda cases, device: run_cases(device), [], [])


def test_a_bound_launch_repeats_on_new_tensors(results):
    for case in ("first", "second", "misaligned", "aligned_again", "plans_0", "plans_1"):
        assert results[case] <= 1e-6, (case, results)
    assert results["rebound"] and results["plans_kept"] == 1
    assert results["direct"] == HAS_GPU  # the compiled kernel's launcher on a GPU, JITFunction interpreted


def test_plans_start_over_when_full(monkeypatch):
    monkeypatch.setattr(L, "PLANS_MAX", 3)
    plans = L.Plans()
    for i in range(3):
        plans.put(i, i)
    assert len(plans) == 3
    plans.put("new", 1)
    assert list(plans) == ["new"]


@pytest.mark.skipif(not L.HAS_TRITON, reason="triton is not installed")
def test_a_tensor_keyword_argument_is_refused():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="pass tensors positionally"):
        L.bind(_axpb, (1,), x, Y=x, a=1.0, b=0, n=4, BLOCK=4)


# ---- GPU ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _launch_hook(seen: list):
    """A launch-enter hook recording each launch, as a profiler sets one (a HookChain on newer Tritons)."""
    from triton import knobs

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        yield
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = None


@pytest.mark.gpu
def test_a_set_launch_hook_sends_launches_through_jitfunction(gpu):
    x, y = torch.randn(N, device=gpu), _poisoned(gpu)
    bound = L.bind(_axpb, (triton.cdiv(N, 128),), x, y, A, B, N, BLOCK=128)
    assert bound.direct is not None
    seen = []
    with _launch_hook(seen):
        y = _poisoned(gpu)
        bound(x, y)
        torch.cuda.synchronize()
    assert seen and _err(x, y) <= 1e-6


def _wrapper_calls(device):
    """(name, call(seed) -> output(s), reference(seed) -> output(s)) of every wrapper that keeps its launches."""
    from gemmtune.kernels import activations, norms, qk_norm_rope, quant, quant_producers, rope

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn

    def t(seed, *shape, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g) * scale).to(device, bf16)

    w = t(99, 960, scale=0.1) + 1
    cos, sin = t(5, 1, 7, 64).cos(), t(6, 1, 7, 64).sin()
    wq, wk = t(7, 64) + 1, t(8, 64) + 1

    def qkv(s):
        return t(s, 1, 7, 4, 64), t(s + 1, 1, 7, 2, 64)

    return [
        ("rmsnorm_quant", lambda s: quant_producers.rmsnorm_quant(t(s, 3, 5, 960), w, 1e-6, fp8, impl="triton"),
         lambda s: quant_producers.rmsnorm_quant(t(s, 3, 5, 960), w, 1e-6, fp8, impl="ref")),
        ("add_rmsnorm_quant", lambda s: quant_producers.add_rmsnorm_quant(t(s, 15, 960), t(s + 1, 15, 960), w, 1e-6,
                                                                          fp8, "1x128", impl="triton"),
         lambda s: quant_producers.add_rmsnorm_quant(t(s, 15, 960), t(s + 1, 15, 960), w, 1e-6, fp8, "1x128",
                                                     impl="ref")),
        ("act_mul_quant", lambda s: quant_producers.act_mul_quant(t(s, 9, 2 * 700), "silu", fp8, impl="triton"),
         lambda s: quant_producers.act_mul_quant(t(s, 9, 2 * 700), "silu", fp8, impl="ref")),
        ("quantize_per_token", lambda s: quant.quantize_per_token_triton(t(s, 9, 700), fp8),
         lambda s: quant.quantize_per_token(t(s, 9, 700), fp8)),
        ("rmsnorm", lambda s: norms.rmsnorm(t(s, 9, 960), w, 1e-6, impl="triton"),
         lambda s: norms.rmsnorm(t(s, 9, 960), w, 1e-6, impl="ref")),
        ("act_mul", lambda s: activations.act_mul(t(s, 9, 2 * 700), "silu", impl="triton"),
         lambda s: activations.act_mul(t(s, 9, 2 * 700), "silu", impl="ref")),
        ("rope", lambda s: rope.rope(*qkv(s), cos, sin, impl="triton"),
         lambda s: rope.rope(*qkv(s), cos, sin, impl="ref")),
        ("qk_norm_rope", lambda s: qk_norm_rope.qk_norm_rope(*qkv(s), wq, wk, cos, sin, 1e-6, 1e-6, impl="triton"),
         lambda s: qk_norm_rope.qk_norm_rope(*qkv(s), wq, wk, cos, sin, 1e-6, 1e-6, impl="ref")),
    ]  # fmt: skip


def _as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(8))
def test_a_wrapper_second_call_runs_the_kept_launch_and_matches_its_reference(gpu, case):
    name, call, ref = _wrapper_calls(gpu)[case]
    call(1)  # binds
    kept = _as_list(call(2))  # the kept launch, on other values of one signature
    seen = []
    with _launch_hook(seen):
        through_jit = _as_list(call(2))
    want = _as_list(ref(2))
    assert seen, name
    assert len(kept) == len(through_jit) == len(want), name
    for k, j, r in zip(kept, through_jit, want, strict=True):
        assert torch.equal(k.float(), j.float()), name  # exactly what JITFunction runs
        assert k.shape == r.shape and k.dtype == r.dtype, name
        diff = (k.float() - r.float()).abs().max().item()
        # fp8: a step of e4m3 (2^-3 relative) where a rounding tie breaks the other way; 16-bit: one bf16 step
        tol = (0.07 if k.dtype == torch.float8_e4m3fn else 2**-7) * r.float().abs().max().item()
        assert diff <= tol, (name, diff)


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases("cpu")))
