"""Reading sizes out of a Hugging Face config dict: each bad or missing field is an error naming it."""

from __future__ import annotations

from ..errors import GemmtuneError


class ModelConfigError(GemmtuneError, ValueError):
    """A model config cannot be turned into GEMM shapes (unknown architecture, bad tp, missing field)."""


def count(cfg: dict, name: str, minimum: int) -> int:
    """cfg[name] as an int >= minimum; a negative, fractional or non-numeric size is an error naming it."""
    value = cfg[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelConfigError(
            f"model config: {name}={value!r} must be a {'positive' if minimum > 0 else 'non-negative'} integer "
            f"(model_type {cfg.get('model_type')!r})"
        )
    return value


def required(cfg: dict, *names: str) -> int:
    """The first of `names` the config sets, as a positive integer."""
    for n in names:
        if cfg.get(n) is not None:
            return count(cfg, n, 1)
    raise ModelConfigError(f"model config has no {' / '.join(names)} (model_type {cfg.get('model_type')!r})")


def optional(cfg: dict, name: str, default: int) -> int:
    """An optional size: missing, null or 0 mean `default` (as transformers reads them)."""
    if cfg.get(name) is None:
        return default
    return count(cfg, name, 0) or default


def split(value: int, tp: int, what: str) -> int:
    """value / tp, an error naming `what` when it does not divide."""
    if value % tp:
        raise ModelConfigError(f"{what}={value} is not divisible by tp={tp}")
    return value // tp


def kv_per_rank(kv: int, tp: int, field: str = "num_key_value_heads") -> int:
    """KV heads one rank holds: split when there are at least tp, else replicated (one per rank); `field`
    is the config's name of the KV head count."""
    if kv >= tp:
        return split(kv, tp, field)
    if tp % kv:
        raise ModelConfigError(f"{field}={kv} cannot be replicated over tp={tp} (tp % kv != 0)")
    return 1
