"""The KV-cache update of gemmtune's attention forwards: a transformers StaticLayer (the static cache of
CUDA-graph decode) through kernels/kv_cache.static_write, one launch where its own update makes five
(an arange, two adds on the cache length, two index_copy_); every other cache, offloading caches,
calls under torch.compile (inductor fuses the stock update there) and devices Triton does not run on
take the cache's own update, unchanged."""

from __future__ import annotations

import functools
import weakref

import torch

from ..device import triton_reason
from ..kernels._common import ArrivalCounters
from ..kernels.kv_cache import static_write, write_reason

# StaticLayer -> the counter its writes count their arrivals on (kernels/kv_cache.py)
_ARRIVALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _stock_classes():
    try:
        from transformers.cache_utils import Cache, StaticLayer
    except ImportError:  # a transformers without them: every cache updates itself
        return None, None
    return Cache, StaticLayer


def static_layer(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
    """The cache's StaticLayer for `layer_idx` when static_write can stand in for its update, else None."""
    # Compiling first: dynamo warns about every functools.cache function it traces into.
    if torch.compiler.is_compiling():
        return None
    cache_cls, layer_cls = _stock_classes()
    if layer_cls is None or k.requires_grad or v.requires_grad:
        return None
    if getattr(type(cache), "update", None) is not cache_cls.update or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is not layer_cls or not layer.is_initialized:
        return None
    if not isinstance(layer.cumulative_length, torch.Tensor):
        return None
    if triton_reason(k.device) or write_reason(layer.keys, layer.values, k, v, layer.cumulative_length):
        return None
    return layer


def update(cache, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """cache.update(k, v, layer_idx, **kwargs), in one launch where the layer is a StaticLayer."""
    layer = static_layer(cache, layer_idx, k, v)
    if layer is None:
        return cache.update(k, v, layer_idx, **kwargs)
    arrivals = _ARRIVALS.get(layer)
    if arrivals is None:
        arrivals = _ARRIVALS[layer] = ArrivalCounters()
    static_write(layer.keys, layer.values, k, v, layer.cumulative_length, arrivals.get(1, k.device), check=False)
    return layer.keys, layer.values
