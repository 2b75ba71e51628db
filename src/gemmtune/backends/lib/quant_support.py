"""What the 8-bit GEMMs of this build take, shared by the quantized and batched 8-bit backends: the
output dtypes, and the fp8 flavour the GPU's tensor cores (and torch._scaled_mm) run."""

from __future__ import annotations

import torch

from ...device import is_rocm
from ...quant import formats

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tensor_core_fp8(dtype: torch.dtype | None) -> bool:
    """Is `dtype` the fp8 flavour this build's GPU GEMMs take (OCP e4m3fn on CUDA, fnuz on ROCm MI300)?"""
    return dtype is not None and dtype == (formats.FP8_FNUZ if is_rocm() else formats.FP8)
