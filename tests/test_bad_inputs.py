"""Bad-input battery: every public op, environment variable and CLI option refuses a bad value with one clear
error naming the argument (TypeError/ValueError from ops, a click usage error from the CLI), never a traceback
and never silently; and any file a user owns is byte-identical after a refused command.

Deterministic and fast: fixed tensors (no random data), nothing timed, every refused command stops before it
runs anything.
"""

from __future__ import annotations

import pathlib
import re
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune import ops
from gemmtune.cli.main import cli
from gemmtune.dispatch import Dispatcher
from gemmtune.errors import EnvVarError, GemmtuneError, ShapesFileError
from gemmtune.ops import key_of

AITER = pathlib.Path(__file__).resolve().parent / "data" / "aiter-configs"
F32, F16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64
F8 = torch.float8_e4m3fn
META = torch.device("meta")


def t(*shape, dtype=F32, device="cpu"):
    """A deterministic tensor (values never matter for these checks)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).to(dtype=dtype, device=device)


def ids(*shape, hi=1):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) % hi).reshape(shape).to(I64)


# ---- ops ------------------------------------------------------------------------------------------
def _call(fn, base: dict | None = None, **over):
    kw = {**(base or {}), **over}
    return lambda: fn(**kw)


GEMM = dict(x=t(2, 8), w=t(4, 8))
BATCHED = dict(a=t(2, 3, 8), b=t(2, 8, 5))
MOE = dict(hidden_states=t(3, 4), w1=t(2, 8, 4), w2=t(2, 4, 4), topk_weights=t(3, 1), topk_ids=ids(3, 1, hi=2))
GROUPED = dict(input=t(3, 4), weights=t(2, 4, 5), expert_ids=ids(3, 2, hi=2))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # torch's "sparse CSR support is in beta" notice
    CSR = torch.eye(4).to_sparse_csr()
SPARSE = dict(input=t(2, 4), weight=CSR, sparsity_pattern="csr")
A8 = dict(XQ=t(2, 8, dtype=F8), WQ=t(4, 8, dtype=F8), x_scale=t(1), w_scale=t(1))
BLOCK = dict(XQ=t(2, 128, dtype=F8), WQ=t(4, 128, dtype=F8), x_scale=t(2, 1), w_scale=t(1, 1))
ATTN = dict(query=t(1, 2, 3, 4), key=t(1, 2, 3, 4), value=t(1, 2, 3, 4))

OP_CASES = [
    # gemm
    ("gemm x None", _call(ops.gemm, GEMM, x=None), TypeError, r"\bx must be a tensor, got NoneType"),
    ("gemm x list", _call(ops.gemm, GEMM, x=[[1.0] * 8]), TypeError, r"\bx must be a tensor, got list"),
    ("gemm w float", _call(ops.gemm, GEMM, w=2.0), TypeError, r"\bw must be a tensor, got float"),
    ("gemm bias float", _call(ops.gemm, GEMM, bias=1.0), TypeError, r"bias must be a tensor or None"),
    ("gemm w 3-D", _call(ops.gemm, GEMM, w=t(1, 4, 8)), ValueError, r"\bw must be 2-D"),
    ("gemm x 0-D", _call(ops.gemm, GEMM, x=torch.tensor(1.0)), ValueError, r"\bx must have at least 1"),
    ("gemm K mismatch", _call(ops.gemm, GEMM, x=t(2, 7)), ValueError, r"K=7\] does not match w"),
    ("gemm dtype mismatch", _call(ops.gemm, GEMM, w=t(4, 8, dtype=F16)), ValueError, r"x is torch.float32, w is"),
    ("gemm int dtype", _call(ops.gemm, x=t(2, 8, dtype=I32), w=t(4, 8, dtype=I32)), ValueError, r"dtype torch.int32"),
    (
        "gemm float64",
        _call(ops.gemm, x=t(2, 8, dtype=torch.float64), w=t(4, 8, dtype=torch.float64)),
        ValueError,
        r"dtype torch.float64",
    ),
    (
        "gemm out_dtype str",
        _call(ops.gemm, GEMM, out_dtype="bf16"),
        TypeError,
        r"out_dtype must be a torch.dtype .*'bf16'",
    ),
    ("gemm out_dtype int8", _call(ops.gemm, GEMM, out_dtype=torch.int8), ValueError, r"out_dtype torch.int8"),
    ("gemm bias length", _call(ops.gemm, GEMM, bias=t(5)), ValueError, r"bias must be 1-D of length N=4"),
    ("gemm bias 2-D", _call(ops.gemm, GEMM, bias=t(1, 4)), ValueError, r"bias must be 1-D"),
    ("gemm bias dtype", _call(ops.gemm, GEMM, bias=t(4, dtype=F16)), ValueError, r"bias dtype torch.float16"),
    ("gemm device", _call(ops.gemm, GEMM, w=t(4, 8, device=META)), ValueError, r"x on cpu, w on meta"),
    # batched_gemm
    ("batched a list", _call(ops.batched_gemm, BATCHED, a=[1]), TypeError, r"\ba must be a tensor, got list"),
    ("batched b None", _call(ops.batched_gemm, BATCHED, b=None), TypeError, r"\bb must be a tensor, got NoneType"),
    ("batched a 2-D", _call(ops.batched_gemm, BATCHED, a=t(3, 8)), ValueError, r"a and b must be 3-D"),
    ("batched b 4-D", _call(ops.batched_gemm, BATCHED, b=t(1, 2, 8, 5)), ValueError, r"a and b must be 3-D"),
    ("batched batch", _call(ops.batched_gemm, BATCHED, b=t(3, 8, 5)), ValueError, r"batch sizes differ: 2 vs 3"),
    ("batched K", _call(ops.batched_gemm, BATCHED, b=t(2, 7, 5)), ValueError, r"K=8 \(a\) vs K=7 \(b\)"),
    ("batched K transposed", _call(ops.batched_gemm, BATCHED, transpose_b=True), ValueError, r"K=8 \(a\) vs K=5"),
    ("batched dtype", _call(ops.batched_gemm, BATCHED, b=t(2, 8, 5, dtype=F16)), ValueError, r"a is torch.float32"),
    (
        "batched int",
        _call(ops.batched_gemm, a=t(2, 3, 8, dtype=I32), b=t(2, 8, 5, dtype=I32)),
        ValueError,
        r"dtype torch.int32",
    ),
    ("batched out_dtype", _call(ops.batched_gemm, BATCHED, out_dtype="x"), TypeError, r"out_dtype .* got 'x'"),
    (
        "batched transpose_a str",
        _call(ops.batched_gemm, BATCHED, transpose_a="yes"),
        TypeError,
        r"transpose_a must be a bool, got 'yes'",
    ),
    ("batched device", _call(ops.batched_gemm, BATCHED, b=t(2, 8, 5, device=META)), ValueError, r"a on cpu, b on meta"),
    # fused_moe
    *[
        (f"moe {n} None", _call(ops.fused_moe, MOE, **{n: None}), TypeError, rf"{n} must be a tensor, got NoneType")
        for n in MOE
    ],  # fmt: skip
    ("moe activation relu", _call(ops.fused_moe, MOE, activation="relu"), ValueError, r"activation .* got 'relu'"),
    ("moe activation None", _call(ops.fused_moe, MOE, activation=None), ValueError, r"activation .* got None"),
    ("moe hidden 3-D", _call(ops.fused_moe, MOE, hidden_states=t(1, 3, 4)), ValueError, r"hidden_states must be 2-D"),
    ("moe w1 2-D", _call(ops.fused_moe, MOE, w1=t(8, 4)), ValueError, r"w1 and w2 3-D"),
    ("moe w1 experts", _call(ops.fused_moe, MOE, w1=t(3, 8, 4)), ValueError, r"w1 has 3 experts, w2 2"),
    ("moe w2 hidden", _call(ops.fused_moe, MOE, w2=t(2, 5, 4)), ValueError, r"w2 must be \(experts, hidden=4"),
    ("moe w1 inter", _call(ops.fused_moe, MOE, w1=t(2, 6, 4)), ValueError, r"w1 must be \(experts, 2 \* inter"),
    ("moe dtypes", _call(ops.fused_moe, MOE, w2=t(2, 4, 4, dtype=F16)), ValueError, r"hidden_states, w1 and w2 must"),
    ("moe ids float", _call(ops.fused_moe, MOE, topk_ids=t(3, 1)), ValueError, r"topk_ids must be 2-D .* int32"),
    ("moe ids 1-D", _call(ops.fused_moe, MOE, topk_ids=ids(3)), ValueError, r"topk_ids must be 2-D"),
    ("moe weights shape", _call(ops.fused_moe, MOE, topk_weights=t(3, 2)), ValueError, r"topk_weights .* must be"),
    ("moe weights int", _call(ops.fused_moe, MOE, topk_weights=ids(3, 1)), ValueError, r"topk_weights .* floating"),
    (
        "moe tokens",
        _call(ops.fused_moe, MOE, topk_ids=ids(2, 1), topk_weights=t(2, 1)),
        ValueError,
        r"topk_ids has 2 tokens, hidden_states 3",
    ),
    ("moe shared -1", _call(ops.fused_moe, MOE, num_shared_experts=-1), ValueError, r"num_shared_experts=-1"),
    ("moe shared E", _call(ops.fused_moe, MOE, num_shared_experts=2), ValueError, r"num_shared_experts=2"),
    (
        "moe shared str",
        _call(ops.fused_moe, MOE, num_shared_experts="a"),
        TypeError,
        r"num_shared_experts must be an int",
    ),
    (
        "moe topk > E",
        _call(ops.fused_moe, MOE, topk_ids=ids(3, 3, hi=2), topk_weights=t(3, 3)),
        ValueError,
        r"topk=3 must be in \[1, 2\]",
    ),
    ("moe expert_map list", _call(ops.fused_moe, MOE, expert_map=[0, 1]), TypeError, r"expert_map must be a tensor"),
    ("moe expert_map float", _call(ops.fused_moe, MOE, expert_map=t(2)), ValueError, r"expert_map must be 1-D int"),
    ("moe device", _call(ops.fused_moe, MOE, w2=t(2, 4, 4, device=META)), ValueError, r"several devices"),
    (
        "moe id out of range",
        _call(ops.fused_moe, MOE, topk_ids=torch.tensor([[0], [5], [1]])),
        ValueError,
        r"expert id 5 at \(1, 0\) is out of range \[0, 2\)",
    ),
    (
        "moe negative id",
        _call(ops.fused_moe, MOE, topk_ids=torch.tensor([[0], [-1], [1]])),
        ValueError,
        r"expert id -1 at \(1, 0\)",
    ),
    (
        "moe expert_map value",
        _call(ops.fused_moe, MOE, expert_map=torch.tensor([0, 7])),
        ValueError,
        r"expert_map\[1\] = 7",
    ),
    # grouped_gemm
    ("grouped input None", _call(ops.grouped_gemm, GROUPED, input=None), TypeError, r"input must be a tensor"),
    ("grouped weights None", _call(ops.grouped_gemm, GROUPED, weights=None), TypeError, r"weights must be a tensor"),
    (
        "grouped ids list",
        _call(ops.grouped_gemm, GROUPED, expert_ids=[0, 1]),
        TypeError,
        r"expert_ids must be a tensor",
    ),
    ("grouped input 4-D", _call(ops.grouped_gemm, GROUPED, input=t(1, 3, 2, 4)), ValueError, r"input must be \(tokens"),
    ("grouped weights 2-D", _call(ops.grouped_gemm, GROUPED, weights=t(4, 5)), ValueError, r"weights 3-D"),
    ("grouped ids float", _call(ops.grouped_gemm, GROUPED, expert_ids=t(3, 2)), ValueError, r"expert_ids must be"),
    ("grouped ids 3-D", _call(ops.grouped_gemm, GROUPED, expert_ids=ids(3, 2, 1)), ValueError, r"expert_ids must be"),
    (
        "grouped flat no topk",
        _call(ops.grouped_gemm, GROUPED, expert_ids=ids(6)),
        ValueError,
        r"flat expert_ids need topk dividing 6 \(got topk=None\)",
    ),
    (
        "grouped flat topk 4",
        _call(ops.grouped_gemm, GROUPED, expert_ids=ids(6), topk=4),
        ValueError,
        r"flat expert_ids need topk dividing 6 \(got topk=4\)",
    ),
    (
        "grouped flat 5 topk 2",
        _call(ops.grouped_gemm, GROUPED, expert_ids=ids(5), topk=2),
        ValueError,
        r"topk dividing 5 \(got topk=2\)",
    ),
    ("grouped flat topk 0", _call(ops.grouped_gemm, GROUPED, expert_ids=ids(6), topk=0), ValueError, r"topk=0"),
    ("grouped flat topk -2", _call(ops.grouped_gemm, GROUPED, expert_ids=ids(6), topk=-2), ValueError, r"topk=-2"),
    (
        "grouped topk str",
        _call(ops.grouped_gemm, GROUPED, expert_ids=ids(6), topk="2"),
        TypeError,
        r"topk must be an int or None, got '2'",
    ),
    ("grouped topk mismatch", _call(ops.grouped_gemm, GROUPED, topk=3), ValueError, r"topk=3 does not match"),
    ("grouped tokens", _call(ops.grouped_gemm, GROUPED, input=t(4, 4)), ValueError, r"input has 4 tokens"),
    ("grouped 3-D topk", _call(ops.grouped_gemm, GROUPED, input=t(3, 3, 4)), ValueError, r"input's topk dim 3"),
    ("grouped K", _call(ops.grouped_gemm, GROUPED, input=t(3, 6)), ValueError, r"input's K=6 does not match"),
    ("grouped K hint", _call(ops.grouped_gemm, GROUPED, input=t(3, 5)), ValueError, r"weights_transposed=True"),
    ("grouped dtype", _call(ops.grouped_gemm, GROUPED, weights=t(2, 4, 5, dtype=F16)), ValueError, r"one dtype"),
    (
        "grouped transposed str",
        _call(ops.grouped_gemm, GROUPED, weights_transposed="no"),
        TypeError,
        r"weights_transposed must be a bool",
    ),
    ("grouped device", _call(ops.grouped_gemm, GROUPED, weights=t(2, 4, 5, device=META)), ValueError, r"one device"),
    (
        "grouped id range",
        _call(ops.grouped_gemm, GROUPED, expert_ids=torch.tensor([[0, 1], [2, 0], [1, 1]])),
        ValueError,
        r"expert id 2 at \(1, 0\) is out of range \[0, 2\)",
    ),
    # sparse_gemm
    ("sparse input None", _call(ops.sparse_gemm, SPARSE, input=None), TypeError, r"input must be a tensor"),
    ("sparse weight None", _call(ops.sparse_gemm, SPARSE, weight=None), TypeError, r"weight must be a tensor"),
    ("sparse bias int", _call(ops.sparse_gemm, SPARSE, bias=3), TypeError, r"bias must be a tensor or None"),
    (
        "sparse pattern dense",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern="dense"),
        ValueError,
        r"sparsity_pattern must be one of .* got 'dense'",
    ),
    (
        "sparse pattern int",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern=5),
        ValueError,
        r"sparsity_pattern .* got 5",
    ),
    (
        "sparse csr dense weight",
        _call(ops.sparse_gemm, SPARSE, weight=t(4, 4)),
        ValueError,
        r"sparsity_pattern 'csr' needs a torch.sparse_csr weight",
    ),
    (
        "sparse coo csr weight",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern="coo"),
        ValueError,
        r"sparsity_pattern 'coo' needs",
    ),
    (
        "sparse 2:4 csr weight",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern="2:4"),
        ValueError,
        r"sparsity_pattern '2:4' needs a SparseSemiStructuredTensor",
    ),
    (
        "sparse input sparse",
        _call(ops.sparse_gemm, SPARSE, input=t(2, 4).to_sparse()),
        ValueError,
        r"input must be a dense tensor",
    ),
    ("sparse K", _call(ops.sparse_gemm, SPARSE, input=t(2, 5)), ValueError, r"input\[..., K=5\] does not match"),
    ("sparse dtype", _call(ops.sparse_gemm, SPARSE, input=t(2, 4, dtype=F16)), ValueError, r"dtypes must match"),
    ("sparse bias length", _call(ops.sparse_gemm, SPARSE, bias=t(3)), ValueError, r"bias must be a 1-D tensor"),
    ("sparse bias dtype", _call(ops.sparse_gemm, SPARSE, bias=t(4, dtype=F16)), ValueError, r"bias must have"),
    # gemm_a8w8 and its spellings
    *[
        (f"a8w8 {n} None", _call(ops.gemm_a8w8, A8, **{n: None}), TypeError, rf"gemm_a8w8: {n} must be a tensor")
        for n in A8
    ],  # fmt: skip
    ("a8w8 bias list", _call(ops.gemm_a8w8, A8, bias=[1.0]), TypeError, r"bias must be a tensor"),
    ("a8w8 WQ 3-D", _call(ops.gemm_a8w8, A8, WQ=t(1, 4, 8, dtype=F8)), ValueError, r"WQ \[N, K\]"),
    ("a8w8 K", _call(ops.gemm_a8w8, A8, WQ=t(4, 7, dtype=F8)), ValueError, r"K=8 \(XQ\) vs K=7 \(WQ\)"),
    ("a8w8 XQ float", _call(ops.gemm_a8w8, A8, XQ=t(2, 8)), ValueError, r"XQ and WQ must share one 8-bit dtype"),
    ("a8w8 mixed 8-bit", _call(ops.gemm_a8w8, A8, WQ=t(4, 8, dtype=torch.int8)), ValueError, r"XQ and WQ must share"),
    ("a8w8 x_scale f16", _call(ops.gemm_a8w8, A8, x_scale=t(1, dtype=F16)), ValueError, r"x_scale must be float32"),
    ("a8w8 w_scale f16", _call(ops.gemm_a8w8, A8, w_scale=t(1, dtype=F16)), ValueError, r"w_scale must be float32"),
    ("a8w8 dtype", _call(ops.gemm_a8w8, A8, dtype="x"), TypeError, r"dtype must be a torch.dtype, got 'x'"),
    ("a8w8 x_scale shape", _call(ops.gemm_a8w8, A8, x_scale=t(3, 1)), ValueError, r"x_scale must have 1 element"),
    ("a8w8 w_scale shape", _call(ops.gemm_a8w8, A8, w_scale=t(1, 3)), ValueError, r"w_scale must have 1 element"),
    ("a8w8 bias shape", _call(ops.gemm_a8w8, A8, bias=t(3, dtype=torch.bfloat16)), ValueError, r"bias must be \[N=4\]"),
    ("a8w8 bias dtype", _call(ops.gemm_a8w8, A8, bias=t(4)), ValueError, r"bias dtype torch.float32 must be"),
    ("a8w8 device", _call(ops.gemm_a8w8, A8, w_scale=t(1, device=META)), ValueError, r"different devices"),
    (
        "a8w8 bpreshuffle strided WQ",
        _call(ops.gemm_a8w8_bpreshuffle, A8, WQ=t(8, 4, dtype=F8).t()),
        ValueError,
        r"WQ must be the pre-shuffled",
    ),
    (
        "a8w8 bpreshuffle XQ None",
        _call(ops.gemm_a8w8_bpreshuffle, A8, XQ=None),
        TypeError,
        r"gemm_a8w8_bpreshuffle: XQ must be a tensor",
    ),
    (
        "int8_gemm fp8",
        lambda: ops.int8_gemm(A8["XQ"], A8["WQ"], A8["x_scale"], A8["w_scale"]),
        ValueError,
        r"int8_gemm: input and weight must be int8",
    ),
    (
        "blockscale XQ None",
        _call(ops.gemm_a8w8_blockscale, BLOCK, XQ=None),
        TypeError,
        r"gemm_a8w8_blockscale: XQ must be a tensor",
    ),
    (
        "blockscale w_scale list",
        _call(ops.gemm_a8w8_blockscale, BLOCK, w_scale=[1.0]),
        TypeError,
        r"gemm_a8w8_blockscale: w_scale must be a tensor",
    ),
    (
        "blockscale K 100",
        _call(
            ops.gemm_a8w8_blockscale, XQ=t(2, 100, dtype=F8), WQ=t(4, 100, dtype=F8), x_scale=t(2, 1), w_scale=t(1, 1)
        ),
        ValueError,
        r"K=100 is not a multiple of 128",
    ),
    ("blockscale x_scale", _call(ops.gemm_a8w8_blockscale, BLOCK, x_scale=t(2, 2)), ValueError, r"x_scale must be"),
    ("blockscale w_scale", _call(ops.gemm_a8w8_blockscale, BLOCK, w_scale=t(2, 1)), ValueError, r"w_scale must be"),
    (
        "blockscale dtype",
        _call(ops.gemm_a8w8_blockscale, BLOCK, dtype=torch.int8),
        ValueError,
        r"output dtype torch.int8",
    ),
    (
        "blockscale bpreshuffle XQ None",
        _call(ops.gemm_a8w8_blockscale_bpreshuffle, BLOCK, XQ=None),
        TypeError,
        r"gemm_a8w8_blockscale_bpreshuffle: XQ must be",
    ),
    (
        "batched_gemm_a8w8 XQ None",
        lambda: ops.batched_gemm_a8w8(None, t(2, 5, 8, dtype=F8), t(2, 3, 1), t(2, 1, 5)),
        TypeError,
        r"batched_gemm_a8w8: XQ must be a tensor, got NoneType",
    ),
    (
        "batched_gemm_a8w8 WQ list",
        lambda: ops.batched_gemm_a8w8(t(2, 3, 8, dtype=F8), [1], t(2, 3, 1), t(2, 1, 5)),
        TypeError,
        r"batched_gemm_a8w8: WQ must be a tensor, got list",
    ),
    (
        "prepare_expert_weights 2-D",
        lambda: ops.prepare_expert_weights(t(4, 5)),
        ValueError,
        r"prepare_expert_weights: weights must be \(E, K, N\)",
    ),
    ("gemm_relu w None", lambda: ops.gemm_relu(t(2, 8), None), TypeError, r"\bw must be a tensor, got NoneType"),
    # epilogue ops
    (
        "epilogue act",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), act="swish"),
        ValueError,
        r"act must be one of .* got 'swish'",
    ),
    ("epilogue x None", lambda: ops.gemm_epilogue(None, t(4, 8)), TypeError, r"\bx must be a tensor, got NoneType"),
    (
        "epilogue c list",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), c=[1.0], beta=1.0),
        TypeError,
        r"c must be a tensor or None",
    ),
    ("epilogue beta no c", lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), beta=2.0), ValueError, r"beta=2.0 needs a C"),
    ("epilogue w_layout", lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), w_layout="xy"), ValueError, r"w_layout must be"),
    ("epilogue K", lambda: ops.gemm_epilogue(t(2, 7), t(4, 8)), ValueError, r"K=7\] does not match"),
    (
        "gemm_bias K",
        lambda: ops.gemm_bias(t(2, 8), t(4, 8), t(4), transpose_weight=False),
        ValueError,
        r"does not match w \[K, N\]",
    ),
    (
        "gemm_gelu approximate",
        lambda: ops.gemm_gelu(t(2, 8), t(4, 8), approximate="fast"),
        ValueError,
        r"approximate must be one of none, tanh, got 'fast'",
    ),
    ("cutlass c shape", lambda: ops.cutlass_gemm(t(2, 8), t(8, 4), beta=1.0, c=t(3, 3)), ValueError, r"\bc\b"),
    # softcap_attention
    ("attention query None", _call(ops.softcap_attention, ATTN, query=None), TypeError, r"query must be a tensor"),
    ("attention value list", _call(ops.softcap_attention, ATTN, value=[1]), TypeError, r"value must be a tensor"),
    ("attention mask list", _call(ops.softcap_attention, ATTN, mask=[True]), TypeError, r"mask must be a tensor"),
    (
        "attention scaling nan",
        _call(ops.softcap_attention, ATTN, scaling=float("nan")),
        ValueError,
        r"scaling must be a finite number > 0 or None, got nan",
    ),
    ("attention softcap str", _call(ops.softcap_attention, ATTN, softcap="30"), TypeError, r"softcap must be"),
    ("attention window 0", _call(ops.softcap_attention, ATTN, window=0), ValueError, r"window must be an int >= 1"),
    ("attention window float", _call(ops.softcap_attention, ATTN, window=2.5), TypeError, r"window must be"),
    # prune_2_4
    ("prune weight None", lambda: ops.prune_2_4(None), ValueError, r"prune_2_4: weight must be a dense 2-D"),
    ("prune K", lambda: ops.prune_2_4(t(4, 6), compress=False), ValueError, r"K=6 is not a multiple of 4"),
    ("prune int", lambda: ops.prune_2_4(t(4, 8, dtype=I32), compress=False), ValueError, r"weight must be a float"),
    # Python API of the environment variables
    (
        "set_online_tuning budget -1",
        lambda: gemmtune.set_online_tuning("x.csv", budget_s=-1),
        ValueError,
        r"budget_s must be a finite number > 0 or None, got -1",
    ),
    (
        "set_online_tuning budget nan",
        lambda: gemmtune.set_online_tuning("x.csv", budget_s=float("nan")),
        ValueError,
        r"budget_s .* got nan",
    ),
    (
        "set_online_tuning budget str",
        lambda: gemmtune.set_online_tuning("x.csv", budget_s="5"),
        TypeError,
        r"budget_s .* got '5'",
    ),
    (
        "set_online_tuning mode",
        lambda: gemmtune.set_online_tuning("x.csv", mode="async"),
        ValueError,
        r"mode must be one of background, blocking, got 'async'",
    ),
    ("set_online_tuning path int", lambda: gemmtune.set_online_tuning(5), TypeError, r"path must be a path .* got 5"),
    (
        "set_online_tuning libtypes str",
        lambda: gemmtune.set_online_tuning("x.csv", libtypes="torch"),
        TypeError,
        r"libtypes must be a list or None, got 'torch'",
    ),
    (
        "set_capture int",
        lambda: gemmtune.set_capture(123),
        TypeError,
        r"set_capture: path must be a path \(str or os.PathLike\) or None, got 123",
    ),
    ("set_config int", lambda: gemmtune.set_config(123), TypeError, r"set_config: config must be .* got int"),
    ("set_config missing", lambda: gemmtune.set_config("/no/such/table.csv"), ValueError, r"/no/such/table.csv"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in OP_CASES], ids=[c[0] for c in OP_CASES])
def test_op_refuses_bad_input(call, exc, pattern):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert info.type is exc or issubclass(info.type, exc)
    assert re.search(pattern, msg), msg
    assert "\n" not in msg  # one line


def test_ops_edge_values_that_are_valid_still_compute():
    """Not errors: empty sums and zero-sized inputs answer as torch does."""
    y = ops.gemm_a8w8_blockscale(t(2, 0, dtype=F8), t(4, 0, dtype=F8), t(2, 0), t(1, 0))
    assert y.shape == (2, 4) and not y.any()
    assert ops.grouped_gemm(t(3, 4), t(2, 4, 5), ids(6, hi=2), topk=2).shape == (3, 2, 5)


# ---- environment variables ------------------------------------------------------------------------
TUNED = (
    "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
    "cpu,2,1,64,64,False,torch.float32,torch.float32,False,False,torch,0,0,5.0,native,0,0,0\n"
)
BENCH_OUT = (
    "M,N,K,bias,dtype,outdtype,solution,table_us,tuned_us,default_us,noise\n1,64,64,False,f,f,torch,5,5,5,0.01\n"
)
USER_SHAPES = "M,N,K,notes,measured_ms\n16,4096,4096,qkv of layer 0,0.31\n"


def _key():
    return key_of(t(2, 4), t(3, 4), None, None)


def _env_error(monkeypatch, env: dict):
    """The error a fresh dispatcher raises for `env` at the first call, and the same at a later one."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    d = Dispatcher()
    errors = []
    for _ in range(2):
        with pytest.raises(GemmtuneError) as info:
            d.runner_for(_key(), torch.device("cpu"))
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])  # never a silent mode change
    return errors[0]


