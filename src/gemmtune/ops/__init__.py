"""Public GEMM ops, one module per family (and the softcapped attention op).

Each op module declares its public functions in ops/registry.py as it is imported (ops/hot_path.py's
public_op, spelling_of, public_helper); this package imports every module of its folder, so a new op
module joins by being there, and exports what they declared.
"""

import importlib
import pkgutil

from . import gemm as _gemm_module
from .registry import exports as _exports

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # each op module declares itself on import

# gemm's key and validation, kept under the package for the callers of gemmtune.ops.key_of / validate
key_of, validate = _gemm_module.key_of, _gemm_module.validate
globals().update(_exports())  # gemmtune.ops.gemm is the op, as gemmtune.gemm is

__all__ = sorted([*_exports(), "key_of", "validate"])
