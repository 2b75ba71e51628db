"""`gemmtune.softcap_attention`: flash attention with logit softcapping, causal / sliding window, GQA.

softcap_attention(query [B, Hq, L, D], key/value [B, Hkv, S, D], scaling, softcap, causal, window, mask)
  -> [B, L, Hq, D] contiguous (transformers' attention output layout), in query's dtype. mask: a
  boolean [B|1, 1, L, >=S] mask (transformers'), ANDed with the causal / window pattern; key blocks it
  hides are skipped.
CUDA tensors run the Triton kernel (kernels/attention_softcap.py), others its fp32 reference. Under
torch.compile the call is the custom op `torch.ops.gemmtune.softcap_attention` (fake impl, nothing
mutated): one opaque node in the graph, no graph break, CUDA-graph capturable (no host sync; the output
is its only allocation). Forward only: there is no backward.
"""

from __future__ import annotations

import torch

from ..checks import check_bool, check_int, check_number, check_tensor
from ..device import triton_on_gpu
from ..kernels import attention_softcap as kattn
from . import registry

_is_compiling = torch.compiler.is_compiling


def _run(q, k, v, mask, scaling: float, softcap: float | None, causal: bool, window: int | None) -> torch.Tensor:
    kw = {"scaling": scaling, "softcap": softcap, "causal": causal, "window": window, "mask": mask}
    if triton_on_gpu(q.device):
        return kattn.softcap_attention(q, k, v, **kw)
    kattn.validate(q, k, v, softcap, causal, window, mask)
    return kattn.softcap_attention_ref(q, k, v, **kw)


def _check_args(query, key, value, scaling, softcap, causal, window, mask) -> None:
    """TypeError/ValueError naming the argument, before any of them is used."""
    op = "softcap_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(op, name, t)
    check_tensor(op, "mask", mask, optional=True)
    check_number(op, "scaling", scaling, lo=0, lo_open=True, optional=True)
    check_number(op, "softcap", softcap, lo=0, lo_open=True, optional=True)
    check_bool(op, "causal", causal)
    check_int(op, "window", window, optional=True)


def softcap_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scaling / softcap) + mask) v as [B, L, Hq, D]; softcap > 0, or
    None: no cap; causal: query i at key position i + S - L; window: keys j > pos_i - window only;
    mask: a boolean [B|1, 1, L, >=S] mask, ANDed with the rest (causal=False: the mask alone)."""
    _check_args(query, key, value, scaling, softcap, causal, window, mask)
    scaling = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    softcap = None if softcap is None else float(softcap)
    if _is_compiling():
        return torch.ops.gemmtune.softcap_attention(query, key, value, mask, scaling, softcap or 0.0, causal,
                                                    window or 0)  # fmt: skip
    return _run(query, key, value, mask, scaling, softcap, causal, window)


# ---- the custom op (torch.compile) ---------------------------------------------------------------
@torch.library.custom_op("gemmtune::softcap_attention", mutates_args=())
def _softcap_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float,
    softcap: float, causal: bool, window: int,
) -> torch.Tensor:  # fmt: skip
    """softcap 0: off; window 0: off (the schema has no optional scalars to keep the graph simple)."""
    return _run(query, key, value, mask, scaling, softcap if softcap > 0 else None, causal,
                window if window > 0 else None)  # fmt: skip


@_softcap_attention_op.register_fake
def _softcap_attention_fake(query, key, value, mask, scaling, softcap, causal, window):
    kattn.validate(query, key, value, softcap if softcap > 0 else None, causal, window if window > 0 else None, mask)
    B, Hq, L, D = query.shape
    return query.new_empty((B, L, Hq, D))


registry.record(softcap_attention, custom_op="gemmtune::softcap_attention", family=None)  # no GEMM: no family
