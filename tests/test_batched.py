"""gemmtune.batched_gemm and the batched family's backends (torch.bmm, triton, blaslt).

CPU: the op through dispatch (every layout, strided views, fp32 output, bad input, torch.compile),
config names and the config space, DeepSeek MLA's batched shapes. Kernel cases (kernels/batched_gemm.py
through the triton backend's runners, outputs NaN-poisoned): on a GPU in-process with bf16 too, else in
a subprocess under the Triton interpreter (fp16/fp32). GPU only: every candidate of a few shapes,
CUDA-graph replay equal to eager for every backend, the cuBLASLt batched runner.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, compare, kernel_results, nan_outputs
from tiers import tiered

import gemmtune
from gemmtune.families.batched import BatchedKey, stored

HAS_GPU = torch.cuda.is_available()
_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _make(B, M, N, K, ta, tb, dtype, gen, a_layout="stored", b_layout="stored"):
    """Logical a (B, M, K), b (B, K, N) in the given storage: 'stored' (the key's layout, transposed
    when ta / tb), 'heads' (a as a per-head slice of a (M, B, K + pad) tensor, like MLA's q), 'bcast'
    (one b for every batch: batch stride 0)."""
    a = torch.randn(B, M, K, generator=gen).to(dtype)
    b = (torch.randn(B, K, N, generator=gen) / K**0.5).to(dtype)
    if a_layout == "heads":
        wide = torch.full((M, B, K + 5), float("nan"), dtype=dtype)
        wide[:, :, 2 : 2 + K] = a.transpose(0, 1)
        a = wide[:, :, 2 : 2 + K].transpose(0, 1)
    else:
        a = stored(a, ta)
    if b_layout == "bcast":
        b = stored(b[:1], tb).expand(B, K, N)
    else:
        b = stored(b, tb)
    return a, b


# ---- the op on the CPU (torch.bmm backend) --------------------------------------------------------
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_op_every_layout_matches_bmm(ta, tb):
    g = torch.Generator().manual_seed(int(ta) * 2 + int(tb))
    a = torch.randn(3, 9, 5, generator=g) if ta else torch.randn(3, 5, 9, generator=g)  # M=5, K=9
    b = torch.randn(3, 7, 9, generator=g) if tb else torch.randn(3, 9, 7, generator=g)  # N=7
    y = gemmtune.batched_gemm(a, b, transpose_a=ta, transpose_b=tb)
    ref = torch.bmm(a.transpose(1, 2) if ta else a, b.transpose(1, 2) if tb else b)
    assert y.shape == (3, 5, 7) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref)


def test_op_noncontiguous_inputs_and_fp32_output():
    g = torch.Generator().manual_seed(1)
    a, b = _make(4, 6, 11, 13, False, True, torch.bfloat16, g, a_layout="heads")
    assert not a.is_contiguous() and a.stride(0) == 13 + 5
    y = gemmtune.batched_gemm(a, b, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (4, 6, 11)
    torch.testing.assert_close(y, torch.bmm(a.float(), b.float()), rtol=1e-5, atol=1e-5)
    yb = gemmtune.batched_gemm(a, b)  # default: a's dtype
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), torch.bmm(a.float(), b.float()), rtol=2e-2, atol=2e-2)
    # A row slice of b (K stride 1, N stride > K) with transpose_b: b given as (B, N, K).
    bt = torch.randn(4, 11, 20, generator=g)[:, :, 3:16]
    torch.testing.assert_close(gemmtune.batched_gemm(a.float(), bt, transpose_b=True),
                               torch.bmm(a.float(), bt.transpose(1, 2)))  # fmt: skip


def test_op_empty_and_zero_k():
    assert gemmtune.batched_gemm(torch.randn(2, 0, 4), torch.randn(2, 4, 3)).shape == (2, 0, 3)
    y = gemmtune.batched_gemm(torch.randn(2, 3, 0), torch.randn(2, 0, 5), out_dtype=torch.float16)
    assert y.shape == (2, 3, 5) and y.dtype == torch.float16 and not y.any()


@pytest.mark.parametrize(
    "a, b, kw, match",
    [
        (torch.randn(4, 8), torch.randn(2, 8, 3), {}, "3-D"),
        (torch.randn(2, 4, 8), torch.randn(3, 8, 5), {}, "batch sizes differ: 2 vs 3"),
        (torch.randn(2, 4, 8), torch.randn(2, 9, 5), {}, "K=8 .a. vs K=9"),
        (torch.randn(2, 4, 8), torch.randn(2, 5, 9), {"transpose_b": True}, "K=8 .a. vs K=9"),
        (torch.randn(2, 8, 4), torch.randn(2, 9, 5), {"transpose_a": True}, "K=8 .a. vs K=9"),
        (torch.randn(2, 4, 8), torch.randn(2, 8, 5).half(), {}, "dtype mismatch"),
        (torch.ones(2, 4, 8, dtype=torch.int32), torch.ones(2, 8, 5, dtype=torch.int32), {}, "unsupported dtype"),
        (torch.randn(2, 4, 8), torch.randn(2, 8, 5), {"out_dtype": torch.int8}, "unsupported out_dtype"),
    ],
)
def test_op_bad_input_names_the_problem(a, b, kw, match):
    with pytest.raises(ValueError, match=match) as exc:
        gemmtune.batched_gemm(a, b, **kw)
    assert str(tuple(a.shape)) in str(exc.value)  # the message shows the shapes it got


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph(backend):
    def f(a, b):
        return torch.relu(gemmtune.batched_gemm(a, b, transpose_b=True)) * 2

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 5, 16, generator=g), torch.randn(3, 7, 16, generator=g)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(a, b), torch.relu(torch.bmm(a, b.transpose(1, 2))) * 2)


def test_compiled_graph_contains_the_op_and_opcheck_passes():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    a, b = torch.randn(2, 3, 8), torch.randn(2, 8, 4)
    torch.compile(lambda a, b: gemmtune.batched_gemm(a, b), fullgraph=True, backend=backend)(a, b)
    assert any("gemmtune.batched_gemm" in s for s in seen), seen
    torch.library.opcheck(torch.ops.gemmtune.batched_gemm.default, (a, b, False, False, None))
    torch.library.opcheck(torch.ops.gemmtune.batched_gemm.default,
                          (a.half().transpose(1, 2), b.half(), True, False, torch.float32))  # fmt: skip


def test_autograd_matches_bmm():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 5, 9, generator=g, requires_grad=True)
    b = torch.randn(2, 7, 9, generator=g, requires_grad=True)
    gemmtune.batched_gemm(a, b, transpose_b=True).square().sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    torch.bmm(a, b.transpose(1, 2)).square().sum().backward()
    torch.testing.assert_close(ga, a.grad)
    torch.testing.assert_close(gb, b.grad)


# ---- config names and the candidate space (no kernels run) -----------------------------------------
def test_config_names_round_trip_and_candidates_are_supported():
    from gemmtune.backends.base import stable_solidx
    from gemmtune.backends.batched.triton import TritonBatchedBackend, config_space
    from gemmtune.backends.lib.triton_tiles import SMEM_MARGIN, Hardware
    from gemmtune.kernels.batched_gemm import parse_config

    be = TritonBatchedBackend()
    hw = Hardware(132, 227 * 1024, True)
    fp32_tn = BatchedKey(3, 33, 37, 67, torch.float32, torch.float32, True, False)
    keys = [BatchedKey(16, 1, 1280, 8192), BatchedKey(16, 300, 8192, 1024), BatchedKey(128, 4, 512, 128),
            BatchedKey(16, 64, 128, 512), fp32_tn]  # fmt: skip
    for key in keys:
        cfgs = config_space(key, hw)
        assert 3 <= len(cfgs) <= 60 and len({c.name for c in cfgs}) == len(cfgs), key
        for cfg in cfgs:
            assert parse_config(cfg.name) == cfg
            assert cfg.smem_bytes(key.dtype.itemsize) + SMEM_MARGIN <= hw.smem
            assert cfg.bm <= max(64, 1 << (key.M - 1).bit_length())  # no tile far taller than M
            sol = be.solution_from_row(stable_solidx(cfg.name), cfg.name, cfg.split_k)
            assert sol.kernel_name == cfg.name and sol.libtype == "triton" and sol.splitk == cfg.split_k
            assert be.supports(sol, key, torch.device("cpu"))


def test_split_k_only_when_batches_leave_sms_idle():
    from gemmtune.backends.batched.triton import config_space
    from gemmtune.backends.lib.triton_tiles import Hardware

    hw = Hardware(132, 227 * 1024, True)
    # MLA attn @ W_UV at tp 8, decode: 16 heads x 1 tile, K=512 -> split-K offered, both reductions.
    small = config_space(BatchedKey(16, 1, 128, 512), hw)
    assert {c.sk_mode for c in small if c.split_k > 1} == {"r", "f"}
    assert all(c.split_k == 1 or 16 * -(-128 // c.bn) * c.split_k <= 2.2 * 132 for c in small)
    # Over 128 heads (tp 1) a tile grid of >= 256 programs is not split; nor is K=128 (too short).
    tp1 = config_space(BatchedKey(128, 1, 128, 512), hw)
    assert any(c.bn <= 64 for c in tp1)
    assert all(c.split_k == 1 for c in tp1 if c.bn <= 64)
    assert all(c.split_k == 1 for c in config_space(BatchedKey(16, 1, 512, 128), hw))


@pytest.mark.parametrize(
    "name",
    ["bmm_bm64_bn64_bk32_g8_w4_s3_sk2", "bmm_bm64_bn64_bk32_g8_w4_s3_sk1r", "bmm_bm60_bn64_bk32_g8_w4_s3_sk1",
     "bmm_bm8_bn64_bk32_g8_w4_s3_sk1", "bmm_bm64_bn64_bk32_g8_w3_s3_sk1", "bmm_bm64_bn64_bk32_g8_w4_s3_sk01",
     "tg_bm64_bn64_bk32_g8_w4_s3_sk1", "native", ""],
)  # fmt: skip
def test_unknown_names_give_none(name):
    from gemmtune.backends.batched.triton import TritonBatchedBackend

    assert TritonBatchedBackend().solution_from_row(0, name, 0) is None


def test_backend_registry_and_availability():
    from gemmtune import backends

    be = backends.get("triton", "batched")
    assert be is not None and be.family == "batched" and type(be).__name__ == "TritonBatchedBackend"
    assert backends.get("torch", "batched").family == "batched"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert be.is_available(torch.device("cpu")) == interp
    key = BatchedKey(2, 3, 4, 5, torch.int32, torch.int32)
    assert be.candidates(key, torch.device("cpu")) == []


def test_compile_signature_ignores_m_unless_it_sets_a_stride():
    from gemmtune.backends.batched.triton import compile_signature, stored_strides
    from gemmtune.kernels.batched_gemm import parse_config

    cfg = parse_config("bmm_bm16_bn64_bk128_g8_w4_s4_sk3f")
    sig = lambda **kw: compile_signature(cfg, BatchedKey(16, **kw))
    assert stored_strides(BatchedKey(2, 3, 4, 5, transA=True, transB=True)) == ((15, 1, 3), (20, 1, 5), (12, 4, 1))
    assert sig(M=1, N=128, K=512) == sig(M=7, N=128, K=512)  # M, and the split factor, are runtime
    assert sig(M=1, N=128, K=512, transB=True) != sig(M=1, N=128, K=512, transB=False)
    assert sig(M=16, N=128, K=512, transA=True) != sig(M=17, N=128, K=512, transA=True)  # a's K stride is M


# ---- the cuBLASLt batched layouts, checked by reading them back (no cuBLASLt needed) ---------------
def _read_back(t: torch.Tensor, entry, i: int) -> torch.Tensor:
    """op() of the column-major matrix a cuBLASLt layout entry describes, in batch i of t's storage."""
    from gemmtune.backends.lib.blaslt import OP_N

    op, rows, cols, ld, batch_stride = entry
    view = t.as_strided((rows, cols), (1, ld), t.storage_offset() + i * batch_stride)
    return view if op == OP_N else view.t()


@pytest.mark.parametrize("B, M, N, K", [(3, 5, 16, 8), (2, 1, 8, 24), (2, 4, 1, 16), (1, 8, 8, 1)])
@pytest.mark.parametrize("ta, tb, al, bl", [
    (False, False, "stored", "stored"), (False, True, "stored", "stored"), (True, False, "stored", "stored"),
    (True, True, "stored", "stored"), (False, True, "heads", "stored"), (True, False, "stored", "bcast"),
])  # fmt: skip
def test_blaslt_layouts_read_the_operands_in_place(B, M, N, K, ta, tb, al, bl):
    from gemmtune.backends.batched.blaslt import blas_layout

    a, b = _make(B, M, N, K, ta, tb, torch.float32, torch.Generator().manual_seed(B * M + N), al, bl)
    key = BatchedKey(B, M, N, K, torch.float32, torch.float32, ta, tb)
    layout = blas_layout(key, a.stride(), b.stride(), aligned=False)
    assert layout is not None
    la, lb = layout  # cuBLASLt's A is b, its B is a: c^T = b^T @ a^T
    for i in range(B):
        assert torch.equal(_read_back(b, la, i), b[i].t()) and torch.equal(_read_back(a, lb, i), a[i].t())


def test_blaslt_layouts_refuse_what_must_be_copied():
    from gemmtune.backends.batched.blaslt import blas_layout

    key = BatchedKey(2, 4, 8, 16, torch.float16, torch.float16)
    a, b = torch.randn(2, 8, 32)[:, ::2, ::2], torch.randn(2, 16, 8)  # a: no unit stride
    assert blas_layout(key, a.stride(), b.stride(), aligned=False) is None
    odd = BatchedKey(2, 4, 8, 67, torch.float16, torch.float16)  # rows of 134 bytes
    a, b = torch.randn(2, 4, 67), torch.randn(2, 67, 8)
    assert blas_layout(odd, a.stride(), b.stride()) is None
    assert blas_layout(odd, a.stride(), b.stride(), aligned=False) is not None
    assert blas_layout(key, (64, 16, 1), (128, 8, 1)) is not None


# ---- DeepSeek MLA's batched GEMMs as shapes -------------------------------------------------------
def test_deepseek_v3_mla_batched_shapes():
    from gemmtune.tuner.model_shapes import PRESETS, BatchedShape, batched_gemms, model_keys

    cfg = PRESETS["deepseek-v3"]
    assert batched_gemms(cfg, 1) == [
        BatchedShape("mla_q_nope_w_uk", 128, 512, 128, True, 61),
        BatchedShape("mla_attn_w_uv", 128, 128, 512, True, 61),
    ]
    assert [(s.B, s.N, s.K) for s in batched_gemms(cfg, 8)] == [(16, 512, 128), (16, 128, 512)]
    keys = model_keys("batched", cfg, 8, [1, 64], torch.bfloat16)
    assert BatchedKey(16, 64, 128, 512, torch.bfloat16, torch.bfloat16, False, True) in keys and len(keys) == 4


def test_batched_shapes_of_other_models_and_bad_tp():
    from gemmtune.tuner.model_shapes import PRESETS, ModelConfigError, batched_gemms

    assert batched_gemms(PRESETS["llama-3-8b"], 1) == []
    assert batched_gemms(PRESETS["qwen3-30b-a3b"], 4) == []
    v2 = dict(PRESETS["deepseek-v3"], model_type="deepseek_v2", num_attention_heads=16, q_lora_rank=None)
    assert [(s.B, s.K, s.N) for s in batched_gemms(v2, 2)] == [(8, 128, 512), (8, 512, 128)]
    with pytest.raises(ModelConfigError, match="divisible"):
        batched_gemms(PRESETS["deepseek-v3"], 3)
    with pytest.raises(ModelConfigError, match="tp"):
        batched_gemms(PRESETS["deepseek-v3"], 0)
    with pytest.raises(ModelConfigError, match="unsupported"):
        batched_gemms({"model_type": "gpt2"}, 1)


def test_bad_operands_raise_value_error():
    from gemmtune.kernels.batched_gemm import BmmConfig, batched_gemm_triton

    cfg = BmmConfig(16, 16, 16)
    with pytest.raises(ValueError, match="3-D"):
        batched_gemm_triton(torch.randn(4, 8), torch.randn(1, 8, 4), cfg)
    with pytest.raises(ValueError, match="do not match"):
        batched_gemm_triton(torch.randn(2, 4, 8), torch.randn(2, 9, 4), cfg)
    with pytest.raises(ValueError, match="dtypes"):
        batched_gemm_triton(torch.randn(2, 4, 8), torch.randn(2, 8, 4).double(), cfg)
    with pytest.raises(ValueError, match="split-K"):
        BmmConfig(16, 16, 16, split_k=2).validate()


# ---- kernel cases: GPU in-process, else the Triton interpreter in a subprocess ---------------------
# (id, config, dtype, out dtype, B, M, N, K, transA, transB, a layout, b layout). B, M, N, K are not
# multiples of the blocks (one case has an even K); split-K off, 'r' and 'f'; every layout.
_CFG_PLAIN = "bmm_bm16_bn32_bk16_g8_w4_s2_sk1"
_CFG_FIX = "bmm_bm16_bn16_bk16_g1_w4_s2_sk4f"
_CFG_RED = "bmm_bm32_bn32_bk32_g2_w4_s2_sk3r"
_SHAPES = [
    (_CFG_PLAIN, 3, 5, 37, 67, "stored", "stored"),
    (_CFG_FIX, 3, 5, 37, 67, "stored", "stored"),
    (_CFG_RED, 3, 33, 129, 200, "stored", "stored"),
    ("bmm_bm64_bn32_bk32_g8_w4_s2_sk1", 2, 130, 37, 67, "stored", "stored"),
    ("bmm_bm32_bn64_bk32_g4_w4_s2_sk2f", 3, 33, 37, 200, "heads", "stored"),
    ("bmm_bm16_bn32_bk32_g8_w4_s2_sk2r", 3, 5, 37, 67, "stored", "bcast"),
    (_CFG_PLAIN, 2, 17, 40, 64, "stored", "stored"),
]
CASES = []
for _dt, _odt in (("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")):
    for _i, (_cfg, _B, _M, _N, _K, _al, _bl) in enumerate(_SHAPES):
        for _ta, _tb in ((False, False), (False, True), (True, False), (True, True)):
            if _i >= 2 and ((_ta, _tb) not in ((False, True), (True, False)) or _odt != _dt) or _al == "heads" and _ta:
                continue  # every layout on the first shapes, two on the rest; fp16 -> fp32 on the first
            CASES.append((f"{_cfg[4:]}-{_dt}>{_odt}-B{_B}M{_M}N{_N}K{_K}-{'TN'[_ta]}{'TN'[_tb]}-{_al}-{_bl}",
                          _cfg, _dt, _odt, _B, _M, _N, _K, _ta, _tb, _al, _bl))  # fmt: skip
GPU_CASES = [(c[0].replace("fp16", "bf16"), c[1], "bf16", *c[3:]) for c in CASES if c[2] == "fp16"]
_ST = "stored"
GPU_CASES += [  # MLA-like and aiter-like shapes with the block sizes the tuner offers
    ("mla-wuv-tp8", "bmm_bm16_bn128_bk64_g8_w4_s5_sk2f", "bf16", "bf16", 16, 3, 128, 512, False, True, "heads", _ST),
    ("mla-wuk-tp8", "bmm_bm16_bn64_bk128_g8_w4_s4_sk1", "bf16", "bf16", 16, 7, 512, 128, False, True, "heads", _ST),
    ("aiter-like", "bmm_bm64_bn128_bk64_g8_w4_s4_sk3r", "bf16", "bf16", 4, 33, 1280, 1000, False, True, _ST, _ST),
    ("big-tiles", "bmm_bm128_bn256_bk64_g8_w8_s3_sk1", "bf16", "fp32", 3, 300, 257, 520, True, False, _ST, _ST),
]  # fmt: skip
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def _in_default(case) -> bool:
    """The default tier: every config and layout once in 16 bits, every transpose pair on the plain config,
    one fp32 and one 16-bit -> fp32 case; the rest of the sweep is slow."""
    cfg, dt, odt, m, ta, tb = case[1], case[2], case[3], case[5], case[8], case[9]
    if dt != odt:
        return cfg == _CFG_FIX and (ta, tb) == (False, True)
    if dt == "fp32":
        return cfg == _CFG_PLAIN and m == 5 and (ta, tb) == (False, True)
    return (ta, tb) == (False, True) or (cfg == _CFG_PLAIN and m == 5)


# Max error over max |y|, by output dtype: one rounding of the fp32 result (fp32 outputs: summation order).
TOL = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2}


