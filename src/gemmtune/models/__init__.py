"""Model toolkit: `gemmtune.optimize(model)` for Hugging Face causal LMs, and `restore(model)`.

Routes nn.Linear through gemmtune.gemm, fuses q/k/v and gate/up into single GEMMs, swaps RMSNorm,
residual-add + RMSNorm and act*mul for fused Triton kernels, and routes attention through
transformers' AttentionInterface (flash -> flex for softcap -> SDPA -> eager). Instances are patched,
not classes.
"""

from .api import optimize, report_of, restore
from .architectures import ARCHITECTURES
from .attention import ENV as ATTENTION_ENV
from .attention import TIERS as ATTENTION_TIERS
from .fp8_checkpoint import Fp8BlockLinear, load_fp8_checkpoint
from .report import OptimizeReport
from .version import check_transformers, supported_range

__all__ = [
    "ATTENTION_ENV",
    "ATTENTION_TIERS",
    "ARCHITECTURES",
    "Fp8BlockLinear",
    "OptimizeReport",
    "check_transformers",
    "load_fp8_checkpoint",
    "optimize",
    "report_of",
    "restore",
    "supported_range",
]
