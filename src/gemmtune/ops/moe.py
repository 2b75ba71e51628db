"""`gemmtune.fused_moe` and `gemmtune.grouped_gemm`: mixture-of-experts layers on tuned kernels.

fused_moe(hidden (T, H), w1 (E, 2I, H), w2 (E, H, I), topk_weights (T, topk), topk_ids (T, topk))
  out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]
  with gate_e(x) = x @ w1[e, :I].T, up_e(x) = x @ w1[e, I:].T, down_e(h) = h @ w2[e].T: Hugging Face's
  expert layout (gate_up_proj (E, 2I, H), gate rows first; down_proj (E, H, I)), aiter's and vLLM's.
  An ungated w1 (E, I, H) computes act(x @ w1[e].T) instead. Dispatched per MoeKey to the tuned
  solution of the fmoe family (families/fmoe.py), else the default (backends/fmoe/policy.py).
  - doweight_stage1: the routing weight multiplies the activation output (before down) instead of
    the down output: the same result in exact arithmetic, another rounding (aiter's option).
  - expert_map (G,) int: expert parallelism. topk_ids are router ids in [0, G); expert_map gives
    the local expert of each (-1: another rank's, which contributes nothing here).
  - num_shared_experts S: the last S experts of w1/w2 are shared experts every token takes, weight
    1, on top of its topk routed ones (DeepSeek-V3's shared expert fused in).
  - Expert ids out of range: a ValueError naming the first bad id when checked (check_ids: default
    on unless a CUDA graph is being captured or torch.compile traces; the check syncs with the
    host); unchecked, the token's output row is NaN, never a plausible wrong value.

grouped_gemm(input, weights, expert_ids, topk=None) -> (T, topk, N)
  out[t, j] = x_tj @ weights[expert_ids[t, j]], weights (E, K, N) (any strides; weights_transposed
  takes (E, N, K), e.g. nn.Linear-layout experts). x_tj = input[t] when input is (T, K) (each token
  goes to its topk experts), input[t, j] when input is (T, topk, K) (one row per routed copy, e.g.
  the second GEMM of an MoE). expert_ids is (T, topk); a flat (T * topk,) is read as (T, topk) when
  topk is given. topk, when given, must equal expert_ids' second dim (and input's, when 3-D).

Both are CUDA-graph capturable at a fixed token count: sorting by expert happens on the device, no
output size depends on the routing. Under torch.compile they go through `torch.ops.gemmtune.*`.
"""

from __future__ import annotations

import torch

from ..backends.fmoe import stages as bmoe
from ..checks import FLOAT_DTYPES, check_bool, check_choice, check_int, check_tensor
from ..device import triton_on_gpu
from ..dispatch import get_dispatcher
from ..families.fmoe import ACT_TYPES, MoeKey
from ..kernels import fused_moe as kmoe
from ..kernels.moe_align import moe_align
from .hot_path import OpCache, custom_op, public_helper, public_op

FAMILY = "fmoe"
_FLOATS = FLOAT_DTYPES
_INTS = (torch.int32, torch.int64)
_dispatcher = get_dispatcher()
_is_compiling = torch.compiler.is_compiling


def _d(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _should_check(op: str, check_ids: bool | None, t: torch.Tensor) -> bool:
    """Per call (check_ids is no part of the signature): None decides by the mode, else the bool given."""
    if check_ids is None:
        return not (t.is_meta or _is_compiling() or _capturing(t))  # meta: shape inference, no ids to read
    return check_bool(op, "check_ids", check_ids, optional=True) and not t.is_meta


def check_expert_ids(op: str, ids: torch.Tensor, num_routed: int, what: str = "expert id") -> None:
    """ValueError naming the first id outside [0, num_routed) and where it is (syncs with the host)."""
    bad = (ids < 0) | (ids >= num_routed)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"gemmtune.{op}: {what} {int(ids[pos])} at {pos} is out of range [0, {num_routed})")