def run_cases(cases, device: str) -> dict:
    from gemmtune.kernels import batched_gemm as kb

    with nan_outputs(kb):
        out = {c[0]: _run_case(c, device) for c in cases}
        out["dispatch"] = _dispatch_case(device)
    return out


def _run_case(case, device: str) -> dict:
    from gemmtune.backends.batched.triton import TritonBatchedBackend
    from gemmtune.kernels.batched_gemm import batched_gemm_ref

    name, cfg, dt, odt, B, M, N, K, ta, tb, al, bl = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    a, b = (t.to(device) for t in _make(B, M, N, K, ta, tb, _DT[dt], gen, al, bl))
    key = BatchedKey(B, M, N, K, _DT[dt], _DT[odt], ta, tb)
    be = TritonBatchedBackend()
    run = be.make_runner(be.solution_from_row(0, cfg, 0), key, torch.device(device))
    y = run(a, b)
    y32 = batched_gemm_ref(a, b, torch.float32)
    res = compare(y, batched_gemm_ref(a, b, _DT[odt]), y32, (B, M, N), _DT[odt], y32.abs().max().item() or 1.0)
    res["layout_ok"] = (a.stride(-1) != 1) == (ta and al != "heads") and (b.stride(0) == 0) == (bl == "bcast")
    if cfg.endswith("f"):  # the arrival counters re-arm themselves: a second call is bit-identical
        res["repeat_equal"] = bool(torch.equal(y, run(a, b)))
    return res


