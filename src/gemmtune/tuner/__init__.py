"""Tuner: shape sources, timing, correctness checks, search, result writing."""