# ---- fused_moe ------------------------------------------------------------------------------------
def _fused_error(msg: str, hidden, w1, w2) -> ValueError:
    return ValueError(f"gemmtune.fused_moe: {msg} (hidden {_d(hidden)}, w1 {_d(w1)}, w2 {_d(w2)})")


def validate_fused(hidden, w1, w2, topk_weights, topk_ids, activation: str, expert_map, num_shared_experts: int,
                   doweight_stage1: bool = False, check_ids: bool | None = None):  # fmt: skip
    """Raise naming shapes, dtypes and devices for anything fused_moe cannot compute."""
    op = "fused_moe"
    tensors = {"hidden_states": hidden, "w1": w1, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    for name, t in tensors.items():
        check_tensor(op, name, t)
    check_tensor(op, "expert_map", expert_map, optional=True)
    check_int(op, "num_shared_experts", num_shared_experts, lo=None)  # its range depends on w1: below
    check_choice(op, "activation", activation, tuple(ACT_TYPES))
    check_bool(op, "doweight_stage1", doweight_stage1)
    check_bool(op, "check_ids", check_ids, optional=True)
    if hidden.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise _fused_error("hidden_states must be 2-D (tokens, hidden), w1 and w2 3-D (experts, out, in)", hidden,
                           w1, w2)  # fmt: skip
    T, H = hidden.shape
    E, inter = w2.shape[0], w2.shape[2]
    if E < 1:
        raise _fused_error(f"w2 has {E} experts (w2 (experts, hidden, inter)): fused_moe needs at least 1", hidden,
                           w1, w2)  # fmt: skip
    if inter < 1:
        raise _fused_error(f"w2 has inter={inter} (w2 (experts, hidden, inter)): the inter size must be >= 1",
                           hidden, w1, w2)  # fmt: skip
    if w1.shape[0] != E:
        raise _fused_error(f"w1 has {w1.shape[0]} experts, w2 {E}", hidden, w1, w2)
    if w2.shape[1] != H:
        hint = " (w2 looks stored (E, I, H): pass w2.transpose(1, 2))" if w2.shape[2] == H else ""
        raise _fused_error(f"w2 must be (experts, hidden={H}, inter){hint}", hidden, w1, w2)
    if w1.shape[2] != H or w1.shape[1] not in (inter, 2 * inter):
        hint = " (w1 looks stored (E, H, 2I): pass w1.transpose(1, 2))" if w1.shape[1] == H else ""
        want = f"(experts, 2 * inter={2 * inter} or inter={inter}, hidden={H})"
        raise _fused_error(f"w1 must be {want}{hint}", hidden, w1, w2)
    if not (hidden.dtype == w1.dtype == w2.dtype) or hidden.dtype not in _FLOATS:
        raise _fused_error("hidden_states, w1 and w2 must share one dtype of float16/bfloat16/float32", hidden, w1,
                           w2)  # fmt: skip
    if topk_ids.dim() != 2 or topk_ids.dtype not in _INTS:
        raise _fused_error(f"topk_ids must be 2-D (tokens, topk) int32/int64, got {_d(topk_ids)}", hidden, w1, w2)
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise _fused_error(f"topk_weights {_d(topk_weights)} must be floating point with topk_ids' shape "
                           f"{tuple(topk_ids.shape)}", hidden, w1, w2)  # fmt: skip
    if topk_ids.shape[0] != T:
        raise _fused_error(f"topk_ids has {topk_ids.shape[0]} tokens, hidden_states {T}", hidden, w1, w2)
    if not 0 <= num_shared_experts < E:
        raise _fused_error(f"num_shared_experts={num_shared_experts} must be in [0, {E})", hidden, w1, w2)
    if topk_ids.shape[1] < 1 or (expert_map is None and topk_ids.shape[1] > E - num_shared_experts):
        raise _fused_error(f"topk={topk_ids.shape[1]} must be in [1, {E - num_shared_experts}] routed experts",
                           hidden, w1, w2)  # fmt: skip
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in _INTS):
        raise _fused_error(f"expert_map must be 1-D int32/int64 (one local id per router id), got {_d(expert_map)}",
                           hidden, w1, w2)  # fmt: skip
    devs = {t.device for t in (*tensors.values(), *([expert_map] if expert_map is not None else []))}
    if len(devs) != 1:
        raise _fused_error(f"tensors on several devices: {', '.join(sorted(map(str, devs)))}", hidden, w1, w2)


