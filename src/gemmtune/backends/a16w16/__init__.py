"""The a16w16 family's backends (families/a16w16.py): one module per library, policy.py its untuned default."""
