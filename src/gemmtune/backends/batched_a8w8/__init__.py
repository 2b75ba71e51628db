"""The batched_a8w8 family's backends (families/quantized.py): one module per library, policy.py its untuned
default."""