def moe_key(hidden, w1, w2, topk_ids, activation: str, doweight_stage1: bool, expert_map,
            num_shared_experts: int) -> MoeKey:  # fmt: skip
    dt = hidden.dtype
    return MoeKey(hidden.shape[0], hidden.shape[1], w2.shape[2], w1.shape[0], topk_ids.shape[1], ACT_TYPES[activation],
                  dt, dt, dt, "QuantType.No", w1.shape[1] != w2.shape[2], bool(doweight_stage1),
                  0 if expert_map is None else expert_map.shape[0], num_shared_experts)  # fmt: skip


def _check_fused_ids(w1, topk_ids, expert_map, shared: int) -> None:
    local_routed = w1.shape[0] - shared
    check_expert_ids("fused_moe", topk_ids, local_routed if expert_map is None else expert_map.shape[0])
    if expert_map is not None:
        bad = (expert_map < -1) | (expert_map >= local_routed)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"gemmtune.fused_moe: expert_map[{i}] = {int(expert_map[i])} is neither -1 nor a "
                             f"local expert in [0, {local_routed})")  # fmt: skip


def _fused_signature(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                     num_shared_experts, check_ids) -> tuple:  # fmt: skip
    em = None if expert_map is None else (expert_map.shape, expert_map.dtype, expert_map.device)
    return (hidden_states.shape, w1.shape, w2.shape, topk_ids.shape, topk_weights.shape, hidden_states.dtype,
            w1.dtype, w2.dtype, topk_ids.dtype, topk_weights.dtype, hidden_states.device, w1.device, w2.device,
            topk_ids.device, topk_weights.device, activation, doweight_stage1, doweight_stage1.__class__, em,
            num_shared_experts, num_shared_experts.__class__)  # fmt: skip


def _fused_validate(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                    num_shared_experts, check_ids) -> None:  # fmt: skip
    validate_fused(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, num_shared_experts,
                   doweight_stage1, check_ids)  # fmt: skip


def _fused_bind(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                num_shared_experts, check_ids):  # fmt: skip
    key = moe_key(hidden_states, w1, w2, topk_ids, activation, doweight_stage1, expert_map, num_shared_experts)
    if key.token == 0 or hidden_states.is_meta:  # nothing to compute, or shape inference
        run = lambda hidden, *rest: hidden.new_empty((key.token, key.model_dim))  # noqa: E731
    else:
        run = _dispatcher.runner_for(key, hidden_states.device, family=FAMILY)

    def call(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, check_ids):
        if _should_check("fused_moe", check_ids, topk_ids):
            _check_fused_ids(w1, topk_ids, expert_map, num_shared_experts)
        return run(hidden_states, w1, w2, topk_weights, topk_ids, expert_map)

    return call


def _fused_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                num_shared_experts):  # fmt: skip
    validate_fused(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, num_shared_experts,
                   doweight_stage1)  # fmt: skip
    return hidden_states.new_empty(hidden_states.shape)


_fused_cache = OpCache("fused_moe", family=FAMILY, validate=_fused_validate, bind=_fused_bind)


