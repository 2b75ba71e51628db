"""How the fused elementwise ops (norms, act*mul, rope) run inside torch.compile, per op.

- "ref": the plain PyTorch formula, which inductor fuses with the ops around it.
- "op":  the Triton kernel as an opaque custom op (`torch.ops.gemmtune.<op>`, fake impl, no mutated
         inputs); launched directly, inductor would trace it as a user Triton kernel and, seeing its
         inline asm (the PDL wait), assume every input is mutated, which blocks fusion around it.
Eager calls always take the Triton kernel on the GPU. GEMMTUNE_COMPILE_OPS sets the modes at import:
"ref", "op", or a default plus overrides ("ref,rope=op"); set_compile_ops() changes them later (a
compiled graph is guarded on the modes it was traced with, so a change recompiles, never mixes).
"""

from __future__ import annotations

import contextlib

from .. import settings

OPS = ("rmsnorm", "add_rmsnorm", "act_mul", "rope")
MODES = ("ref", "op")
# Without GEMMTUNE_COMPILE_OPS. Measure with benchmarks/bench_compile_ops.py before changing one.
DEFAULTS = {"rmsnorm": "ref", "add_rmsnorm": "ref", "act_mul": "ref", "rope": "ref"}


def parse(spec: str) -> dict[str, str]:
    """'' (the defaults) / 'op' / 'ref' / 'ref,rope=op,act_mul=op' -> {op: mode} for every op."""
    out = dict(DEFAULTS)
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, mode = part.rpartition("=")
        if mode not in MODES or (name and name not in OPS):
            raise ValueError(
                f"compile ops {spec!r}: bad part {part!r} (expected 'ref', 'op' or OP=ref|op with OP in "
                f"{', '.join(OPS)})"
            )
        if name:
            out[name] = mode
        else:
            out = dict.fromkeys(OPS, mode)
    return out


_modes: dict[str, str] = parse(settings.COMPILE_OPS.get(check=parse))


def compile_impl(op: str) -> str:
    """The mode of `op` under torch.compile (read while tracing; compiled graphs are guarded on it)."""
    return _modes[op]


def set_compile_ops(spec: str | dict[str, str]) -> dict[str, str]:
    """Set the modes (a spec string or {op: mode}); returns the previous ones."""
    new = parse(spec) if isinstance(spec, str) else {**_modes, **spec}
    bad = {k: v for k, v in new.items() if k not in OPS or v not in MODES}
    if bad:
        raise ValueError(f"compile ops: bad entries {bad} (ops {', '.join(OPS)}; modes {', '.join(MODES)})")
    old = dict(_modes)
    settings.api_called("set_compile_ops")
    _modes.update(new)  # in place: traced code holds this dict
    return old


@contextlib.contextmanager
def compile_ops(spec: str | dict[str, str]):
    """Use `spec` inside the block (for calls of a compiled model; compiles in it trace with it)."""
    old = set_compile_ops(spec)
    try:
        yield
    finally:
        set_compile_ops(old)


def describe() -> str:
    modes = set(_modes.values())
    if len(modes) == 1:
        return next(iter(modes))
    return ",".join(f"{k}={v}" for k, v in _modes.items())
