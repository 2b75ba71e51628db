"""The batched family's backends (families/batched.py): one module per library, policy.py its untuned default."""
