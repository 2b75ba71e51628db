"""How the installed transformers passes the KV cache to a model's forward, and back in its output.

transformers 5.24 renamed `past_key_values` to `cache` (the old name is still accepted, with a
deprecation warning, until its announced removal); every gemmtune caller asks here instead of naming it.
"""

from __future__ import annotations

import inspect

# Every name a stock forward has taken the KV cache under, newest first.
CACHE_ARGS = ("cache", "past_key_values")


def cache_kwarg(model) -> str:
    """The name `type(model).forward` takes the KV cache under."""
    params = inspect.signature(type(model).forward).parameters
    return next((n for n in CACHE_ARGS if n in params), CACHE_ARGS[-1])


def with_cache(model, cache) -> dict:
    """{name: cache} to splat into a forward call of `model`."""
    return {cache_kwarg(model): cache}


def cache_of(out):
    """The KV cache a forward returned (`cache` from 5.24, `past_key_values` before), or None."""
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")


def pop_cache(kwargs: dict, name: str):
    """The KV cache under the stock name, or under the other name a caller may still use."""
    cache = kwargs.pop(name, None)
    for other in CACHE_ARGS:
        if other != name and other in kwargs:
            alias = kwargs.pop(other)
            cache = alias if cache is None else cache
    return cache
