"""Launching a compiled Triton kernel again without JITFunction's per-call work, and the per-signature plan
caches the elementwise wrappers keep their launches in.

An eager 8-bit prefill issues ~20 small Triton kernels a forward; each went through its wrapper's checks
and launch plan, then JITFunction.run (bind and specialize every argument, look the kernel up): 40-90 us
of host time a call on an H100 host, against 5.5 us for the compiled kernel's own launcher
(benchmarks/experiments/exp_host_per_op.py). That made the model host-bound.

`bind(fn, grid, *args, **kwargs)` launches once through JITFunction (compiling when needed) and returns
a BoundLaunch: the compiled kernel, the grid and every argument but the tensors (and TMA tensor
descriptors, which hold a tensor). Calling it with new ones, in the order they appeared among the
arguments, hands them straight to the kernel's launcher. Triton specializes a pointer on its 16-byte
alignment and dtype (a descriptor on its dtype and block shape), so a BoundLaunch records those and goes
through JITFunction again (rebinding) when a call's differ. The other arguments (ints, floats,
constexprs, grid, launch options) are fixed at bind time: the caller keeps one BoundLaunch per
signature that determines them (`Plans`; `cached_launch` finds or makes it). With launch hooks set (a
profiler such as proton), under the interpreter, or on a Triton whose compiled kernels lack these
attributes, every call goes through JITFunction.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON

PLANS_MAX = 4096  # signatures a Plans keeps before it starts over (a server meeting ever new shapes)
ALIGN = 16  # the pointer alignment Triton specializes on

if HAS_TRITON:
    try:
        from triton import knobs as _knobs
        from triton.runtime.driver import driver as _driver
        from triton.runtime.jit import JITFunction as _JITFunction
    except ImportError:  # an older Triton: every launch goes through JITFunction
        _knobs = _driver = _JITFunction = None
else:
    _knobs = _driver = _JITFunction = None


def _hooks_set() -> bool:
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # None, or an empty HookChain: no hook
            return True
    return False


def _is_slot(arg) -> bool:
    """A tensor, or a TMA descriptor over one: what changes from call to call."""
    return isinstance(arg, torch.Tensor) or isinstance(getattr(arg, "base", None), torch.Tensor)


def _tensor_facts(tensors) -> tuple:
    return tuple(
        (t.dtype, t.data_ptr() % ALIGN == 0) if isinstance(t, torch.Tensor) else (t.base.dtype, tuple(t.block_shape))
        for t in tensors
    )


class BoundLaunch:
    """One kernel launch with everything but its tensors fixed (see the module doc)."""

    __slots__ = ("fn", "grid", "args", "kwargs", "slots", "facts", "direct")

    def __init__(self, fn, grid, args: tuple, kwargs: dict):
        self.fn, self.grid, self.args, self.kwargs = fn, grid, list(args), kwargs
        self.slots = [i for i, a in enumerate(args) if _is_slot(a)]
        self.facts: tuple = ()
        self.direct = None  # (launcher, grid x, y, z, function, packed metadata, every argument, device)
        self._through_jit([args[i] for i in self.slots])

    def _through_jit(self, tensors) -> None:
        args = self.args
        for i, t in zip(self.slots, tensors, strict=True):
            args[i] = t
        compiled = self.fn[self.grid](*args, **self.kwargs)
        for i in self.slots:
            args[i] = None  # hold no tensor between calls
        self.facts = _tensor_facts(tensors)
        self.direct = self._direct_form(compiled)

    def _direct_form(self, compiled):
        if _JITFunction is None or not isinstance(self.fn, _JITFunction) or _hooks_set():
            return None
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return None  # the interpreter, or a Triton whose compiled kernels launch otherwise
        names = self.fn.arg_names
        given = dict(zip(names, self.args, strict=False)) | {k: v for k, v in self.kwargs.items() if k in names}
        full = []
        for name, param in zip(names, self.fn.params, strict=True):
            if name in given:
                value = given[name]
            elif param.has_default:
                value = param.default
            else:
                return None
            full.append(value)
        run = compiled.run  # loads the module and its function handle on first access
        grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
        # JITFunction launches on the current device's stream with the kernel loaded there: so does this
        device = _driver.active.get_current_device()
        return (run, *grid, compiled.function, compiled.packed_metadata, full, device)

    def __call__(self, *tensors: torch.Tensor) -> None:
        direct = self.direct
        if direct is None or _tensor_facts(tensors) != self.facts or _hooks_set():
            self._through_jit(tensors)
            return
        run, gx, gy, gz, function, metadata, full, device = direct
        if _driver.active.get_current_device() != device:  # another current device: its own kernel and stream
            self._through_jit(tensors)
            return
        args = full.copy()
        for i, t in zip(self.slots, tensors, strict=True):  # positional: a slot's place among all arguments
            args[i] = t
        run(gx, gy, gz, _driver.active.get_current_stream(device), function, metadata, None, None, None, *args)


def bind(fn, grid, *args, **kwargs) -> BoundLaunch:
    """Launch fn[grid](*args, **kwargs) now and return the launch to repeat with new tensors (passed
    positionally: a tensor keyword argument would be fixed)."""
    if any(_is_slot(v) for v in kwargs.values()):
        raise TypeError(f"bind({getattr(fn, '__name__', fn)}): pass tensors positionally")
    return BoundLaunch(fn, tuple(grid), args, kwargs)


class Plans(dict):
    """signature -> a wrapper's cached call for it. The signature must determine every non-tensor
    argument of the launches the call makes (shapes, strides, dtypes, device, flags)."""

    def put(self, signature, plan):
        if len(self) >= PLANS_MAX:
            self.clear()
        self[signature] = plan
        return plan


def tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor fixes a launch plan's non-tensor arguments: shape, strides, dtype, device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def cached_launch(plans: Plans, signature, fn, grid, *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs), through the BoundLaunch kept in `plans` under `signature` (made by this
    call when there is none). The signature must determine every argument but the tensors."""
    bound = plans.get(signature)
    if bound is None:
        plans.put(signature, bind(fn, grid, *args, **kwargs))
    else:
        bound(*[args[i] for i in bound.slots])
