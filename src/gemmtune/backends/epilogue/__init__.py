"""The epilogue family's backends (families/epilogue.py): one module per library, policy.py its untuned default."""