@public_op(_fused_cache)
def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *, doweight_stage1: bool = False,
              expert_map: torch.Tensor | None = None, num_shared_experts: int = 0,
              check_ids: bool | None = None) -> torch.Tensor:  # fmt: skip
    """(T, H) mixture-of-experts output in hidden_states' dtype (see the module doc for the semantics)."""
    if _is_compiling():
        return torch.ops.gemmtune.fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1,
                                            expert_map, num_shared_experts)  # fmt: skip
    try:
        sig = _fused_signature(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                               num_shared_experts, check_ids)  # fmt: skip
        call = _fused_cache.get(sig)
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _fused_cache.reject(hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1, expert_map,
                            num_shared_experts, check_ids)  # fmt: skip
        raise
    if call is None:
        call = _fused_cache.miss(sig, hidden_states, w1, w2, topk_weights, topk_ids, activation, doweight_stage1,
                                 expert_map, num_shared_experts, check_ids)  # fmt: skip
    return call(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, check_ids)


@custom_op(_fused_cache, fake=_fused_fake)
def _fused_moe_op(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, doweight_stage1: bool, expert_map: torch.Tensor | None,
                  num_shared_experts: int) -> torch.Tensor:  # fmt: skip
    # No id check: it syncs with the host, never inside a compiled graph.
    return fused_moe(hidden, w1, w2, topk_weights, topk_ids, activation, doweight_stage1=doweight_stage1,
                     expert_map=expert_map, num_shared_experts=num_shared_experts, check_ids=False)  # fmt: skip


# ---- grouped_gemm ---------------------------------------------------------------------------------
def _grouped_error(msg: str, x, w, ids) -> ValueError:
    return ValueError(f"gemmtune.grouped_gemm: {msg} (input {_d(x)}, weights {_d(w)}, expert_ids {_d(ids)})")


def _check_flat_topk(x, w, ids, topk) -> None:
    """Flat (T * topk,) ids are read as (T, topk): topk must be a positive int dividing their count."""
    check_int("grouped_gemm", "topk", topk, lo=None, optional=True)
    if topk is None or topk < 1 or ids.numel() % topk:
        raise _grouped_error(f"flat expert_ids need topk dividing {ids.numel()} (got topk={topk})", x, w, ids)


def validate_grouped(x, w, ids, topk: int | None, weights_transposed: bool, check_ids: bool | None = None) -> None:
    op = "grouped_gemm"
    for name, t in (("input", x), ("weights", w), ("expert_ids", ids)):
        check_tensor(op, name, t)
    check_int(op, "topk", topk, lo=None, optional=True)  # its range depends on expert_ids: below
    check_bool(op, "weights_transposed", weights_transposed)
    check_bool(op, "check_ids", check_ids, optional=True)
    if x.dim() not in (2, 3) or w.dim() != 3:
        raise _grouped_error("input must be (tokens, K) or (tokens, topk, K), weights 3-D", x, w, ids)
    if ids.dtype not in _INTS or ids.dim() not in (1, 2):
        raise _grouped_error("expert_ids must be (tokens, topk) int32/int64", x, w, ids)
    if ids.dim() == 1:
        _check_flat_topk(x, w, ids, topk)
    elif topk is not None and topk != ids.shape[1]:
        raise _grouped_error(f"topk={topk} does not match expert_ids' {ids.shape[1]} columns", x, w, ids)
    k_top = topk if ids.dim() == 1 else ids.shape[1]
    tokens = ids.numel() // max(1, k_top)
    if x.shape[0] != tokens:
        raise _grouped_error(f"input has {x.shape[0]} tokens, expert_ids {tokens}", x, w, ids)
    if x.dim() == 3 and x.shape[1] != k_top:
        raise _grouped_error(f"input's topk dim {x.shape[1]} does not match topk={k_top}", x, w, ids)
    K = w.shape[2] if weights_transposed else w.shape[1]
    if x.shape[-1] != K:
        other = w.shape[1] if weights_transposed else w.shape[2]
        hint = ""
        if other == x.shape[-1]:
            hint = " (pass weights_transposed=%s)" % (not weights_transposed)
        lay = "(E, N, K)" if weights_transposed else "(E, K, N)"
        raise _grouped_error(f"input's K={x.shape[-1]} does not match the weights' K={K} for layout {lay}{hint}",
                             x, w, ids)  # fmt: skip
    if x.dtype != w.dtype or x.dtype not in _FLOATS:
        raise _grouped_error("input and weights must share one dtype of float16/bfloat16/float32", x, w, ids)
    if len({x.device, w.device, ids.device}) != 1:
        raise _grouped_error("input, weights and expert_ids must be on one device", x, w, ids)


