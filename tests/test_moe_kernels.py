"""Triton fused-MoE kernels (kernels/fused_moe.py) against the fp32 loop reference: on the CPU through
Triton's interpreter (fp32/fp16) in a subprocess, on a GPU in bf16/fp16 too, plus CUDA-graph replay
equal to eager. Every output buffer the kernels write starts NaN, so a skipped element fails.

Cases: odd sizes (H, I not multiples of any block, E not a power of two), experts with no tokens,
all tokens on one expert, topk 1/2/8, direct and sorted routing, split-K, ungated, doweight_stage1,
expert parallelism (expert_map) and a fused shared expert. Mixed pairs run a torch._grouped_mm stage
(backends/fmoe/stages.py, GM) with a Triton one, and two GM stages with the Triton combine: rows past the
last expert's group, which torch._grouped_mm leaves unwritten, are made NaN too. Stage 1 split over H
(the last split of each tile sums the fp32 partials in split order and finishes the rows) runs the
same kinds of cases at decode sizes, with splits that leave a split no K step, with a Triton or GM
stage 2, twice (the arrival counters re-arm: the second call is bit-identical), and alone against the
stage-1 reference as the tuner checks it. The direct grid over slots (fewer slots than experts) runs
with experts hit by several slots (tokens sharing experts, up to two BLOCK_M chunks of one expert) and
with no expert hit twice, split and unsplit. Stage 2 by token (a program per token and N tile that sums
the token's experts itself) runs every kind of routing column, split over them or not, twice (its split's
counters re-arm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import chosen_cases, selected_cases_env
from moe_cases import make_case, nan_buffers
from tiers import tiered, tiered_at

# (dtype, T, H, I, E, topk, routing, direct, bm, split_k, extra)
# routing: "random" (softmax top-k of random logits), "one" (every token on expert E-1), "low" (ids
# only among the first topk+1 experts: the others receive nothing), "rep" (topk+1 experts drawn from all
# E, every token takes topk of them: each is hit by ~T slots), "spread" (no expert hit twice). extra: "",
# "ungated", "doweight", "ep" (8 global experts, this rank holds E of them), "shared" (1 shared expert), "badid",
# "idsview" (the router's ids a column slice of a wider buffer: the direct kernel's id load is not flat).
INTERP_CASES = [
    ("fp32", 7, 40, 36, 5, 2, "random", True, 16, 1, ""),
    ("fp32", 7, 40, 36, 5, 2, "random", False, 16, 2, ""),
    ("fp16", 1, 72, 40, 7, 1, "random", True, 16, 2, ""),
    ("fp16", 13, 56, 24, 6, 2, "one", True, 16, 1, ""),
    ("fp16", 13, 56, 24, 6, 2, "one", False, 32, 1, ""),
    ("fp32", 9, 48, 20, 11, 8, "random", False, 16, 1, ""),
    ("fp16", 5, 48, 20, 11, 8, "low", True, 16, 1, ""),
    ("fp32", 6, 40, 28, 5, 2, "random", True, 16, 1, "ungated"),
    ("fp32", 6, 40, 28, 5, 2, "random", False, 16, 1, "doweight"),
    ("fp32", 10, 40, 28, 3, 2, "random", True, 16, 2, "ep"),
    ("fp16", 10, 40, 28, 3, 2, "random", False, 16, 1, "ep"),
    ("fp32", 4, 40, 28, 5, 2, "random", True, 16, 1, "shared"),
    ("fp32", 4, 40, 28, 5, 2, "random", False, 16, 2, "shared"),
    ("fp32", 3, 41, 37, 11, 2, "one", True, 16, 1, ""),  # fewer slots than experts, two experts hit thrice
    ("fp32", 7, 40, 36, 5, 2, "random", True, 16, 1, "idsview"),
    ("fp32", 4, 40, 28, 5, 2, "random", True, 16, 1, "badid"),
]
GPU_CASES = [
    ("bf16", 1, 4096, 1792, 8, 2, "random", True, 16, 4, ""),
    ("bf16", 16, 2048, 768, 128, 8, "random", True, 16, 2, ""),
    ("bf16", 64, 1000, 520, 13, 8, "random", False, 32, 1, ""),
    ("bf16", 300, 1000, 520, 13, 2, "one", False, 64, 1, ""),
    ("fp16", 1000, 1024, 384, 60, 4, "random", False, 64, 1, "shared"),
    ("bf16", 4096, 512, 256, 7, 2, "low", False, 128, 1, ""),
    ("bf16", 33, 512, 256, 16, 4, "random", True, 32, 1, "ep"),
]


# (case, stage 1, stage 2): "tri" a Triton config (the case's), "skN" the same split N ways over H, "gm"
# a torch._grouped_mm stage. fp32 cases need H, I multiples of 4, fp16 of 8 (16-byte rows) for "gm".
MIX_CASES = [
    (INTERP_CASES[0], "tri", "gm"),
    (INTERP_CASES[1], "gm", "tri"),
    (INTERP_CASES[1], "gm", "gm"),
    (INTERP_CASES[4], "tri", "gm"),
    (INTERP_CASES[5], "gm", "tri"),
    (("fp32", 9, 48, 20, 11, 8, "random", False, 16, 1, "doweight"), "gm", "gm"),
    (INTERP_CASES[9], "gm", "tri"),
    (INTERP_CASES[12], "tri", "gm"),
    (INTERP_CASES[-1], "gm", "gm"),
]
# Stage 1 split over H at decode sizes. H = 73 is 3 BLOCK_K steps of 32: split 4 leaves one split none.
SPLIT1_CASES = [
    (("fp32", 1, 73, 37, 5, 1, "random", True, 16, 1, ""), "sk2", "tri"),
    (("fp16", 3, 73, 37, 6, 2, "random", True, 16, 2, ""), "sk4", "tri"),
    (("fp32", 3, 73, 37, 11, 2, "one", True, 16, 1, ""), "sk3", "tri"),
    (("fp16", 5, 73, 37, 6, 2, "one", True, 32, 1, ""), "sk2", "tri"),
    (("fp32", 20, 73, 37, 6, 2, "one", True, 16, 1, ""), "sk2", "tri"),  # two BLOCK_M chunks of one expert
    (("fp32", 5, 73, 37, 9, 8, "random", False, 16, 2, "doweight"), "sk3", "tri"),
    (("fp32", 2, 73, 37, 11, 8, "random", True, 16, 1, "doweight"), "sk2", "tri"),
    (("fp16", 4, 73, 37, 5, 2, "random", True, 16, 1, "ungated"), "sk2", "tri"),
    (("fp32", 4, 73, 37, 3, 2, "random", True, 16, 1, "ep"), "sk2", "tri"),
    (("fp32", 5, 73, 37, 3, 2, "random", False, 16, 1, "ep"), "sk4", "tri"),
    (("fp32", 3, 73, 37, 5, 2, "random", True, 16, 1, "shared"), "sk2", "tri"),
    (("fp32", 4, 73, 37, 5, 2, "random", True, 16, 2, "badid"), "sk2", "tri"),
    (("fp32", 4, 72, 36, 5, 2, "random", True, 16, 1, "doweight"), "sk2", "gm"),
    (("fp32", 5, 72, 36, 9, 8, "random", False, 16, 1, ""), "sk4", "gm"),
]
ALONE_CASES = SPLIT1_CASES[:5] + SPLIT1_CASES[5:10:2]  # stage 1 alone: both modes, doweight, ungated, ep
# The direct grid over slots (fewer slots than experts): program p takes slot p's expert unless an earlier
# slot has it. Experts hit by several slots ("rep"; T = 40 at topk 1 puts ~20 slots on each of 2 experts:
# two BLOCK_M chunks of one program) and no expert hit twice ("spread"), stage 1 unsplit and split 2 / 3
# (H = 73: split 3 leaves no split idle, each walks one BLOCK_K step; split 4 leaves one none).
SLOT_GRID_CASES = [
    *((("fp32", 4, 73, 37, 40, 8, "rep", True, 16, 1, ""), s1, "tri") for s1 in ("tri", "sk2", "sk3")),
    (("fp16", 3, 73, 37, 32, 6, "rep", True, 16, 2, ""), "sk2", "tri"),
    (("fp32", 5, 73, 37, 32, 4, "rep", True, 16, 1, "doweight"), "sk3", "tri"),
    (("fp32", 5, 73, 37, 32, 4, "rep", True, 16, 1, "shared"), "sk2", "tri"),  # the shared expert: every token
    (("fp32", 4, 73, 37, 33, 5, "rep", True, 16, 1, "ungated"), "sk4", "tri"),
    (("fp32", 40, 73, 37, 48, 1, "rep", True, 16, 1, ""), "tri", "tri"),
    (("fp32", 40, 73, 37, 48, 1, "rep", True, 16, 1, ""), "sk2", "tri"),
    (("fp32", 4, 73, 37, 40, 8, "spread", True, 16, 1, ""), "tri", "tri"),
    (("fp32", 4, 73, 37, 40, 8, "spread", True, 16, 1, ""), "sk2", "tri"),
    (("fp16", 2, 73, 37, 64, 8, "spread", True, 16, 2, ""), "sk3", "tri"),
    (("fp32", 4, 72, 36, 40, 8, "rep", True, 16, 1, ""), "sk2", "gm"),
    (("fp32", 4, 73, 37, 40, 8, "rep", True, 16, 1, "idsview"), "tri", "tri"),
]
SLOT_GRID_ALONE = [SLOT_GRID_CASES[1], SLOT_GRID_CASES[8], SLOT_GRID_CASES[10]]
# Stage 2 by token ("tokN": a program per token and N tile sums the token's experts, split N ways over its
# routing columns; the last split sums the partials): every kind of routing column (other rank, bad id,
# shared expert, doweight), tokens sharing experts, a split past the columns (tok3 of topk 2), splits
# that leave a split one column or none, N and K past a block, after a Triton or GM stage 1.
TOKEN_CASES = [
    (("fp32", 7, 40, 36, 5, 2, "random", True, 16, 1, ""), "tri", "tok1"),
    (("fp32", 7, 40, 36, 5, 2, "random", True, 16, 1, ""), "tri", "tok2"),
    (("fp16", 1, 72, 40, 7, 1, "random", True, 16, 1, ""), "tri", "tok1"),
    (("fp32", 5, 73, 37, 11, 8, "random", True, 16, 1, ""), "tri", "tok4"),
    (("fp32", 5, 73, 37, 11, 8, "random", True, 16, 1, ""), "tri", "tok3"),
    (("fp16", 5, 48, 20, 11, 8, "low", True, 16, 1, ""), "tri", "tok2"),
    (("fp32", 4, 73, 37, 40, 8, "rep", True, 16, 1, ""), "sk2", "tok2"),
    (("fp32", 6, 40, 28, 5, 2, "random", True, 16, 1, "ungated"), "tri", "tok2"),
    (("fp32", 6, 40, 28, 5, 2, "random", True, 16, 1, "doweight"), "tri", "tok3"),
    (("fp32", 10, 40, 28, 3, 2, "random", True, 16, 1, "ep"), "tri", "tok2"),
    (("fp32", 4, 40, 28, 5, 2, "random", True, 16, 1, "shared"), "tri", "tok2"),
    (("fp32", 4, 40, 28, 5, 2, "random", True, 16, 1, "badid"), "tri", "tok2"),
    (("fp32", 4, 72, 36, 5, 2, "random", True, 16, 1, "shared"), "gm", "tok4"),
]
GPU_TOKEN_CASES = [
    (("bf16", 1, 2047, 383, 128, 8, "random", True, 16, 1, ""), "tri", "tok4"),  # the default's split at T = 1
    (("bf16", 4, 2048, 384, 128, 8, "random", True, 16, 1, ""), "tri", "tok1"),
    (("bf16", 2, 7168, 256, 256, 8, "random", True, 16, 1, "shared"), "tri", "tok2"),
    (("bf16", 8, 1000, 520, 64, 6, "rep", True, 16, 1, "doweight"), "tri", "tok1"),
    (("bf16", 3, 1024, 384, 3, 2, "random", True, 16, 1, "ep"), "tri", "tok2"),
    (("bf16", 2, 1024, 384, 16, 4, "random", True, 16, 1, "badid"), "tri", "tok4"),
]
GPU_MIX_CASES = [
    (GPU_CASES[2], "tri", "gm"),
    (GPU_CASES[3], "gm", "tri"),
    (GPU_CASES[5], "gm", "gm"),
    (GPU_CASES[6], "gm", "tri"),
    (("bf16", 1000, 1024, 384, 60, 4, "random", False, 64, 1, "shared"), "tri", "gm"),
    (("bf16", 2048, 512, 256, 128, 8, "random", False, 64, 1, ""), "gm", "gm"),  # Qwen3-30B-A3B routing
    (("bf16", 700, 512, 256, 60, 4, "random", False, 64, 1, "shared"), "gm", "gm"),
]
GPU_SPLIT1_CASES = [
    (("bf16", 1, 7168, 256, 64, 8, "random", True, 16, 1, ""), "sk8", "tri"),  # DeepSeek-V3-like experts
    (("bf16", 4, 2047, 383, 128, 8, "random", True, 16, 2, "doweight"), "sk4", "tri"),
    (("bf16", 3, 1000, 520, 13, 8, "random", False, 16, 1, "shared"), "sk4", "tri"),
    (("bf16", 2, 1024, 384, 3, 2, "random", True, 16, 1, "ep"), "sk2", "gm"),
]


def stage1_of(s1: str, direct: bool, bm: int, bn: int, bk: int, stages: int):
    """Stage 1 as a case names it: "tri", "skN" (split N ways over H) or "gm"."""
    from gemmtune.backends.fmoe.stages import GM
    from gemmtune.kernels.fused_moe import MoeGemmConfig

    if s1 == "gm":
        return GM
    return MoeGemmConfig(1, direct, bm, bn, bk, int(s1[2:]) if s1.startswith("sk") else 1, 4, stages)


def run_case(case, device="cpu", s1="tri", s2="tri") -> dict:
    from gemmtune.backends.fmoe.stages import GM, pair_runner
    from gemmtune.kernels.fused_moe import MoeGemmConfig, fused_moe_ref

    _, _, _, _, _, _, _, direct, bm, sk, extra = case
    key, inputs = make_case(case, device)
    c1 = stage1_of(s1, direct, bm, 32, 32, 2)
    if s2.startswith("tok"):
        c2 = MoeGemmConfig(2, True, 16, 16, 32, int(s2[3:]), 4, 2, by_token=True)
    else:
        c2 = MoeGemmConfig(2, direct, bm, 64, 32, sk, 4, 2) if s2 == "tri" else GM
    run = pair_runner(key, c1, c2)
    with nan_buffers():
        y = run(*inputs)
        y2 = run(*inputs) if s1.startswith("sk") or s2.startswith("tok") else None
    # bit-identical, NaN rows (a bad id's token) included
    repeat_equal = bool(((y == y2) | (y.isnan() & y2.isnan())).all()) if y2 is not None else None
    hidden, w1, w2, tw, ids, emap = (t if t is None else t.cpu() for t in inputs)
    act = "silu"
    ref = fused_moe_ref(hidden.float(), w1.float(), w2.float(), tw, ids, act, emap, key.shared_expert)
    y = y.float().cpu()
    nan_rows = torch.isnan(y).any(1)
    want_nan = torch.isnan(ref).any(1)
    ok = ~want_nan
    err = ((y[ok] - ref[ok]).norm() / ref[ok].norm().clamp_min(1e-30)).item() if ok.any() else 0.0
    return {"shape_ok": list(y.shape) == [key.token, key.model_dim], "nan_rows": nan_rows.tolist(),
            "want_nan_rows": want_nan.tolist(), "err": err, "repeat_equal": repeat_equal}  # fmt: skip


def run_stage1_alone(case, s1: str, device="cpu") -> dict:
    """Stage 1 alone as the tuner checks it (the family's stage result against its stage reference)."""
    from gemmtune.backends.fmoe.stages import stage_runner
    from gemmtune.families.fmoe import FAMILY

    key, inputs = make_case(case, device)
    with nan_buffers():
        out = stage_runner(key, 1, stage1_of(s1, case[7], case[8], 32, 32, 2))(*inputs)
    y = FAMILY.stage_result(key, 1, out, inputs).float().cpu()
    ref = FAMILY.stage_reference(key, 1, tuple(t if t is None else t.cpu() for t in inputs))
    return {"slot_order": out.rows is None, "any_nan": bool(torch.isnan(y).any()),
            "err": ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()}  # fmt: skip


def _interp_main() -> None:
    for case in chosen_cases(INTERP_CASES):
        print(json.dumps({"case": list(case), **run_case(case)}), flush=True)
    for case, s1, s2 in chosen_cases(MIX_CASES + SPLIT1_CASES + SLOT_GRID_CASES + TOKEN_CASES):
        print(json.dumps({"case": [*case, s1, s2], **run_case(case, "cpu", s1, s2)}), flush=True)
    for case, s1, _ in chosen_cases(ALONE_CASES + SLOT_GRID_ALONE):
        print(json.dumps({"case": [*case, s1, "alone"], **run_stage1_alone(case, s1)}), flush=True)


@pytest.fixture(scope="module")
def interp_results(request):
    """The interpreter run of every CPU case (a subprocess: TRITON_INTERPRET must be set before triton is
    imported). On a GPU the tests run their cases there in-process instead, so no interpreter run: it
    would only cost time, and Triton 3.6's interpreter cannot run these kernels under numpy >= 2.4 (a
    program id or reduced scalar as a range bound: int() of a 1-element array raises)."""
    if torch.cuda.is_available():
        return {}
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    every = INTERP_CASES + MIX_CASES + SPLIT1_CASES + SLOT_GRID_CASES + TOKEN_CASES + ALONE_CASES + SLOT_GRID_ALONE
    env.update(selected_cases_env(request, every))  # only the cases of the selected tests run
    proc = subprocess.run([sys.executable, __file__, "--interp"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {tuple(r["case"]): r for r in rows}


def _tol(dt: str) -> float:
    return {"fp32": 1e-5, "fp16": 3e-3, "bf16": 1.5e-2}[dt]


def _case_id(c) -> str:
    return f"{c[0]}-T{c[1]}-H{c[2]}-I{c[3]}-E{c[4]}-k{c[5]}-{c[6]}-{'direct' if c[7] else 'sorted'}-sk{c[9]}-{c[10]}"


def _mix_id(m) -> str:
    return f"{m[1]}-{m[2]}-{_case_id(m[0])}"


def _check(case, r):
    assert r["shape_ok"]
    assert r["nan_rows"] == r["want_nan_rows"], "NaN rows differ from the reference's (unwritten or bad-id rows)"
    assert r["err"] < _tol(case[0]), r


# The default tier of each sweep: a spread of its kinds (routing, direct / sorted, split, each extra once
# over the sweeps); the other cases are slow.
@pytest.mark.parametrize("case", tiered_at(INTERP_CASES, {1, 7, 11}), ids=_case_id)
def test_interpreter_matches_fp32_reference(case, interp_results):
    if torch.cuda.is_available():
        r = run_case(case, "cuda")
    else:
        r = interp_results[tuple(case)]
    _check(case, r)
    if case[10] == "badid":
        assert sum(r["want_nan_rows"]) == 1


def test_bad_id_case_really_poisons_one_row():
    key, (x, w1, w2, tw, ids, emap) = make_case(INTERP_CASES[-1], "cpu")
    from gemmtune.kernels.fused_moe import fused_moe_ref

    ref = fused_moe_ref(x, w1, w2, tw, ids, "silu")
    assert torch.isnan(ref).any(1).sum() == 1


@pytest.mark.parametrize("mix", tiered_at(MIX_CASES, {5}), ids=_mix_id)
def test_interpreter_mixed_stages_match_fp32_reference(mix, interp_results):
    case, s1, s2 = mix
    r = run_case(case, "cuda", s1, s2) if torch.cuda.is_available() else interp_results[(*case, s1, s2)]
    _check(case, r)


@pytest.mark.parametrize("mix", tiered_at(SPLIT1_CASES, {0, 7}), ids=_mix_id)
def test_interpreter_split_stage1_matches_fp32_reference(mix, interp_results):
    case, s1, s2 = mix
    r = run_case(case, "cuda", s1, s2) if torch.cuda.is_available() else interp_results[(*case, s1, s2)]
    _check(case, r)
    assert r["repeat_equal"]


@pytest.mark.parametrize("mix", tiered_at(SLOT_GRID_CASES, {0, 9}), ids=_mix_id)
def test_interpreter_slot_grid_matches_fp32_reference(mix, interp_results):
    from gemmtune.kernels.fused_moe import DIRECT_MAX_SLOTS

    case, s1, s2 = mix
    key, inputs = make_case(case, "cpu")
    ids = inputs[4]
    slots = ids.numel() + key.token * key.shared_expert
    assert slots < key.expert and slots <= DIRECT_MAX_SLOTS  # the grid runs over slots
    hits = torch.bincount(ids.flatten(), minlength=key.expert)
    assert (hits.max() > 1) == (case[6] == "rep")  # "rep": experts hit by several slots; "spread": none
    r = run_case(case, "cuda", s1, s2) if torch.cuda.is_available() else interp_results[(*case, s1, s2)]
    _check(case, r)
    assert r["repeat_equal"] in (None, True)


@pytest.mark.parametrize("mix", tiered_at(TOKEN_CASES, {0, 8}), ids=_mix_id)
def test_interpreter_by_token_stage2_matches_fp32_reference(mix, interp_results):
    case, s1, s2 = mix
    r = run_case(case, "cuda", s1, s2) if torch.cuda.is_available() else interp_results[(*case, s1, s2)]
    _check(case, r)
    assert r["repeat_equal"]  # a split's counters re-arm: the second call is bit-identical


def test_direct_id_load_is_flat_only_where_slot_s_id_is_at_s():
    """The direct kernel reads slot s's id at s * stride(1) (FLAT_IDS) only without shared experts and with
    contiguous id rows; one token's row is flat whatever its row stride."""
    from gemmtune.backends.fmoe.stages import _routing
    from gemmtune.kernels.fused_moe import flat_ids

    def flat(case) -> bool:
        key, inputs = make_case(case, "cpu")
        return flat_ids(_routing(key, inputs[4], inputs[5]))

    assert flat(INTERP_CASES[0])
    assert not flat(("fp32", 7, 40, 36, 5, 2, "random", True, 16, 1, "idsview"))
    assert not flat(("fp32", 4, 40, 28, 5, 2, "random", True, 16, 1, "shared"))
    assert flat(("fp32", 1, 40, 36, 5, 2, "random", True, 16, 1, "idsview"))


def test_by_token_configs_parse_and_only_as_stage_2():
    from gemmtune.kernels.fused_moe import MoeGemmConfig

    name = "moe2_token_bm16_bn64_bk128_sk4_w4_s4"
    c = MoeGemmConfig.parse(name)
    assert c is not None and c.by_token and c.direct and c.split_k == 4 and c.name == name
    assert MoeGemmConfig.parse("moe1_token_bm16_bn64_bk128_sk1_w4_s4") is None  # stage 1 has no by-token form
    assert MoeGemmConfig.parse("moe2_token_bm32_bn64_bk128_sk1_w4_s4") is None  # BLOCK_M is a dot's least M
    assert not MoeGemmConfig.parse("moe2_direct_bm16_bn64_bk128_sk1_w4_s4").by_token


@pytest.mark.parametrize(
    "mix", tiered_at(ALONE_CASES + SLOT_GRID_ALONE, {0, 1, 7}), ids=lambda m: f"{m[1]}-{_case_id(m[0])}"
)
def test_interpreter_split_stage1_alone_matches_stage_reference(mix, interp_results):
    case, s1, _ = mix
    r = run_stage1_alone(case, s1, "cuda") if torch.cuda.is_available() else interp_results[(*case, s1, "alone")]
    assert r["slot_order"] and not r["any_nan"]  # stage_result zeroes only the rows of slots with no expert
    assert r["err"] < _tol(case[0]), r


@pytest.mark.gpu
@pytest.mark.parametrize("case", tiered(GPU_CASES, lambda c: c[1] in (1, 33, 1000)), ids=_case_id)
def test_gpu_matches_fp32_reference(case, gpu):
    _check(case, run_case(case, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mix", tiered(GPU_MIX_CASES, lambda m: m[0][1] in (33, 64, 4096)), ids=lambda m: f"{m[1]}-{m[2]}-{_case_id(m[0])}"
)
def test_gpu_mixed_stages_match_fp32_reference(mix, gpu):
    from gemmtune.backends.fmoe.stages import grouped_mm_usable

    if not grouped_mm_usable(torch.bfloat16, gpu):
        pytest.skip("torch._grouped_mm has no capturable path on this GPU (sm90/sm100, bf16)")
    case, s1, s2 = mix
    _check(case, run_case(case, "cuda", s1, s2))


@pytest.mark.gpu
@pytest.mark.parametrize("mix", GPU_TOKEN_CASES, ids=lambda m: f"{m[1]}-{m[2]}-{_case_id(m[0])}")
def test_gpu_by_token_stage2_matches_fp32_reference(mix, gpu):
    case, s1, s2 = mix
    r = run_case(case, "cuda", s1, s2)
    _check(case, r)
    assert r["repeat_equal"]


@pytest.mark.gpu
@pytest.mark.parametrize("mix", GPU_SPLIT1_CASES, ids=lambda m: f"{m[1]}-{m[2]}-{_case_id(m[0])}")
def test_gpu_split_stage1_matches_fp32_reference(mix, gpu):
    from gemmtune.backends.fmoe.stages import grouped_mm_usable

    case, s1, s2 = mix
    if s2 == "gm" and not grouped_mm_usable(torch.bfloat16, gpu):
        pytest.skip("torch._grouped_mm has no capturable path on this GPU (sm90/sm100, bf16)")
    r = run_case(case, "cuda", s1, s2)
    _check(case, r)
    assert r["repeat_equal"]


# The untuned default at DeepSeek-V3-like decode (E 256, top-8, I 256, H 7168) as benchmarks/bench_moe.py
# --part grid --ab-stage1-split runs it: on an H100 stage 1 splits over H (8 ways at T 1, 2 at T 4) on the
# direct grid over slots (32 slots < 256 experts at T 4, tokens sharing experts or not), beside its
# unsplit twin. Outputs start NaN; the second call must be bit-identical (arrival counters re-armed).
@pytest.mark.gpu
@pytest.mark.parametrize("T,routing", [(1, "random"), (4, "random"), (4, "rep"), (4, "spread"), (2, "rep")])
def test_gpu_default_split_stage1_at_decode(T, routing, gpu):
    from dataclasses import replace

    from gemmtune import backends
    from gemmtune.backends.fmoe.stages import pair_runner, parse_stage
    from gemmtune.families import fmoe

    H, inter, E, topk, dt = 7168, 256, 256, 8, torch.bfloat16
    key = fmoe.MoeKey(T, H, inter, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    g = torch.Generator(device=gpu).manual_seed(T * 10 + len(routing))
    w1 = (torch.randn(E, 2 * inter, H, device=gpu, generator=g) / H**0.5).to(dt)
    w2 = (torch.randn(E, H, inter, device=gpu, generator=g) / inter**0.5).to(dt)
    x = torch.randn(T, H, device=gpu, generator=g).to(dt)
    tw, ids = fmoe.route(torch.randn(T, E, device=gpu, generator=g), topk)
    if routing == "rep":  # as moe_cases "rep": topk + 1 experts, every token takes topk of them
        pool = torch.randperm(E, device=gpu, generator=g)[: topk + 1]
        ids = torch.stack([pool[(t + torch.arange(topk, device=gpu)) % (topk + 1)] for t in range(T)])
    elif routing == "spread":
        ids = torch.randperm(E, device=gpu, generator=g)[: T * topk].view(T, topk)
    inputs = (x, w1, w2, tw, ids, None)
    ref = fmoe.FAMILY.reference(key, inputs)
    backend, sol = backends.default("fmoe", key, gpu)
    s1, s2 = (parse_stage(n, i + 1) for i, n in enumerate(fmoe.split_name(sol.kernel_name)))
    for c1 in dict.fromkeys([s1, replace(s1, split_k=1)]):
        run = pair_runner(key, c1, s2)
        with nan_buffers():
            y, y2 = run(*inputs), run(*inputs)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert not torch.isnan(y).any() and err < _tol("bf16"), (c1.name, s2.name, err)
        assert torch.equal(y, y2), (c1.name, "second call differs")


# Triton 3.6 miscompiled the direct kernel when it specialized n_slots = 32 (= SLOTS, divisible by 16) at 4
# warps: on an H100 at 4 tokens of top 8 with H, I multiples of 16 these configs gave wrong rows (rel err
# ~0.9) or a misaligned-address fault; 3 and 5 tokens were right. The kernel no longer specializes n_slots.
SLOTS32_CONFIGS = [("moe1_direct_bm16_bn64_bk64_sk2_w4_s4", "moe2_direct_bm16_bn64_bk64_sk1_w4_s4"),
                   ("moe1_direct_bm16_bn64_bk64_sk1_w4_s4", "moe2_direct_bm16_bn64_bk64_sk2_w4_s4"),
                   ("moe1_direct_bm16_bn32_bk128_sk2_w4_s1", "moe2_direct_bm16_bn128_bk64_sk1_w4_s4")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 4, 5])
@pytest.mark.parametrize("names", SLOTS32_CONFIGS, ids=lambda n: "|".join(n))
def test_gpu_direct_configs_at_32_slots(T, names, gpu):
    from gemmtune.backends.fmoe.stages import pair_runner
    from gemmtune.families import fmoe
    from gemmtune.kernels.fused_moe import MoeGemmConfig

    H, inter, E, topk, dt = 2048, 384, 128, 8, torch.bfloat16
    key = fmoe.MoeKey(T, H, inter, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    g = torch.Generator(device=gpu).manual_seed(T)
    w1 = (torch.randn(E, 2 * inter, H, device=gpu, generator=g) / H**0.5).to(dt)
    w2 = (torch.randn(E, H, inter, device=gpu, generator=g) / inter**0.5).to(dt)
    x = torch.randn(T, H, device=gpu, generator=g).to(dt)
    tw, ids = fmoe.route(torch.randn(T, E, device=gpu, generator=g), topk)
    inputs = (x, w1, w2, tw, ids, None)
    ref = fmoe.FAMILY.reference(key, inputs)
    run = pair_runner(key, *(MoeGemmConfig.parse(n) for n in names))
    with nan_buffers():
        y, y2 = run(*inputs), run(*inputs)
    torch.cuda.synchronize()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert not torch.isnan(y).any() and err < _tol("bf16"), err
    assert torch.equal(y, y2)


@pytest.mark.gpu
@pytest.mark.parametrize("case,s1,s2", [(GPU_CASES[2], "tri", "tri"), (GPU_CASES[3], "tri", "gm"),
                                        (GPU_CASES[6], "gm", "gm"), (GPU_SPLIT1_CASES[1][0], "sk4", "tri"),
                                        *(pytest.param(*c, marks=pytest.mark.slow) for c in [
                                            (GPU_CASES[1], "tri", "tri"), (GPU_CASES[4], "tri", "tri"),
                                            (GPU_CASES[2], "gm", "tri"), (GPU_MIX_CASES[5][0], "gm", "gm")])],
                         ids=lambda v: v if isinstance(v, str) else _case_id(v))  # fmt: skip
def test_gpu_graph_replay_equals_eager(case, s1, s2, gpu):
    from gemmtune.backends.fmoe.stages import GM, grouped_mm_usable, pair_runner
    from gemmtune.kernels.fused_moe import MoeGemmConfig

    if "gm" in (s1, s2):
        if not grouped_mm_usable(torch.bfloat16, gpu):
            pytest.skip("torch._grouped_mm has no capturable path on this GPU (sm90/sm100, bf16)")
    _, _, _, _, _, _, _, direct, bm, sk, _ = case
    key, inputs = make_case(case, "cuda")
    c1 = stage1_of(s1, direct, bm, 64, 64, 3)
    c2 = MoeGemmConfig(2, direct, bm, 64, 64, sk, 4, 3) if s2 == "tri" else GM
    run = pair_runner(key, c1, c2)
    eager = run(*inputs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(*inputs)
    # New routing and activations in the same buffers: the replay must follow them.
    hidden, _, _, tw, ids, _ = inputs
    hidden.mul_(-1.5)
    ids.copy_(ids.roll(1, 0))
    tw.copy_(tw.roll(1, 0))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(*inputs))
    assert not torch.equal(out, eager)


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
