"""Typed arguments: every public op and API function holds its arguments to one rule (gemmtune/checks.py).
Booleans are bool (never 'no', 0 or 1), enums one of their choices, lists checked item by item, numbers
range-checked, keys valid for their family; a bad value is a TypeError (wrong kind) or ValueError (bad
value) whose one-line message names the function, the argument and the value. Then the values that are
right compute the right result (a bias in the out dtype, meta tensors), and the tuner's inputs (shape lists,
model configs) are refused naming file:line and the column.

Deterministic and fast: fixed tensors, nothing timed, every refused command stops before it runs anything.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import gemmtune
from gemmtune import ops
from gemmtune.capture import read_shape_list
from gemmtune.cli.main import cli
from gemmtune.errors import ShapesFileError
from gemmtune.families.batched import BatchedKey
from gemmtune.families.epilogue import EpilogueKey
from gemmtune.keys import GemmKey
from gemmtune.tuner.candidates import TuneOptions
from gemmtune.tuner.model_shapes import PRESETS, ModelConfigError, model_gemms
from gemmtune.tuner.runner import load_keys

F32, F16, BF16, I64 = torch.float32, torch.float16, torch.bfloat16, torch.int64
F8 = torch.float8_e4m3fn
META = torch.device("meta")


def t(*shape, dtype=F32, device="cpu"):
    """A deterministic tensor (small values: exact in every dtype here)."""
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float32) % 7 - 3) / 4).reshape(shape).to(dtype=dtype, device=device)


def ids(*shape, hi=1):
    return (torch.arange(math.prod(shape)) % hi).reshape(shape).to(I64)


def _call(fn, base: dict | None = None, **over):
    kw = {**(base or {}), **over}
    return lambda: fn(**kw)


def _moe(tokens=3, hidden=4, experts=2, inter=4, device="cpu"):
    return dict(hidden_states=t(tokens, hidden, device=device), w1=t(experts, 2 * inter, hidden, device=device),
                w2=t(experts, hidden, inter, device=device), topk_weights=torch.ones(tokens, 1, device=device),
                topk_ids=ids(tokens, 1, hi=max(experts, 1)).to(device))  # fmt: skip


GEMM = dict(x=t(2, 8), w=t(4, 8))
BATCHED = dict(a=t(2, 3, 8), b=t(2, 8, 5))
MOE = _moe()
GROUPED = dict(input=t(3, 4), weights=t(2, 4, 5), expert_ids=ids(3, 2, hi=2))
A8 = dict(XQ=t(2, 8, dtype=F8), WQ=t(4, 8, dtype=F8), x_scale=torch.ones(1), w_scale=torch.ones(1))
BLOCK = dict(XQ=t(2, 128, dtype=F8), WQ=t(4, 128, dtype=F8), x_scale=torch.ones(2, 1), w_scale=torch.ones(1, 1))
BQ = dict(XQ=t(2, 3, 8, dtype=F8), WQ=t(2, 5, 8, dtype=F8), x_scale=torch.ones(2, 3, 1), w_scale=torch.ones(2, 1, 5))
ATTN = dict(query=t(1, 2, 3, 4), key=t(1, 2, 3, 4), value=t(1, 2, 3, 4))
SPARSE = dict(input=t(2, 4), weight=torch.eye(4).to_sparse_coo(), sparsity_pattern="coo")


def _profiled():
    return None


def _optimize(**kw):
    return lambda: gemmtune.optimize(None, **kw)


# (id, call, error type, the function's name, the argument, a piece of the value as the message shows it)
CASES = [
    # gemm
    ("gemm x str", _call(ops.gemm, GEMM, x="x"), TypeError, "gemm", "x", "str"),
    ("gemm bias list", _call(ops.gemm, GEMM, bias=[0.0] * 4), TypeError, "gemm", "bias", "list"),
    ("gemm out_dtype name", _call(ops.gemm, GEMM, out_dtype="bf16"), TypeError, "gemm", "out_dtype", "'bf16'"),
    ("gemm out_dtype int8", _call(ops.gemm, GEMM, out_dtype=torch.int8), ValueError, "gemm", "out_dtype", "torch.int8"),
    ("gemm out_dtype f64", _call(ops.gemm, GEMM, out_dtype=torch.float64), ValueError, "gemm", "out_dtype", "float64"),
    # gemm_bias / gemm_gelu / gemm_relu / cutlass_gemm / gemm_epilogue
    *[
        (
            f"gemm_bias transpose_weight {v!r}",
            lambda v=v: ops.gemm_bias(t(2, 8), t(4, 8), t(4), transpose_weight=v),
            TypeError,
            "gemm_bias",
            "transpose_weight",
            repr(v),
        )
        for v in ("no", 0, 1, None, "True")
    ],  # fmt: skip
    *[
        (
            f"gemm_gelu approximate {v!r}",
            lambda v=v: ops.gemm_gelu(t(2, 8), t(4, 8), approximate=v),
            ValueError,
            "gemm_gelu",
            "approximate",
            repr(v),
        )
        for v in ("fast", None, True, "TANH")
    ],  # fmt: skip
    ("gemm_relu bias int", lambda: ops.gemm_relu(t(2, 8), t(4, 8), 3), TypeError, "gemm_epilogue", "bias", "int"),
    (
        "cutlass alpha str",
        lambda: ops.cutlass_gemm(t(2, 8), t(8, 4), alpha="2"),
        TypeError,
        "gemm_epilogue",
        "alpha",
        "'2'",
    ),  # fmt: skip
    (
        "cutlass alpha nan",
        lambda: ops.cutlass_gemm(t(2, 8), t(8, 4), alpha=math.nan),
        ValueError,
        "gemm_epilogue",
        "alpha",
        "nan",
    ),  # fmt: skip
    (
        "cutlass beta inf",
        lambda: ops.cutlass_gemm(t(2, 8), t(8, 4), beta=math.inf, c=t(2, 4)),
        ValueError,
        "gemm_epilogue",
        "beta",
        "inf",
    ),  # fmt: skip
    (
        "cutlass alpha tensor",
        lambda: ops.cutlass_gemm(t(2, 8), t(8, 4), alpha=torch.tensor(2.0)),
        TypeError,
        "gemm_epilogue",
        "alpha",
        "a tensor ()",
    ),  # fmt: skip
    (
        "epilogue alpha bool",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), alpha=True),
        TypeError,
        "gemm_epilogue",
        "alpha",
        "True",
    ),  # fmt: skip
    (
        "epilogue act None",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), act=None),
        ValueError,
        "gemm_epilogue",
        "act",
        "None",
    ),  # fmt: skip
    (
        "epilogue act list",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), act=["relu"]),
        ValueError,
        "gemm_epilogue",
        "act",
        "['relu']",
    ),  # fmt: skip
    (
        "epilogue w_layout NK",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), w_layout="NK"),
        ValueError,
        "gemm_epilogue",
        "w_layout",
        "'NK'",
    ),  # fmt: skip
    (
        "epilogue out_dtype name",
        lambda: ops.gemm_epilogue(t(2, 8), t(4, 8), out_dtype="fp16"),
        TypeError,
        "gemm_epilogue",
        "out_dtype",
        "'fp16'",
    ),  # fmt: skip
    # batched_gemm
    (
        "batched transpose_a 0",
        _call(ops.batched_gemm, BATCHED, transpose_a=0),
        TypeError,
        "batched_gemm",
        "transpose_a",
        "0",
    ),  # fmt: skip
    (
        "batched transpose_b no",
        _call(ops.batched_gemm, BATCHED, transpose_b="no"),
        TypeError,
        "batched_gemm",
        "transpose_b",
        "'no'",
    ),  # fmt: skip
    (
        "batched transpose_b None",
        _call(ops.batched_gemm, BATCHED, transpose_b=None),
        TypeError,
        "batched_gemm",
        "transpose_b",
        "None",
    ),  # fmt: skip
    (
        "batched out_dtype int8",
        _call(ops.batched_gemm, BATCHED, out_dtype=torch.int8),
        ValueError,
        "batched_gemm",
        "out_dtype",
        "torch.int8",
    ),  # fmt: skip
    # the 8-bit ops
    (
        "batched_a8w8 dtype name",
        _call(ops.batched_gemm_a8w8, BQ, dtype="bf16"),
        TypeError,
        "batched_gemm_a8w8",
        "dtype",
        "'bf16'",
    ),  # fmt: skip
    (
        "batched_a8w8 dtype int8",
        _call(ops.batched_gemm_a8w8, BQ, dtype=torch.int8),
        ValueError,
        "batched_gemm_a8w8",
        "dtype",
        "torch.int8",
    ),  # fmt: skip
    ("a8w8 dtype None", _call(ops.gemm_a8w8, A8, dtype=None), TypeError, "gemm_a8w8", "dtype", "None"),
    ("a8w8 bias tuple", _call(ops.gemm_a8w8, A8, bias=(1.0,)), TypeError, "gemm_a8w8", "bias", "tuple"),
    (
        "blockscale dtype str",
        _call(ops.gemm_a8w8_blockscale, BLOCK, dtype="x"),
        TypeError,
        "gemm_a8w8_blockscale",
        "dtype",
        "'x'",
    ),  # fmt: skip
    (
        "int8_gemm output_dtype name",
        lambda: ops.int8_gemm(
            t(2, 8, dtype=torch.int8), t(4, 8, dtype=torch.int8), torch.ones(1), torch.ones(1), "fp16"
        ),
        TypeError,
        "gemm_a8w8",
        "dtype",
        "'fp16'",
    ),  # fmt: skip
    # sparse_gemm
    (
        "sparse pattern None",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern=None),
        ValueError,
        "sparse_gemm",
        "sparsity_pattern",
        "None",
    ),  # fmt: skip
    (
        "sparse pattern list",
        _call(ops.sparse_gemm, SPARSE, sparsity_pattern=["coo"]),
        ValueError,
        "sparse_gemm",
        "sparsity_pattern",
        "['coo']",
    ),  # fmt: skip
    # fused_moe
    *[
        (f"moe check_ids {v!r}", _call(ops.fused_moe, MOE, check_ids=v), TypeError, "fused_moe", "check_ids", repr(v))
        for v in ("no", 0, 1, "")
    ],  # fmt: skip
    *[
        (
            f"moe doweight_stage1 {v!r}",
            _call(ops.fused_moe, MOE, doweight_stage1=v),
            TypeError,
            "fused_moe",
            "doweight_stage1",
            repr(v),
        )
        for v in ("yes", 1, None)
    ],  # fmt: skip
    (
        "moe activation SiLU",
        _call(ops.fused_moe, MOE, activation="SiLU"),
        ValueError,
        "fused_moe",
        "activation",
        "'SiLU'",
    ),  # fmt: skip
    (
        "moe shared float",
        _call(ops.fused_moe, MOE, num_shared_experts=1.0),
        TypeError,
        "fused_moe",
        "num_shared_experts",
        "1.0",
    ),  # fmt: skip
    (
        "moe shared bool",
        _call(ops.fused_moe, MOE, num_shared_experts=True),
        TypeError,
        "fused_moe",
        "num_shared_experts",
        "True",
    ),  # fmt: skip
    ("moe inter 0", _call(ops.fused_moe, _moe(inter=0)), ValueError, "fused_moe", "w2", "inter=0"),
    ("moe 0 experts", _call(ops.fused_moe, _moe(experts=0)), ValueError, "fused_moe", "w2", "0 experts"),
    # grouped_gemm
    (
        "grouped check_ids no",
        _call(ops.grouped_gemm, GROUPED, check_ids="no"),
        TypeError,
        "grouped_gemm",
        "check_ids",
        "'no'",
    ),  # fmt: skip
    (
        "grouped check_ids 1",
        _call(ops.grouped_gemm, GROUPED, check_ids=1),
        TypeError,
        "grouped_gemm",
        "check_ids",
        "1",
    ),  # fmt: skip
    (
        "grouped weights_transposed 0",
        _call(ops.grouped_gemm, GROUPED, weights_transposed=0),
        TypeError,
        "grouped_gemm",
        "weights_transposed",
        "0",
    ),  # fmt: skip
    ("grouped topk float", _call(ops.grouped_gemm, GROUPED, topk=2.0), TypeError, "grouped_gemm", "topk", "2.0"),
    ("grouped topk bool", _call(ops.grouped_gemm, GROUPED, topk=True), TypeError, "grouped_gemm", "topk", "True"),
    # softcap_attention
    (
        "attention scaling -1",
        _call(ops.softcap_attention, ATTN, scaling=-1.0),
        ValueError,
        "softcap_attention",
        "scaling",
        "-1.0",
    ),  # fmt: skip
    (
        "attention softcap -1",
        _call(ops.softcap_attention, ATTN, softcap=-1.0),
        ValueError,
        "softcap_attention",
        "softcap",
        "-1.0",
    ),  # fmt: skip
    (
        "attention softcap 0",
        _call(ops.softcap_attention, ATTN, softcap=0),
        ValueError,
        "softcap_attention",
        "softcap",
        "0",
    ),  # fmt: skip
    (
        "attention softcap inf",
        _call(ops.softcap_attention, ATTN, softcap=math.inf),
        ValueError,
        "softcap_attention",
        "softcap",
        "inf",
    ),  # fmt: skip
    (
        "attention causal no",
        _call(ops.softcap_attention, ATTN, causal="no"),
        TypeError,
        "softcap_attention",
        "causal",
        "'no'",
    ),  # fmt: skip
    (
        "attention causal 1",
        _call(ops.softcap_attention, ATTN, causal=1),
        TypeError,
        "softcap_attention",
        "causal",
        "1",
    ),  # fmt: skip
    (
        "attention window True",
        _call(ops.softcap_attention, ATTN, window=True),
        TypeError,
        "softcap_attention",
        "window",
        "True",
    ),  # fmt: skip
    (
        "attention scaling bool",
        _call(ops.softcap_attention, ATTN, scaling=False),
        TypeError,
        "softcap_attention",
        "scaling",
        "False",
    ),  # fmt: skip
    # helpers
    (
        "prune_2_4 compress no",
        lambda: ops.prune_2_4(t(4, 8), compress="no"),
        TypeError,
        "prune_2_4",
        "compress",
        "'no'",
    ),
    (
        "prepare_expert_weights None",
        lambda: ops.prepare_expert_weights(None),
        TypeError,
        "prepare_expert_weights",
        "weights",
        "NoneType",
    ),
    (
        "load_fp8_checkpoint strict",
        lambda: gemmtune.load_fp8_checkpoint(torch.nn.Linear(2, 2), {}, strict="no"),
        TypeError,
        "load_fp8_checkpoint",
        "strict",
        "'no'",
    ),
    (
        "load_fp8_checkpoint model",
        lambda: gemmtune.load_fp8_checkpoint("model.pt", {}),
        TypeError,
        "load_fp8_checkpoint",
        "model",
        "'model.pt'",
    ),
    # resolve: keys valid for their family
    ("resolve tuple", lambda: gemmtune.resolve((1, 2, 3)), TypeError, "resolve", "key", "(1, 2, 3)"),
    ("resolve M -1", lambda: gemmtune.resolve(GemmKey(-1, 2, 3)), ValueError, "resolve", "key.M", "-1"),
    ("resolve M 0", lambda: gemmtune.resolve(GemmKey(0, 2, 3)), ValueError, "resolve", "key.M", "0"),
    ("resolve N float", lambda: gemmtune.resolve(GemmKey(1, 2.0, 3)), ValueError, "resolve", "key.N", "2.0"),
    ("resolve K bool", lambda: gemmtune.resolve(GemmKey(1, 2, True)), ValueError, "resolve", "key.K", "True"),
    (
        "resolve dtype name",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3, dtype="bf16")),
        TypeError,
        "resolve",
        "key.dtype",
        "'bf16'",
    ),  # fmt: skip
    (
        "resolve outdtype name",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3, outdtype="torch.float16")),
        TypeError,
        "resolve",
        "key.outdtype",
        "'torch.float16'",
    ),  # fmt: skip
    ("resolve bias 1", lambda: gemmtune.resolve(GemmKey(1, 2, 3, bias=1)), TypeError, "resolve", "key.bias", "1"),
    (
        "resolve bias no",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3, bias="no")),
        TypeError,
        "resolve",
        "key.bias",
        "'no'",
    ),  # fmt: skip
    (
        "resolve key of another family",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3), family="batched"),
        TypeError,
        "resolve",
        "key",
        "GemmKey(M=1",
    ),  # fmt: skip
    (
        "resolve family int",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3), family=5),
        TypeError,
        "resolve",
        "family",
        "5",
    ),  # fmt: skip
    (
        "resolve device tpu",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3), "tpu"),
        ValueError,
        "resolve",
        "device",
        "'tpu'",
    ),  # fmt: skip
    ("resolve device int", lambda: gemmtune.resolve(GemmKey(1, 2, 3), 5), TypeError, "resolve", "device", "5"),
    (
        "resolve batched transB 1",
        lambda: gemmtune.resolve(BatchedKey(2, 3, 4, 5, transB=1), family="batched"),
        TypeError,
        "resolve",
        "key.transB",
        "1",
    ),
    (
        "resolve epilogue act",
        lambda: gemmtune.resolve(EpilogueKey(1, 2, 3, act="swish"), family="epilogue"),
        ValueError,
        "resolve",
        "key.act",
        "'swish'",
    ),
    (
        "resolve fmoe GemmKey",
        lambda: gemmtune.resolve(GemmKey(1, 2, 3), family="fmoe"),
        TypeError,
        "resolve",
        "key",
        "GemmKey(",
    ),
    # tables
    ("load_config int", lambda: gemmtune.load_config(5), TypeError, "load_config", "paths", "5"),
    ("load_config None", lambda: gemmtune.load_config(None), TypeError, "load_config", "paths", "None"),
    ("load_config list item", lambda: gemmtune.load_config(["a.csv", 3]), TypeError, "load_config", "paths[1]", "3"),
    ("load_config empty", lambda: gemmtune.load_config(""), ValueError, "load_config", "paths", "''"),
    ("ConfigTable.load int", lambda: gemmtune.ConfigTable.load(7), TypeError, "ConfigTable.load", "paths", "7"),
    (
        "set_config list None",
        lambda: gemmtune.set_config(["a.csv", None]),
        TypeError,
        "set_config",
        "config[1]",
        "None",
    ),  # fmt: skip
    ("set_config list int", lambda: gemmtune.set_config([5]), TypeError, "set_config", "config[0]", "5"),
    # set_capture: one path, as set_online_tuning's (None stops)
    ("set_capture int", lambda: gemmtune.set_capture(5), TypeError, "set_capture", "path", "5"),
    ("set_capture empty", lambda: gemmtune.set_capture(""), ValueError, "set_capture", "path", "''"),
    ("set_capture list", lambda: gemmtune.set_capture(["a.csv"]), TypeError, "set_capture", "path", "['a.csv']"),
    # set_online_tuning, as its environment variables
    (
        "online libtypes nosuch",
        lambda: gemmtune.set_online_tuning("o.csv", libtypes=["nosuch"]),
        ValueError,
        "set_online_tuning",
        "libtypes[0]",
        "'nosuch'",
    ),  # fmt: skip
    (
        "online libtypes item int",
        lambda: gemmtune.set_online_tuning("o.csv", libtypes=["torch", 3]),
        ValueError,
        "set_online_tuning",
        "libtypes[1]",
        "3",
    ),  # fmt: skip
    (
        "online mode upper",
        lambda: gemmtune.set_online_tuning("o.csv", mode="BLOCKING"),
        ValueError,
        "set_online_tuning",
        "mode",
        "'BLOCKING'",
    ),  # fmt: skip
    (
        "online budget bool",
        lambda: gemmtune.set_online_tuning("o.csv", budget_s=True),
        TypeError,
        "set_online_tuning",
        "budget_s",
        "True",
    ),  # fmt: skip
    (
        "online budget 0",
        lambda: gemmtune.set_online_tuning("o.csv", budget_s=0),
        ValueError,
        "set_online_tuning",
        "budget_s",
        "0",
    ),  # fmt: skip
    ("online path empty", lambda: gemmtune.set_online_tuning(""), ValueError, "set_online_tuning", "path", "''"),
    # profile
    ("profile fn int", lambda: gemmtune.profile(5), TypeError, "profile", "fn", "5"),
    ("profile iters 0", lambda: gemmtune.profile(_profiled, iters=0), ValueError, "profile", "iters", "0"),
    ("profile iters float", lambda: gemmtune.profile(_profiled, iters=1.5), TypeError, "profile", "iters", "1.5"),
    ("profile warmup -1", lambda: gemmtune.profile(_profiled, warmup=-1), ValueError, "profile", "warmup", "-1"),
    (
        "profile annotate no",
        lambda: gemmtune.profile(_profiled, annotate="no"),
        TypeError,
        "profile",
        "annotate",
        "'no'",
    ),  # fmt: skip
    (
        "profile device tpu",
        lambda: gemmtune.profile(_profiled, device="tpu"),
        ValueError,
        "profile",
        "device",
        "'tpu'",
    ),  # fmt: skip
    (
        "profile device meta",
        lambda: gemmtune.profile(_profiled, device="meta"),
        ValueError,
        "profile",
        "device",
        "'meta'",
    ),  # fmt: skip
    ("profile hints list", lambda: gemmtune.profile(_profiled, hints=["x"]), TypeError, "profile", "hints", "['x']"),
    ("profile trace int", lambda: gemmtune.profile(_profiled, trace=5), TypeError, "profile", "trace", "5"),
    # optimize's keyword options (checked before the model is looked at)
    *[
        (f"optimize {name} {v!r}", _optimize(**{name: v}), TypeError, "optimize", name, repr(v))
        for name, v in (
            ("fuse_qkv", "no"),
            ("fuse_gate_up", 1),
            ("fused_ops", None),
            ("split_bias", "False"),
            ("route_linears", 0),
            ("quantize_lm_head", "no"),
            ("quantize_producers", 1),
            ("verify", "yes"),
            ("mla_absorb", 0),
        )
    ],  # fmt: skip
    ("optimize attention xyz", _optimize(attention="xyz"), ValueError, "optimize", "attention", "'xyz'"),
    ("optimize attention True", _optimize(attention=True), ValueError, "optimize", "attention", "True"),
    ("optimize m_threshold 0", _optimize(m_threshold=0), ValueError, "optimize", "m_threshold", "0"),
    ("optimize m_threshold float", _optimize(m_threshold=2.5), TypeError, "optimize", "m_threshold", "2.5"),
    ("optimize quantize int4", _optimize(quantize="int4"), ValueError, "optimize", "quantize", "'int4'"),
    # the tuner's options
    ("TuneOptions reps 0", lambda: TuneOptions(reps=0), ValueError, "tuner.TuneOptions", "reps", "0"),
    ("TuneOptions top str", lambda: TuneOptions(top="4"), TypeError, "tuner.TuneOptions", "top", "'4'"),
    ("TuneOptions search", lambda: TuneOptions(search="quick"), ValueError, "tuner.TuneOptions", "search", "'quick'"),
    (
        "TuneOptions verify_range",
        lambda: TuneOptions(verify_range="no"),
        TypeError,
        "tuner.TuneOptions",
        "verify_range",
        "'no'",
    ),  # fmt: skip
    (
        "TuneOptions libtypes str",
        lambda: TuneOptions(libtypes="torch"),
        TypeError,
        "tuner.TuneOptions",
        "libtypes",
        "'torch'",
    ),  # fmt: skip
    ("TuneOptions err_ratio 0", lambda: TuneOptions(err_ratio=0), ValueError, "tuner.TuneOptions", "err_ratio", "0"),
    (
        "TuneOptions min_gain nan",
        lambda: TuneOptions(min_gain=math.nan),
        ValueError,
        "tuner.TuneOptions",
        "min_gain",
        "nan",
    ),  # fmt: skip
    ("load_keys ms 0", lambda: load_keys("s.csv", ms=[1, 0]), ValueError, "tuner.load_keys", "ms[1]", "0"),
    ("load_keys ms str", lambda: load_keys("s.csv", ms="1..8"), TypeError, "tuner.load_keys", "ms", "'1..8'"),
    ("load_keys family int", lambda: load_keys("s.csv", family=1), TypeError, "tuner.load_keys", "family", "1"),
    (
        "TuneOptions stage_limit 0",
        lambda: TuneOptions(stage_limit=0),
        ValueError,
        "tuner.TuneOptions",
        "stage_limit",
        "0",
    ),  # fmt: skip
]


@pytest.mark.parametrize("call,exc,fn,name,value", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_named_with_its_value(call, exc, fn, name, value):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    msg = str(info.value)
    assert isinstance(info.value, exc), f"{type(info.value).__name__}: {msg}"
    assert msg.startswith(f"gemmtune.{fn}: "), msg
    assert re.search(rf"(^|[\s(]){re.escape(name)}(?!\w)", msg), msg
    assert value in msg.split(": ", 1)[1], msg
    assert "\n" not in msg


def test_the_cases_cover_every_public_op():
    named = {c[3] for c in CASES}
    spelled = {"gemm_relu", "gemm_a8w8_bpreshuffle", "gemm_a8w8_blockscale_bpreshuffle", "prune_2_4",
               "prepare_expert_weights", "semi_structured_reason", "int8_gemm", "cutlass_gemm"}  # fmt: skip
    ops_named = {e for e in ops.__all__ if callable(getattr(ops, e))} - {"key_of", "validate", "normalize_pattern"}
    assert ops_named - spelled <= named | {"gemm_epilogue"}, sorted(ops_named - spelled - named)
    assert {"resolve", "load_config", "set_config", "set_capture", "set_online_tuning", "profile", "optimize"} <= named


# ---- a 0 / 1 never rides on a cached True / False -------------------------------------------------
def test_flag_as_int_is_refused_after_the_bool_was_cached():
    ops.batched_gemm(t(2, 3, 6), t(2, 6, 5), transpose_a=False)
    with pytest.raises(TypeError, match=r"transpose_a must be a bool, got 0"):
        ops.batched_gemm(t(2, 3, 6), t(2, 6, 5), transpose_a=0)
    ops.fused_moe(**MOE, check_ids=True)
    with pytest.raises(TypeError, match=r"check_ids must be a bool or None, got 1"):
        ops.fused_moe(**MOE, check_ids=1)
    ops.grouped_gemm(**GROUPED, weights_transposed=False)
    with pytest.raises(TypeError, match=r"weights_transposed must be a bool, got 0"):
        ops.grouped_gemm(**GROUPED, weights_transposed=0)


# ---- right values, right results ------------------------------------------------------------------
def test_gemm_bias_transpose_weight_computes_what_it_says():
    x, w_nk, b = t(3, 8), t(4, 8), t(4)
    torch.testing.assert_close(ops.gemm_bias(x, w_nk, b, transpose_weight=True), F.linear(x, w_nk, b))
    torch.testing.assert_close(ops.gemm_bias(x, w_nk.t().contiguous(), b, transpose_weight=False), F.linear(x, w_nk, b))


@pytest.mark.parametrize("op", ["gemm", "gemm_epilogue", "gemm_epilogue relu"])
def test_bias_in_the_out_dtype_is_read_in_x_dtype(op):
    """A bias in the out dtype (not x's) is accepted and cast to x's, as F.linear would need it."""
    x, w, b = t(3, 8), t(5, 8), t(5, dtype=BF16)
    want = F.linear(x, w, b.to(F32))
    if op == "gemm":
        y = ops.gemm(x, w, b, out_dtype=BF16)
    else:
        act = op.split()[1] if " " in op else "none"
        y = ops.gemm_epilogue(x, w, b, act=act, out_dtype=BF16)
        want = want.relu() if act == "relu" else want
    assert y.dtype == BF16
    torch.testing.assert_close(y, want.to(BF16), rtol=0, atol=0)


def test_bias_in_neither_dtype_names_bias():
    for call in (lambda: ops.gemm(t(3, 8), t(5, 8), t(5, dtype=F16), out_dtype=BF16),
                 lambda: ops.gemm_epilogue(t(3, 8), t(5, 8), t(5, dtype=F16), out_dtype=BF16)):  # fmt: skip
        with pytest.raises(ValueError, match=r"bias dtype torch.float16 must be x's"):
            call()


def test_softcap_none_and_positive_compute():
    q = t(1, 2, 3, 4)
    plain = ops.softcap_attention(q, q, q, softcap=None)
    capped = ops.softcap_attention(q, q, q, softcap=1e6)  # a cap far above every logit: the plain result
    torch.testing.assert_close(capped, plain)
    assert not torch.equal(ops.softcap_attention(q, q, q, softcap=0.05), plain)


def test_meta_tensors_infer_shapes():
    moe = _moe(tokens=5, device=META)
    y = ops.fused_moe(**moe)
    assert y.device.type == "meta" and y.shape == (5, 4)
    y = ops.grouped_gemm(t(3, 4, device=META), t(2, 4, 5, device=META), ids(3, 2).to(META))
    assert y.device.type == "meta" and y.shape == (3, 2, 5)
    assert ops.gemm(t(2, 8, device=META), t(4, 8, device=META)).shape == (2, 4)


def test_valid_keys_resolve():
    res = gemmtune.resolve(GemmKey(1, 2, 3, dtype=F32, outdtype=F32), "cpu")
    assert res.solution.libtype == "torch"
    assert gemmtune.resolve(BatchedKey(2, 3, 4, 5), torch.device("cpu"), family="batched").row is None


# ---- tuner inputs ---------------------------------------------------------------------------------
def _tune(tmp_path, text: str, name="s.csv"):
    (tmp_path / name).write_text(text)
    out = tmp_path / "o.csv"
    res = CliRunner().invoke(cli, ["tune", str(tmp_path / name), "-o", str(out), "--no-progress", "--reps", "5",
                                   "--no-verify-range"])  # fmt: skip
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    return res, errors, out


@pytest.mark.parametrize("text", ["M,N,K\n", "M,N,K", "M,N,K,count\n\n"], ids=["header", "no newline", "blank"])
def test_tune_of_an_empty_shape_list_is_a_usage_error(tmp_path, text):
    res, errors, out = _tune(tmp_path, text)
    assert res.exit_code == 2, res.output
    assert len(errors) == 1 and f"{tmp_path / 's.csv'} has no shapes" in errors[0], res.output
    assert not out.exists()


ROWS = [
    ("int8 a16w16", "M,N,K,dtype,outdtype\n1,8,8,torch.int8,torch.int8\n", "dtype", "torch.int8"),
    ("fp8 a16w16", "M,N,K,dtype,outdtype\n1,8,8,torch.float8_e4m3fn,torch.bfloat16\n", "dtype", "float8_e4m3fn"),
    ("int32 out", "M,N,K,dtype,outdtype\n1,8,8,torch.float32,torch.int32\n", "outdtype", "torch.int32"),
    ("fp8 batched", "B,M,N,K,dtype,outdtype\n2,1,8,8,torch.float8_e4m3fn,torch.float8_e4m3fn\n", "dtype", "float8"),
    ("a8w8 bf16 weights", "M,N,K,q_dtype_w\n1,8,8,torch.bfloat16\n", "q_dtype_w", "torch.bfloat16"),
    ("count -3", "M,N,K,count\n1,8,8,-3\n", "count", "'-3'"),
    ("count 2.5", "M,N,K,count\n1,8,8,2.5\n", "count", "'2.5'"),
]


@pytest.mark.parametrize("text,column,value", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_shape_list_row_is_refused_naming_file_line_and_column(tmp_path, text, column, value):
    (tmp_path / "s.csv").write_text(text)
    with pytest.raises(ShapesFileError) as info:
        read_shape_list(str(tmp_path / "s.csv"))
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 's.csv'}:2: column {column!r}") and value in msg, msg
    res, errors, out = _tune(tmp_path, text)
    assert res.exit_code == 1 and len(errors) == 1 and f"s.csv:2: column {column!r}" in errors[0], res.output
    assert not out.exists()


def _llama(**over):
    return dict(PRESETS["tiny-llama"], **over)


def test_query_heads_must_be_a_multiple_of_kv_heads(tmp_path):
    cfg = _llama(num_attention_heads=5, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ModelConfigError, match=r"num_attention_heads=5 .* num_key_value_heads=2"):
        model_gemms(cfg)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli, ["shapes", "--model", str(tmp_path / "c.json")])
    assert res.exit_code == 1 and "num_attention_heads=5" in res.output and "num_key_value_heads=2" in res.output


def test_a_text_model_ignores_a_stray_text_config():
    own = _llama()
    stray = dict(own, text_config=dict(PRESETS["llama-3-8b"], model_type="llama"))
    assert [(s.name, s.N, s.K) for s in model_gemms(stray)] == [(s.name, s.N, s.K) for s in model_gemms(own)]
    nested = {"model_type": "gemma3", "text_config": dict(own, model_type="gemma3_text")}  # a wrapper: read inside
    assert [(s.N, s.K) for s in model_gemms(nested)] == [(s.N, s.K) for s in model_gemms(own)]


def test_the_checks_trace_under_torch_compile():
    """An op's checks run before its torch.compile branch, so dynamo traces them: a valid value passes there."""
    from gemmtune.checks import check_bool, check_choice, check_int, check_number

    def f(x, causal=True, window=3, mode="a", scale=1.5):
        check_bool("t", "causal", causal)
        check_int("t", "window", window)
        check_choice("t", "mode", mode, ("a", "b"))
        check_number("t", "scale", scale, lo=0, lo_open=True)
        return x * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
