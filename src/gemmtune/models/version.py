"""Which transformers releases the model toolkit is built and tested against.

optimize() reaches into modeling code (module layouts, forward signatures, the attention and mask
interfaces), which changes between releases; outside the range it refuses with a clear message
instead of patching a layout it has not seen. GEMMTUNE_SKIP_VERSION_CHECK=1 overrides (at your risk).
"""

from __future__ import annotations

import re

from .. import settings

# Exactly what CI tests (.ci/run): the pinned 5.24 (constraints.txt), the minimum 5.17 and the newest
# the registry serves. 5.24 renamed the cache argument (`cache=`); the patched forwards read the stock
# signatures (models/architectures.py). A release past the range is refused until CI has run on it.
MIN_VERSION = (5, 17)
MAX_EXCLUSIVE = (5, 25)
SKIP_ENV = settings.SKIP_VERSION_CHECK.name


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a transformers version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def supported_range() -> str:
    lo, hi = MIN_VERSION, MAX_EXCLUSIVE
    return f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def check_transformers(version: str | None = None) -> str:
    """Return the installed transformers version; raise RuntimeError if it is outside the range."""
    if version is None:
        try:
            import transformers
        except ImportError:
            raise RuntimeError(
                "gemmtune.optimize needs transformers (pip install 'gemmtune[models]'); it is not installed"
            ) from None
        version = transformers.__version__
    if settings.SKIP_VERSION_CHECK.get():
        return version
    v = _parse(version)
    if not (MIN_VERSION <= v < MAX_EXCLUSIVE):
        raise RuntimeError(
            f"gemmtune.optimize supports transformers {supported_range()}, found {version}. "
            f"Install a supported release, or set {SKIP_ENV}=1 to try anyway (module layouts may not match)."
        )
    return version