def _grouped_triton(topk: int, num_experts: int):
    def run(x, w_kn, ids, checked: bool):
        T = ids.shape[0]
        r = kmoe.Routing(ids, topk, 0, num_experts, num_experts)
        shape = (T * topk, w_kn.shape[2])
        # Rows of bad ids are never written: unless the ids were checked, they start as NaN.
        c = kmoe._empty(shape, x) if checked else torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
        cfg = grouped_config(T * topk, num_experts)
        a_strides = (x.stride(0), x.stride(1) if x.dim() == 3 else 0)
        blocks = None
        if not cfg.direct:
            blocks = moe_align(kmoe.local_expert_ids(ids, num_experts), num_experts, cfg.block_m)
        kmoe.moe_gemm(cfg, x, a_strides, w_kn, c, r, num_experts, False, "none", None, blocks)
        return c.view(T, topk, -1)

    return run


def grouped_config(slots: int, num_experts: int) -> kmoe.MoeGemmConfig:
    per = slots / max(1, min(slots, num_experts))
    bm = 16 if per <= 16 else 32 if per <= 32 else 64 if per <= 256 else 128
    return kmoe.MoeGemmConfig(2, slots <= 128, bm, 64 if bm < 64 else 128, 128 if bm < 64 else 64, 1,
                              4 if bm < 128 else 8, 3 if bm < 64 else 4)  # fmt: skip


def _grouped_torch(topk: int, num_experts: int, use_grouped_mm: bool):
    def run(x, w_kn, ids, checked: bool):
        T = ids.shape[0]
        flat = kmoe.local_expert_ids(ids, num_experts).reshape(-1)
        rows = x.reshape(T * topk, -1) if x.dim() == 3 else x.repeat_interleave(topk, 0)
        if use_grouped_mm:
            perm, live, offs = bmoe.expert_offsets(flat, num_experts)
            y = torch._grouped_mm(rows[perm], w_kn, offs=offs)
            y = torch.where(live, y, float("nan"))  # rows with a bad id: NaN, never stale memory
            out = torch.empty_like(y).index_copy_(0, perm, y)
        else:
            out = torch.full((T * topk, w_kn.shape[2]), float("nan"), dtype=x.dtype, device=x.device)
            for e in torch.unique(flat[flat >= 0]).tolist():  # eager (host sync)
                sel = (flat == e).nonzero().flatten()
                out[sel] = rows[sel] @ w_kn[e]
        return out.view(T, topk, -1)

    return run


def _grouped_runner(input, weights, topk: int, weights_transposed: bool):
    E = weights.shape[0]
    if triton_on_gpu(input.device):
        return _grouped_triton(topk, E)
    K, N = (weights.shape[2], weights.shape[1]) if weights_transposed else (weights.shape[1], weights.shape[2])
    aligned = all(d * input.dtype.itemsize % 16 == 0 for d in (K, N))  # torch._grouped_mm's stride rule
    return _grouped_torch(topk, E, bmoe.grouped_mm_usable(input.dtype, input.device)
                          and input.dtype == torch.bfloat16 and aligned)  # fmt: skip


def _grouped_signature(input, weights, expert_ids, topk, weights_transposed, check_ids) -> tuple:
    return (input.shape, weights.shape, expert_ids.shape, input.dtype, weights.dtype, expert_ids.dtype,
            input.device, weights.device, expert_ids.device, topk, topk.__class__, weights_transposed,
            weights_transposed.__class__)  # fmt: skip