def _dispatch_case(device: str) -> dict:
    """A batched tuned row with libtype triton: gemmtune.batched_gemm resolves to this backend."""
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve
    from gemmtune.families import get

    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    key = BatchedKey(3, 6, 40, 72, dtype, dtype, False, True)
    name = "bmm_bm16_bn32_bk16_g8_w4_s2_sk2f"
    ident = identity(torch.device(device))
    row = TunedRow(ident.gfx, ident.cu_num, key, "triton", 0, 2, 5.0, name, family=get("batched"))
    gemmtune.set_config(ConfigTable([row], family="batched"))
    try:
        res = resolve(key, device, family="batched")
        gen = torch.Generator().manual_seed(5)
        a = torch.randn(3, 6, 72, generator=gen).to(dtype).to(device)
        w = (torch.randn(3, 40, 72, generator=gen) / 9).to(dtype).to(device)  # (B, N, K): transpose_b
        y = gemmtune.batched_gemm(a, w, transpose_b=True)
        y32 = torch.bmm(a.float(), w.float().transpose(1, 2))
        err = (y.float() - y32).abs().max().item() / y32.abs().max().item()
        return {"libtype": res.solution.libtype, "kernel": res.solution.kernel_name,
                "nan": bool(torch.isnan(y).any()), "err": err}  # fmt: skip
    finally:
        gemmtune.set_config(None)


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES, GPU_CASES, request)


