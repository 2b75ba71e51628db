"""The quantized families' backends (families/quantized.py: a8w8, a8w8_blockscale and their bpreshuffle
twins): one module per library and kernel kind, policy.py their untuned defaults."""
