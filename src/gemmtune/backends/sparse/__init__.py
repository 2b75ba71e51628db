"""The sparse family's backends (families/sparse.py): one module per library, policy.py its untuned default."""