@pytest.mark.parametrize("case", tiered(ALL, _in_default), ids=[c[0] for c in ALL])
def test_kernel_matches_reference(case, results):
    r = results[case[0]]
    tol = TOL[case[3]]
    assert r["shape_ok"] and not r["nan"], r
    assert r["layout_ok"], f"the case did not build the layout it names: {r}"
    assert r["vs_ref"] <= tol and r["vs_fp32"] <= tol, r
    if "repeat_equal" in r:
        assert r["repeat_equal"], r


def test_tuned_row_dispatches_to_triton(results):
    r = results["dispatch"]
    assert r["libtype"] == "triton" and r["kernel"] == "bmm_bm16_bn32_bk16_g8_w4_s2_sk2f", r
    assert not r["nan"] and r["err"] < 1e-2, r


# ---- GPU only ---------------------------------------------------------------------------------------
def _gpu_inputs(key: BatchedKey, gpu, seed=0):
    from gemmtune.families import get

    return get("batched").make_inputs(key, gpu, 1, seed)[0]


_ALLOCATES_OUTPUT = {"triton": "gemmtune.kernels.batched_gemm", "blaslt": "gemmtune.backends.batched.blaslt"}


_EVERY_KEYS = [
    BatchedKey(16, 1, 128, 512), BatchedKey(16, 5, 512, 128), BatchedKey(16, 37, 1280, 2000),
    BatchedKey(2, 300, 1000, 1024, transA=True, transB=False), BatchedKey(128, 2, 128, 512, outdtype=torch.float32),
    BatchedKey(3, 33, 37, 67, torch.float16, torch.float16, True, True),
]  # fmt: skip


