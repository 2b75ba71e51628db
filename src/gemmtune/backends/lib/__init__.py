"""Library machinery the backends of several families share (cuBLASLt, Triton tiles, skinny tiles, 8-bit
tile lists, the blockwise torch._scaled_mm probe). Discovery skips this package: it declares no backends."""