def _grouped_validate(input, weights, expert_ids, topk, weights_transposed, check_ids) -> None:
    validate_grouped(input, weights, expert_ids, topk, weights_transposed, check_ids)


def _grouped_bind(input, weights, expert_ids, topk, weights_transposed, check_ids):
    flat = expert_ids.dim() == 1  # (T * topk,) ids, read as (T, topk)
    T, k_top = (expert_ids.numel() // topk, topk) if flat else tuple(expert_ids.shape)
    E = weights.shape[0]
    if T == 0 or input.is_meta:  # nothing to compute, or shape inference
        n = weights.shape[1] if weights_transposed else weights.shape[2]
        return lambda input, weights, expert_ids, check_ids: input.new_empty((T, k_top, n))
    run = _grouped_runner(input, weights, k_top, weights_transposed)

    def call(input, weights, expert_ids, check_ids):
        if flat:
            expert_ids = expert_ids.view(-1, k_top)
        checked = _should_check("grouped_gemm", check_ids, expert_ids)
        if checked:
            check_expert_ids("grouped_gemm", expert_ids, E)
        return run(input, weights.transpose(1, 2) if weights_transposed else weights, expert_ids, checked)

    return call


def _grouped_fake(input, weights, expert_ids, topk, weights_transposed):
    if expert_ids.dim() == 1:
        _check_flat_topk(input, weights, expert_ids, topk)
        expert_ids = expert_ids.view(-1, topk)
    validate_grouped(input, weights, expert_ids, topk, weights_transposed)
    n = weights.shape[1] if weights_transposed else weights.shape[2]
    return input.new_empty((expert_ids.shape[0], expert_ids.shape[1], n))


# grouped_gemm is not tuned: its runner is a heuristic choice, cached apart from fused_moe's.
_grouped_cache = OpCache("grouped_gemm", family=FAMILY, cache="fmoe.grouped_gemm", validate=_grouped_validate,
                         bind=_grouped_bind)  # fmt: skip


@public_op(_grouped_cache)
def grouped_gemm(input: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, topk: int | None = None, *,
                 weights_transposed: bool = False, check_ids: bool | None = None) -> torch.Tensor:  # fmt: skip
    """(T, topk, N): each token's rows times its experts' weights (see the module doc)."""
    if _is_compiling():
        return torch.ops.gemmtune.grouped_gemm(input, weights, expert_ids, topk, weights_transposed)
    try:
        call = _grouped_cache.get(sig := _grouped_signature(input, weights, expert_ids, topk, weights_transposed,
                                                            check_ids))  # fmt: skip
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _grouped_cache.reject(input, weights, expert_ids, topk, weights_transposed, check_ids)
        raise
    if call is None:
        call = _grouped_cache.miss(sig, input, weights, expert_ids, topk, weights_transposed, check_ids)
    return call(input, weights, expert_ids, check_ids)


@custom_op(_grouped_cache, fake=_grouped_fake)
def _grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, topk: int | None,
                     weights_transposed: bool) -> torch.Tensor:  # fmt: skip
    # No id check: it syncs with the host, never inside a compiled graph.
    return grouped_gemm(x, w, ids, topk, weights_transposed=weights_transposed, check_ids=False)


@public_helper(family=FAMILY)
def prepare_expert_weights(weights: torch.Tensor) -> torch.Tensor:
    """Experts (E, K, N) re-stored once as (E, N, K) memory, returned as the same (E, K, N) view: the
    layout torch._grouped_mm needs and the Triton kernels read fastest. Pass it to grouped_gemm as is."""
    check_tensor("prepare_expert_weights", "weights", weights)
    if weights.dim() != 3:
        raise ValueError(f"gemmtune.prepare_expert_weights: weights must be (E, K, N), got {_d(weights)}")
    return weights.transpose(1, 2).contiguous().transpose(1, 2)