@pytest.fixture
def triton_precompiled(key):
    """Every triton candidate of this test's key compiled in parallel processes (Triton's disk cache): only
    the keys a run selects are compiled."""
    from gemmtune.backends.batched.triton import TritonBatchedBackend, precompile

    gpu = torch.device("cuda")
    be = TritonBatchedBackend()
    return precompile([(s, key) for s in be.candidates(key, gpu)], gpu, workers=8)


@pytest.mark.gpu
@pytest.mark.parametrize("libtype", ["triton", "blaslt"])
# The default tier keeps the odd-shaped key: masks in every dimension, both operands transposed, fp16.
@pytest.mark.parametrize(
    "key", tiered(_EVERY_KEYS, lambda k: k.transA and k.transB), ids=lambda k: k.describe().replace(" ", "_")
)
def test_gpu_every_candidate_matches_fp32_reference(gpu, key, libtype, request):
    """Every candidate, on the tuner's inputs and the views the op may pass (check_variants), into
    NaN-poisoned outputs."""
    import importlib

    if libtype == "triton":
        assert request.getfixturevalue("triton_precompiled") == [], "some candidates failed to compile"

    from gemmtune import backends
    from gemmtune.families import get

    fam, be = get("batched"), backends.get(libtype, "batched")
    if be is None or not be.is_available(gpu):
        pytest.skip(f"batched {libtype} backend unavailable here")
    a, b = _gpu_inputs(key, gpu)
    ref = fam.reference(key, (a, b))
    sols = be.candidates(key, gpu)
    assert sols
    with nan_outputs(importlib.import_module(_ALLOCATES_OUTPUT[libtype])):
        for sol in sols:
            run = be.make_runner(sol, key, gpu)
            for what, inputs, _shape in [("plain", (a, b), None), *fam.check_variants(key, (a, b))]:
                y = run(*inputs)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert y.shape == (key.B, key.M, key.N) and y.dtype == key.outdtype, (sol.kernel_name, what)
                assert err < fam.error_threshold(key), (sol.kernel_name, what, err)