def _user_files(tmp_path):
    files = {"tuned.csv": TUNED, "tuned.bench.csv": BENCH_OUT, "notes.csv": USER_SHAPES}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return {name: (tmp_path / name).read_bytes() for name in files}


ENV_CASES = [
    (
        "budget abc",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_BUDGET": "abc"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_BUDGET='abc'",
    ),
    (
        "budget nan",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_BUDGET": "nan"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_BUDGET='nan'",
    ),
    (
        "budget -5",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_BUDGET": "-5"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_BUDGET='-5'",
    ),
    (
        "budget 0",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_BUDGET": "0"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_BUDGET='0'",
    ),
    (
        "budget inf",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_BUDGET": "inf"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_BUDGET='inf'",
    ),
    (
        "online mode unknown",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_MODE": "lazy"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_MODE='lazy': expected one of background, blocking",
    ),
    (
        "online libtypes unknown",
        {"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_LIBTYPES": "torch,nosuchlib"},
        EnvVarError,
        r"GEMMTUNE_TUNE_ONLINE_LIBTYPES='torch,nosuchlib': unknown backend\(s\) nosuchlib",
    ),
    (
        "plugin missing",
        {"GEMMTUNE_PLUGINS": "no_such_gemmtune_plugin"},
        EnvVarError,
        r"GEMMTUNE_PLUGINS 'no_such_gemmtune_plugin': cannot import plugin module",
    ),
    (
        "plugin second missing",
        {"GEMMTUNE_PLUGINS": "json, no_such_plugin_2"},
        EnvVarError,
        r"GEMMTUNE_PLUGINS 'no_such_plugin_2'",
    ),
    (
        "capture tuned table",
        {"GEMMTUNE_CAPTURE": "{tmp}/tuned.csv"},
        ShapesFileError,
        r"GEMMTUNE_CAPTURE=.*tuned.csv.* is a tuned table",
    ),
    (
        "capture bench output",
        {"GEMMTUNE_CAPTURE": "{tmp}/tuned.bench.csv"},
        ShapesFileError,
        r"GEMMTUNE_CAPTURE=.*tuned.bench.csv.* is not a capture file",
    ),
    (
        "capture user columns",
        {"GEMMTUNE_CAPTURE": "{tmp}/notes.csv"},
        ShapesFileError,
        r"GEMMTUNE_CAPTURE=.*notes.csv.* is not a capture file",
    ),
    (
        "capture missing folder",
        {"GEMMTUNE_CAPTURE": "{tmp}/no/such/dir/s.csv"},
        ShapesFileError,
        r"GEMMTUNE_CAPTURE=.*folder .*no/such/dir does not exist",
    ),
    ("capture a folder", {"GEMMTUNE_CAPTURE": "{tmp}"}, ShapesFileError, r"GEMMTUNE_CAPTURE=.* is a folder"),
    (
        "capture family file",
        {"GEMMTUNE_CAPTURE": "{tmp}/tuned.csv".replace("tuned", "fresh")},
        ShapesFileError,
        r"fresh.batched.csv is a tuned table",
    ),
]


