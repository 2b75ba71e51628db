"""Functions installed on one module instance (its `forward` and the like), in a form that pickles.

A bound method (types.MethodType) pickles as getattr(module, function name), which the module's class
lacks, so a torch.save'd optimized model would not load. functools.partial of a module-level function
pickles the function by its qualified name and the module by reference; copy.deepcopy maps that
reference onto the copy, and torch.compile traces it as it traces a method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn


def bind(fn: Callable, mod: nn.Module) -> functools.partial:
    """`fn` with `mod` as its first argument, as `types.MethodType(fn, mod)` would give."""
    return functools.partial(fn, mod)


def bound_function(mod: nn.Module | None, attr: str = "forward") -> Callable | None:
    """The function bind() installed as `mod.<attr>` on the instance, else None."""
    f = getattr(mod, "__dict__", {}).get(attr)
    if isinstance(f, functools.partial) and f.args and f.args[0] is mod:
        return f.func
    return None