def _graph_equals_eager(run, inputs):
    eager = run(*inputs)
    for _ in range(2):
        assert torch.equal(eager, run(*inputs)), "not deterministic"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*inputs)
    for _ in range(3):  # split-K arrival counters must be re-armed after every replay
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from eager"


@pytest.mark.gpu
@pytest.mark.parametrize("libtype", ["torch", "triton", "blaslt"])
def test_gpu_graph_replay_equals_eager(gpu, libtype):
    from gemmtune import backends

    be = backends.get(libtype, "batched")
    if be is None or not be.is_available(gpu):
        pytest.skip(f"batched {libtype} backend unavailable here")
    for key in [BatchedKey(16, 1, 128, 512), BatchedKey(16, 33, 1280, 1024), BatchedKey(128, 4, 512, 128)]:
        a, b = _gpu_inputs(key, gpu)
        sols = be.candidates(key, gpu)
        picked = {}
        for sol in sols:  # one per reduction kind (none, 'r', 'f' / cuBLASLt split-K)
            picked.setdefault((sol.splitk > 1, sol.kernel_name[-1]), sol)
        for sol in list(picked.values())[:6]:
            try:
                _graph_equals_eager(be.make_runner(sol, key, gpu), (a, b))
            except AssertionError as exc:
                raise AssertionError(f"{sol.describe()} on {key.describe()}: {exc}") from None


@pytest.mark.gpu
def test_gpu_op_dispatches_a_tuned_row_inside_a_graph(gpu):
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve
    from gemmtune.families import get

    key = BatchedKey(16, 2, 128, 512, torch.bfloat16, torch.bfloat16, False, True)
    ident = identity(gpu)
    name = "bmm_bm16_bn128_bk64_g8_w4_s5_sk2f"
    row = TunedRow(ident.gfx, ident.cu_num, key, "triton", 0, 2, 3.0, name, family=get("batched"))
    gemmtune.set_config(ConfigTable([row], family="batched"))
    try:
        assert resolve(key, gpu, family="batched").solution.kernel_name == name
        a = torch.randn(16, 2, 512, device=gpu, dtype=torch.bfloat16)
        w = torch.randn(16, 128, 512, device=gpu, dtype=torch.bfloat16) / 22
        _graph_equals_eager(lambda a, w: gemmtune.batched_gemm(a, w, transpose_b=True), (a, w))
        ref = torch.bmm(a.float(), w.float().transpose(1, 2))
        y = gemmtune.batched_gemm(a, w, transpose_b=True)
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    finally:
        gemmtune.set_config(None)


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES), "cpu")))