@pytest.mark.parametrize("env,exc,pattern", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_env_var_misuse_is_reported_at_first_call_and_sticks(env, exc, pattern, tmp_path, monkeypatch):
    before = _user_files(tmp_path)
    (tmp_path / "fresh.batched.csv").write_text(TUNED.replace("M,N,K", "B,M,N,K"))
    fam_file = (tmp_path / "fresh.batched.csv").read_bytes()
    err = _env_error(monkeypatch, {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()})
    assert isinstance(err, exc) and isinstance(err, ValueError)
    assert re.search(pattern, str(err)), str(err)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert (tmp_path / "fresh.batched.csv").read_bytes() == fam_file
    assert not (tmp_path / "no").exists()


# ---- CLI ------------------------------------------------------------------------------------------
SHAPES = "M,N,K\n1,64,64\n"


def _workdir(tmp_path):
    (tmp_path / "s.csv").write_text(SHAPES)
    (tmp_path / "script.py").write_text("open('RAN', 'w').write('x')\n")
    _user_files(tmp_path)
    return tmp_path


# (args with {d} for the work folder, option or argument the message must name, a piece of the bad value)
CLI_USAGE = [
    # tune
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--plugin", "nosuch_module"], "--plugin", "nosuch_module"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--min-gain", "nan"], "--min-gain", "nan"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--min-gain", "-5"], "--min-gain", "-5"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--min-gain", "inf"], "--min-gain", "inf"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--min-gain", "x"], "--min-gain", "x"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--timeout", "-5"], "--timeout", "-5"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--timeout", "0"], "--timeout", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--timeout", "nan"], "--timeout", "nan"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--err-ratio", "0"], "--err-ratio", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--err-ratio", "nan"], "--err-ratio", "nan"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--err-ratio", "-1"], "--err-ratio", "-1"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--ms", "1,,2"], "--ms", "1,,2"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--ms", "1..1000000000000"], "--ms", "1000000000000"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--ms", "0"], "--ms", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--ms", "8..2"], "--ms", "8..2"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--device", "cuda:99"], "--device", "cuda:99"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--device", "tpu"], "--device", "tpu"),
    (["tune", "{d}/s.csv", "-o", "{d}/nodir/o.csv"], "--output", "nodir"),
    (["tune", "{d}/s.csv", "-o", "{d}"], "--output", "is a directory"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--profile-file", "{d}/nodir/p.csv"], "--profile-file", "nodir"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--top", "0"], "--top", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--reps", "2"], "--reps", "2"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--batch", "0"], "--batch", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--mp", "-1"], "--mp", "-1"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--stage-limit", "0"], "--stage-limit", "0"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--search", "quick"], "--search", "quick"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--seed", "x"], "--seed", "x"),
    # bench
    (["bench", "{d}/tuned.csv", "--plugin", "nosuch_module"], "--plugin", "nosuch_module"),
    (["bench", "{d}/tuned.csv", "--device", "cuda:99"], "--device", "cuda:99"),
    (["bench", "{d}/tuned.csv", "--device", "foo"], "--device", "foo"),
    (["bench", "{d}/tuned.csv", "--ms", "1,,2"], "--ms", "1,,2"),
    (["bench", "{d}/tuned.csv", "--ms", "1..1000000000000"], "--ms", "1000000000000"),
    (["bench", "{d}/tuned.csv", "--reps", "1"], "--reps", "1"),
    (["bench", "{d}/tuned.csv", "-o", "{d}/nodir/b"], "--out", "nodir"),
    # shapes
    (["shapes", "--model", "tiny-llama", "--dtype", "int8"], "--dtype", "int8"),
    (["shapes", "--model", "tiny-llama", "--dtype", "float8_e4m3fn"], "--dtype", "float8_e4m3fn"),
    (["shapes", "--model", "tiny-llama", "--dtype", "bogus"], "--dtype", "bogus"),
    (["shapes", "--model", "tiny-llama", "--outdtype", "int32"], "--outdtype", "int32"),
    (["shapes", "--model", "tiny-llama", "--nsets", "1..1000000000000"], "--nsets", "1000000000000"),
    (["shapes", "--model", "tiny-llama", "--nsets", "1,,2"], "--nsets", "1,,2"),
    (["shapes", "--model", "tiny-llama", "--nsets", "-4"], "--nsets", "-4"),
    (["shapes", "--model", "tiny-llama", "--nsets", "a..b"], "--nsets", "a..b"),
    (["shapes", "--model", "tiny-llama", "--tp", "0"], "--tp", "0"),
    (["shapes", "--model", "tiny-llama", "-o", "{d}/nodir/s.csv"], "--output", "nodir"),
    # an output onto a file of another kind (configs/files.py): a usage error before anything runs
    (["tune", "{d}/notes.csv", "-o", "{d}/tuned.bench.csv", "--no-progress"], "-o", "tuned.bench.csv"),
    # profile
    (["profile", "--device", "tpu", "--", "python", "{d}/script.py"], "--device", "tpu"),
    (["profile", "-o", "{d}/nodir/deeper", "--", "python", "{d}/script.py"], "--out", "nodir"),
    (["profile", "-o", "{d}/tuned.csv", "--", "python", "{d}/script.py"], "--out", "tuned.csv"),
    (["profile", "--top", "0", "--", "python", "{d}/script.py"], "--top", "0"),
    # capture
    (["capture", "-o", "{d}/tuned.csv", "--", sys.executable, "{d}/script.py"], "--output", "is a tuned table"),
    (["capture", "-o", "{d}/tuned.bench.csv", "--", sys.executable, "{d}/script.py"], "--output", "tuned.bench.csv"),
    (["capture", "-o", "{d}/notes.csv", "--", sys.executable, "{d}/script.py"], "--output", "notes.csv"),
    (["capture", "-o", "{d}/s.csv", "--", sys.executable, "{d}/script.py"], "--output", "s.csv"),
    (["capture", "-o", "{d}/nodir/c.csv", "--", sys.executable, "{d}/script.py"], "--output", "nodir"),
    # bench-model (its option validation only: every case stops before a model is built)
    (["bench-model", "--model", "tiny-llama", "--dtype", "int8"], "--dtype", "int8"),
    (["bench-model", "--model", "tiny-llama", "--dtype", "nope"], "--dtype", "nope"),
    (["bench-model", "--model", "tiny-llama", "--device", "cuda:99"], "--device", "cuda:99"),
    (["bench-model", "--model", "tiny-llama", "--device", "xpu"], "--device", "xpu"),
    (["bench-model", "--model", "tiny-llama", "-o", "{d}/nodir/deeper"], "--out", "nodir"),
    (["bench-model", "--model", "tiny-llama", "--layers", "0"], "--layers", "0"),
    (["bench-model", "--model", "tiny-llama", "--quantize", "int4"], "--quantize", "int4"),
    # show-config / doctor
    (["show-config", "--bogus"], "--bogus", "--bogus"),
    (["doctor", "--jsn"], "--jsn", "--jsn"),
]
if not torch.cuda.is_available():  # the CPU-only torch of CI and of the report
    CLI_USAGE += [
        (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--device", "cuda"], "--device", "cuda"),
        (["bench", "{d}/tuned.csv", "--device", "cuda"], "--device", "cuda"),
        (["profile", "--device", "cuda", "--", "python", "{d}/script.py"], "--device", "cuda"),
        (["bench-model", "--model", "tiny-llama", "--device", "cuda"], "--device", "cuda"),
    ]


def _snapshot(d: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _invoke(args, d, env=None):
    return CliRunner().invoke(cli, [a.replace("{d}", str(d)) for a in args], env=env)


@pytest.mark.parametrize("args,name,value", CLI_USAGE, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in CLI_USAGE])
def test_cli_refuses_bad_option_as_usage_error(args, name, value, tmp_path, monkeypatch):
    monkeypatch.delenv("GEMMTUNE_PLUGINS", raising=False)
    d = _workdir(tmp_path)
    before = _snapshot(d)
    res = _invoke(args, d)
    assert res.exit_code == 2, res.output  # click's usage error, not a crash (1) nor success (0)
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    assert name in errors[0] and value in errors[0], errors[0]
    assert _snapshot(d) == before  # nothing written, nothing rewritten, the command never ran
    assert not (d / "RAN").exists()


# Refused for what a file holds or the environment says (exit 1, one Error: line naming the cause).
CLI_REFUSED = [
    (
        ["bench", "{d}/tuned.csv"],
        {"GEMMTUNE_CONFIG": "/missing.csv"},
        "GEMMTUNE_CONFIG=/missing.csv: /missing.csv: no such file",
    ),
    (["bench", "{d}/s.csv"], None, "s.csv"),
    (["bench", "{d}/missing.csv"], None, "missing.csv"),
    (["tune", "{d}/missing.csv", "-o", "{d}/o.csv", "--no-progress"], None, "missing.csv"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--libtype", "nosuch", "--no-progress"], None, "nosuch"),
    (["tune", "{d}/s.csv", "-o", "{d}/o.csv", "--family", "nosuch", "--no-progress"], None, "nosuch"),
    (["shapes", "--model", "{d}/missing.json"], None, "missing.json"),
    (["show-config", "{d}/missing.csv"], None, "missing.csv"),
]


@pytest.mark.parametrize("args,env,named", CLI_REFUSED, ids=[" ".join(a[:2]) for a, _, _ in CLI_REFUSED])
def test_cli_refuses_bad_file_or_environment_with_one_line(args, env, named, tmp_path, monkeypatch):
    monkeypatch.delenv("GEMMTUNE_PLUGINS", raising=False)
    d = _workdir(tmp_path)
    before = _snapshot(d)
    res = _invoke(args, d, env)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and named in errors[0], res.output
    assert _snapshot(d) == before


# ---- data safety: capture never rewrites a file it did not write ----------------------------------
AITER_FILES = sorted(p.name for p in AITER.glob("*.csv"))


@pytest.mark.parametrize("name", AITER_FILES)
def test_capture_leaves_every_aiter_table_byte_identical(name, tmp_path):
    target = tmp_path / name
    target.write_bytes((AITER / name).read_bytes())
    (tmp_path / "script.py").write_text("open('RAN', 'w').write('x')\n")
    before = _snapshot(tmp_path)
    res = CliRunner().invoke(cli, ["capture", "-o", str(target), "--", sys.executable, str(tmp_path / "script.py")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert name in res.output and ("tuned table" in res.output or "not a capture file" in res.output)
    assert _snapshot(tmp_path) == before and not (tmp_path / "RAN").exists()
    with pytest.raises(ShapesFileError):
        gemmtune.set_capture(str(target))
    assert _snapshot(tmp_path) == before


def test_capture_still_merges_into_its_own_file(tmp_path):
    out = tmp_path / "c.csv"
    gemmtune.set_capture(str(out))
    gemmtune.gemm(t(3, 4), t(5, 4))
    gemmtune.get_dispatcher().capture().flush()
    gemmtune.set_capture(None)
    gemmtune.set_capture(str(out))  # its own columns: accepted, counts merge
    gemmtune.gemm(t(3, 4), t(5, 4))
    gemmtune.get_dispatcher().capture().flush()
    gemmtune.set_capture(None)
    assert [c for _, c in gemmtune.capture.read_shapes(str(out))] == [2]
    (tmp_path / "empty.csv").write_text("")  # an empty file holds nothing to lose
    gemmtune.set_capture(str(tmp_path / "empty.csv"))


def test_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    """tune with --progress into a pipe (CliRunner's stderr is no terminal): whole lines, no carriage returns."""
    (tmp_path / "s.csv").write_text("M,N,K,dtype,outdtype\n1,8,8,torch.float32,torch.float32\n")
    res = CliRunner().invoke(cli, ["tune", str(tmp_path / "s.csv"), "-o", str(tmp_path / "o.csv"), "--reps", "5",
                                   "--no-verify-range"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "\r" not in res.output and "1/1 keys done" in res.output
