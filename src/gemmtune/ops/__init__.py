"""Public GEMM ops, one module per family (and the softcapped attention op).

Each op module declares its public functions in ops/registry.py as it is imported (ops/hot_path.py's
public_op, spelling_of, public_helper); this package exports what they declared. A new op module joins
by its name in the import line below.
"""

from . import attention, batched, batched_a8w8, epilogue, gemm, moe, quantized, sparse  # noqa: F401 - they declare
from .registry import exports as _exports

# gemm's key and validation, kept under the package for the callers of gemmtune.ops.key_of / validate
key_of, validate = gemm.key_of, gemm.validate
globals().update(_exports())  # gemmtune.ops.gemm is the op, as gemmtune.gemm is

__all__ = sorted([*_exports(), "key_of", "validate"])
