"""The fmoe family's backends (families/fmoe.py): one module per library, stages.py the plumbing they share,
policy.py its untuned default."""
