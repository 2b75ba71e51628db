"""The GPU test tiers: `-m "gpu and not slow"` is the default tier (under 8 minutes on one H100), a few
representative cases of every sweep; `-m "gpu and slow"` runs the rest of the sweeps, the tuning runs
and the compile-heavy whole-model tests. A parametrized case is slow when any of its parameters is."""

from __future__ import annotations

import pytest


def tiered(values, in_default) -> list:
    """A sweep's values in their order: those `in_default` accepts stay in the default tier, the rest are slow."""
    return [v if in_default(v) else pytest.param(v, marks=pytest.mark.slow) for v in values]


def tiered_at(values, in_default: set) -> list:
    """tiered() by position: the values at the indexes `in_default` stay in the default tier."""
    return [v if i in in_default else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(values)]


# The tiers of a sweep that runs as one interpreter subprocess per tier: the test (or its module fixture,
# parametrized indirectly) hands the tier to the subprocess, which runs that tier's cases only.
SWEEP_TIERS = ["default", pytest.param("slow", marks=pytest.mark.slow)]
