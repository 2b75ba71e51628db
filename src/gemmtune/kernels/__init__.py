"""Triton kernels only (no dispatch logic), each with a plain-PyTorch reference beside it."""
