"""The torch._grouped_mm fused-MoE path and two-stage tuning (backends/fmoe/, tuner/stages.py).

CPU: the grouped_mm pair in plain torch ops against the fp32 loop reference on odd shapes (E not a
power of two, experts with no tokens, all tokens on one expert, topk 1/2/8, expert parallelism, a
shared expert, a bad id, doweight_stage1, ungated), with the rows torch._grouped_mm leaves unwritten
made NaN; each stage alone against its stage reference; the 16-byte row rule; stage naming; the
tuner timing stages apart (us1/us2 in the row) and pairing a stage of one backend with a stage of
another. GPU: the grouped_mm pair in bf16 (sm90/sm100), torch's own rules, and a tuning run (graph
replay of the grouped_mm pairs: test_moe_kernels.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from moe_cases import make_case, nan_buffers
from tiers import tiered

import gemmtune
from gemmtune import backends
from gemmtune.backends.base import Backend, Solution
from gemmtune.backends.fmoe import policy as mpo
from gemmtune.backends.fmoe import pytorch as mto
from gemmtune.backends.fmoe import stages as mst
from gemmtune.backends.fmoe import triton as mtr
from gemmtune.families import fmoe
from gemmtune.families.fmoe import MoeKey, StageOut, join_name, split_name
from gemmtune.kernels.fused_moe import fused_moe_ref
from gemmtune.tuner.search import TuneOptions, tune_shape

CPU = torch.device("cpu")
GM = mst.GM

# (dtype, T, H, I, E, topk, routing, -, -, -, extra) as moe_cases.make_case reads them
CASES = [
    ("fp32", 1, 24, 20, 5, 1, "random", 0, 0, 0, ""),
    ("fp32", 17, 56, 28, 7, 2, "random", 0, 0, 0, ""),
    ("fp32", 9, 32, 24, 11, 8, "random", 0, 0, 0, ""),
    ("fp32", 13, 40, 36, 6, 2, "one", 0, 0, 0, ""),
    ("fp32", 11, 48, 20, 9, 2, "low", 0, 0, 0, ""),
    ("fp32", 10, 40, 28, 3, 2, "random", 0, 0, 0, "ep"),
    ("fp32", 6, 40, 28, 5, 2, "random", 0, 0, 0, "shared"),
    ("fp32", 6, 40, 28, 5, 2, "random", 0, 0, 0, "doweight"),
    ("fp32", 6, 40, 28, 5, 2, "random", 0, 0, 0, "ungated"),
    ("fp32", 5, 40, 28, 5, 2, "random", 0, 0, 0, "badid"),
    ("bf16", 33, 64, 48, 13, 8, "random", 0, 0, 0, ""),
]


def _id(c) -> str:
    return f"{c[0]}-T{c[1]}-H{c[2]}-I{c[3]}-E{c[4]}-k{c[5]}-{c[6]}-{c[10]}"


def _rel_rows(y, ref):
    """(rel error over the rows the reference has, NaN rows of y, NaN rows of ref)."""
    y, ref = y.float(), ref.float()
    bad_y, bad_ref = torch.isnan(y).any(1), torch.isnan(ref).any(1)
    ok = ~bad_ref
    err = ((y[ok] - ref[ok]).norm() / ref[ok].norm()).item() if ok.any() else 0.0
    return err, bad_y.tolist(), bad_ref.tolist()


def _ref(key, inputs):
    hidden, w1, w2, tw, ids, emap = inputs
    act = fmoe.act_name(key.act_type)
    return fused_moe_ref(hidden.float(), w1.float(), w2.float(), tw, ids, act, emap, key.shared_expert)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_grouped_mm_pair_matches_fp32_loop(case):
    key, inputs = make_case(case, "cpu")
    assert mst.grouped_mm_fits(key, CPU)
    with nan_buffers():  # rows torch._grouped_mm does not write start NaN: none may reach the output
        y = mto.grouped_mm_torch_runner(key)(*inputs)
    assert y.dtype == key.dtype and y.shape == (key.token, key.model_dim)
    err, nan_y, nan_ref = _rel_rows(y, _ref(key, inputs))
    assert nan_y == nan_ref  # only a token with a bad id is NaN
    assert err < (1e-5 if key.dtype == torch.float32 else 1.5e-2)
    if case[10] == "badid":
        assert sum(nan_ref) == 1


@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[6], CASES[7]], ids=_id)
def test_each_grouped_mm_stage_matches_its_stage_reference(case):
    fam = fmoe.FAMILY
    key, inputs = make_case(case, "cpu")
    ((h_in, *rest),) = fam.stage_inputs(key, 2, [inputs])
    with nan_buffers():
        out1 = mst.stage_runner(key, 1, GM)(*inputs)
        out2 = mst.stage_runner(key, 2, GM)(h_in, *rest)
    assert isinstance(out1, StageOut) and out1.rows is not None  # stage 1 leaves its rows sorted by expert
    y1 = fam.stage_result(key, 1, out1, inputs)
    ref1 = fam.stage_reference(key, 1, inputs)
    assert y1.shape == ref1.shape == fam.stage_output_shape(key, 1)
    assert ((y1.float() - ref1).norm() / ref1.norm()).item() < 1e-5
    ref2 = fam.stage_reference(key, 2, (h_in, *rest))
    assert ((out2.float() - ref2).norm() / ref2.norm()).item() < 1e-5
    # the two stages chained are the whole call
    assert ((fam.stage_result(key, 2, out2, inputs).float() - _ref(key, inputs)).norm()).item() < 1e-3


def test_grouped_mm_needs_16_byte_rows_and_is_not_offered_otherwise():
    tor = mto.TorchMoeBackend()
    ok = MoeKey(4, 40, 28, 5, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    assert mst.grouped_mm_fits(ok, CPU) and mto.GROUPED_MM in tor.candidates(ok, CPU)
    assert tor.stage_candidates(ok, CPU, 1) == [GM] and tor.default_solution(ok, CPU) == mto.GROUPED_MM
    for odd in (ok._replace(model_dim=42), ok._replace(inter_dim=30), MoeKey(4, 36, 24, 5, 2)):  # bf16 H=36: 72 B
        assert not mst.grouped_mm_fits(odd, CPU)
        assert mto.GROUPED_MM not in tor.candidates(odd, CPU) and tor.stage_candidates(odd, CPU, 2) == []
        assert tor.default_solution(odd, CPU) == mto.LOOP
        assert not mtr.TritonMoeBackend().supports(mtr.solution_of(mtr.heuristic_configs(odd)[0], GM), odd, CPU)
    # the op still runs such a key (the loop), correctly
    key = MoeKey(3, 42, 30, 5, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    (inp,) = fmoe.FAMILY.make_inputs(key, CPU, 1, seed=3)
    y = gemmtune.fused_moe(*inp[:5])
    assert ((y - _ref(key, inp)).norm() / _ref(key, inp).norm()).item() < 1e-5


def test_grouped_gemm_op_with_unaligned_bf16_rows_falls_back():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 36, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 36, 20, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 3], [1, 0], [2, 1], [0, 2]])
    y = gemmtune.grouped_gemm(x, w, ids)
    ref = torch.stack([torch.stack([x[t].float() @ w[e].float() for e in row]) for t, row in enumerate(ids.tolist())])
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_mixed_stage_names_round_trip_through_rows():
    fam = fmoe.FAMILY
    tri, tor = mtr.TritonMoeBackend(), mto.TorchMoeBackend()
    key = MoeKey(1024, 4096, 14336, 8, 2)
    c1, c2 = mtr.heuristic_configs(key)
    for s1, s2 in ((c1, GM), (GM, c2)):
        sol = mtr.solution_of(s1, s2)
        rec = fam.solution_record(sol.libtype, sol.kernel_name)
        assert rec["kernelName1"] == f"triton:{mst.stage_name(s1)}" and rec["kernelName2"] == mst.stage_name(s2)
        assert fam.libtype_of(rec) == "triton" and tri.solution_from_row(0, fam.kernel_name_of(rec), 0) == sol
        assert tri.pair_solution(split_name(sol.kernel_name), key, CPU) == sol
    # two grouped_mm stages: the stage search pairs them as the torch backend's (torch ops around the
    # GEMMs); the triton backend's row of that name runs its Triton glue around them
    assert tor.pair_solution((GM, GM), key, CPU) == mto.GROUPED_MM and tri.pair_solution((GM, GM), key, CPU) is None
    assert tri.solution_from_row(0, join_name(GM, GM), 0) == mtr.GROUPED_MM_GLUED != mto.GROUPED_MM
    assert tri.solution_from_row(0, join_name(c2.name, GM), 0) is None  # a stage-2 config cannot be stage 1
    assert tri.solution_from_row(0, join_name(GM, "moe2_direct_bm12_bn64_bk64_sk1_w4_s3"), 0) is None
    assert mtr.stage_configs(key, 1)[0] == c1 and all(c.stage == 2 for c in mtr.stage_configs(key, 2))


# ---- stage 1 split over H ---------------------------------------------------------------------------
DSV3_TP8 = MoeKey(1, 7168, 256, 256, 8)  # fine-grained experts (DeepSeek-V3 tp8) at decode


def test_a_split_stage1_config_is_valid_and_its_name_round_trips():
    from gemmtune.kernels.fused_moe import MoeGemmConfig

    c1 = MoeGemmConfig(1, True, 16, 64, 64, 8, 4, 4)
    assert c1.valid() and c1.name == "moe1_direct_bm16_bn64_bk64_sk8_w4_s4"
    assert MoeGemmConfig.parse(c1.name) == c1 and mst.parse_stage(c1.name, 1) == c1
    assert mst.parse_stage(c1.name, 2) is None and MoeGemmConfig.parse("moe1_direct_bm16_bn64_bk64_sk0_w4_s4") is None
    c2 = mtr.heuristic_configs(DSV3_TP8)[1]
    sol = mtr.solution_of(c1, c2)
    rec = fmoe.FAMILY.solution_record(sol.libtype, sol.kernel_name)
    assert rec["kernelName1"] == f"triton:{c1.name}"
    assert mtr.TritonMoeBackend().solution_from_row(0, fmoe.FAMILY.kernel_name_of(rec), 0) == sol


def test_a_table_row_naming_a_split_stage1_is_accepted(tmp_path):
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity

    tri, ident = mtr.TritonMoeBackend(), identity(CPU)
    c1, c2 = "moe1_direct_bm16_bn64_bk64_sk8_w4_s4", "moe2_direct_bm16_bn128_bk64_sk2_w4_s4"
    row = TunedRow(ident.gfx, ident.cu_num, DSV3_TP8, "triton", 16, 2, 30.0, join_name(c1, c2), family=fmoe.FAMILY)
    path = tmp_path / "tuned_fmoe.csv"
    ConfigTable([row], family=fmoe.FAMILY).write(str(path))
    (back,) = ConfigTable.load(str(path)).rows
    assert (back.raw["kernelName1"], back.raw["kernelName2"]) == (f"triton:{c1}", c2) and back.libtype == "triton"
    sol = tri.solution_from_row(back.solidx, back.kernel_name, back.splitk)
    assert sol is not None and sol.kernel_name == join_name(c1, c2) and tri.supports(sol, DSV3_TP8, CPU)
    assert tri.pair_solution((c1, c2), DSV3_TP8, CPU) == sol


@pytest.mark.parametrize("key,split", [
    (DSV3_TP8, 4),  # 8 experts x 8 N tiles of 32 = 64 programs -> 256 (<= 2 waves of 132 SMs)
    (DSV3_TP8._replace(token=4), 1),  # 32 slots: over SPLIT1_MAX_SLOTS
    (DSV3_TP8._replace(token=2), 2),  # 16 slots x 8 = 128 programs -> 256
    (DSV3_TP8._replace(token=16), 1),  # 128 x 4 tiles of 64 = 512 programs: wide tiles, no split
    (MoeKey(1, 2048, 384, 128, 8), 1),  # Qwen3-30B-A3B tp2: 8 x 12 = 96; x 2 = 192 leaves the 2nd wave half empty
    (MoeKey(4, 2048, 384, 128, 8), 1),  # 32 x 6 = 192
    (MoeKey(1, 4096, 14336, 8, 2), 1),  # Mixtral: 2 x 224 = 448
    (MoeKey(1, 5120, 1024, 128, 1), 8),  # Llama-4-Maverick tp8: 1 x 32 -> 256, 40 K steps / 8 = 5
    (MoeKey(1, 1024, 256, 256, 8), 2),  # H 1024 = 8 K steps of 128: a split keeps >= 4 of them
    (MoeKey(1, 512, 256, 256, 8), 1),  # 4 K steps: too short to split
])  # fmt: skip
def test_the_default_splits_stage1_where_it_has_few_programs(key, split):
    c1, _ = mtr.heuristic_configs(key, sms=132)
    assert c1.split_k == split, c1.name
    programs = mtr.stage1_programs(key, c1.block_m, c1.block_n)
    if split > 1:
        assert programs < 132 and programs * split <= mtr.STAGE1_SPLIT.max_waves * 132
        assert -(-key.model_dim // c1.block_k) // split >= mtr.STAGE1_SPLIT.min_k_steps


def test_the_default_splits_past_one_wave_only_into_a_full_last_wave():
    c1 = mtr.heuristic_configs(MoeKey(1, 2048, 384, 128, 8), sms=132)[0]
    assert mtr.stage1_splits(MoeKey(1, 2048, 384, 128, 8), c1, 132, 2.0) == [2]  # allowed, 192 programs
    assert c1.split_k == 1  # but 192 - 132 = 60 of 132 SMs busy in the second wave
    assert mtr.heuristic_configs(MoeKey(1, 2048, 384, 128, 8), sms=100)[0].split_k == 2  # 192 -> 92 of 100


def test_the_split_rule_is_its_constants(monkeypatch):
    monkeypatch.setattr(mtr, "STAGE1_SPLIT", mtr.Stage1Split(max_split=1))
    assert mtr.heuristic_configs(DSV3_TP8)[0].split_k == 1
    monkeypatch.setattr(mtr, "STAGE1_SPLIT", mtr.Stage1Split(max_waves=1.0))
    assert mtr.heuristic_configs(DSV3_TP8)[0].split_k == 2  # 64 programs x 2 = 128 <= 132
    assert mtr.heuristic_configs(DSV3_TP8, sms=100)[0].split_k == 1  # 64 x 2 > 100


def test_stage1_split_candidates_only_where_stage1_has_few_programs(monkeypatch):
    tri = mtr.TritonMoeBackend()
    names = tri.stage_candidates(DSV3_TP8, CPU, 1)
    assert names[0] == mtr.heuristic_configs(DSV3_TP8)[0].name
    split = [mst.parse_stage(n, 1) for n in names if "_sk1_" not in n]
    assert {c.split_k for c in split} >= {2, 4, 8} and len(split) < len(names)
    for c in split:
        assert mtr.stage1_programs(DSV3_TP8, c.block_m, c.block_n) < 132
        assert -(-DSV3_TP8.model_dim // c.block_k) // c.split_k >= mtr.STAGE1_SPLIT.min_k_steps
    assert all("_sk1_" in n for n in tri.stage_candidates(MoeKey(1, 4096, 14336, 8, 2), CPU, 1))
    assert all("_sk1_" in n for n in tri.stage_candidates(MoeKey(1024, 2048, 768, 128, 8), CPU, 1))
    # stage 2's candidates, in their order, are the same without stage 1's splits
    stage2 = tri.stage_candidates(DSV3_TP8, CPU, 2)
    monkeypatch.setattr(mtr, "STAGE1_SPLIT", mtr.Stage1Split(max_split=1))
    assert tri.stage_candidates(DSV3_TP8, CPU, 2) == stage2
    assert all("_sk1_" in n for n in tri.stage_candidates(DSV3_TP8, CPU, 1))


# ---- tuning ---------------------------------------------------------------------------------------
FP32_KEY = MoeKey(6, 32, 24, 5, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
FAST = TuneOptions(reps=7, screen_reps=5, min_gain=0.03, verify_range=False)


def test_tuner_times_the_stages_apart_and_writes_them(monkeypatch, tmp_path):
    from gemmtune.configs.table import read_table_file
    from gemmtune.device import identity
    from gemmtune.tuner.output import result_row, write_row

    monkeypatch.setattr(mto.TorchMoeBackend, "candidates", lambda self, key, device: [mto.GROUPED_MM])
    res = tune_shape(FP32_KEY, CPU, FAST, family="fmoe")
    assert res.winner.kernel_name == "grouped_mm|grouped_mm"
    stage_cands = {c.kernel_name: c for c in res.candidates if c.kernel_name.startswith("stage")}
    assert set(stage_cands) == {"stage1:grouped_mm", "stage2:grouped_mm"}
    assert all(c.status == "ok" and c.screen_us > 0 and c.err < 1e-5 for c in stage_cands.values())
    assert float(res.extra["us1"]) > 0 and float(res.extra["us2"]) > 0 and float(res.extra["err1"]) < 1e-5
    path = tmp_path / "tuned_fmoe.csv"
    write_row(str(path), result_row(res, identity(CPU), fmoe.FAMILY))
    (row,) = read_table_file(str(path)).rows
    assert row.raw["kernelName1"] == "torch:grouped_mm" and row.raw["kernelName2"] == "grouped_mm"
    assert float(row.raw["us1"]) > 0 and float(row.raw["us2"]) > 0 and row.raw["err2"] != ""
    assert row.key == FP32_KEY


def _costing(run, us: float):
    """`run`, tagged with the time the fake clock (_fake_bench) reports for it."""

    def costed(*args):
        return run(*args)

    costed.cost_us = us
    return costed


def _fake_bench(key, runners, device="cpu", reps=20, seed=0, inputs=None, family=None, tails=None):
    """The tuner's timing with a fake clock: each runner runs once (it must work) and costs its cost_us."""
    (args,) = (family or fmoe.FAMILY).make_inputs(key, CPU, 1, seed)
    out = {}
    for name, run in runners.items():
        run(*args)
        out[name] = run.cost_us
    return out


class _FakeStages(Backend):
    """Stage kernels of another backend, built on the grouped_mm stages: fast1 (10 us), wrong1 (10% off),
    slow2 (500 us). Its pairs may take a torch grouped_mm stage; a pair costs its stages' sum."""

    name = "fakemoe"
    family = "fmoe"
    COST = {"fast1": 10.0, "wrong1": 1.0, "slow2": 500.0, GM: 40.0}

    def is_available(self, device):
        return True

    def candidates(self, key, device):
        return []

    def solution_from_row(self, solidx, kernel_name, splitk):
        return Solution(self.name, kernel_name, 0)

    def supports(self, solution, key, device):
        return True

    def _stage(self, stage, name, key):
        return mst.stage_runner(key, stage, GM) if name == GM else self.make_stage_runner(stage, name, key, CPU)

    def make_runner(self, solution, key, device):
        n1, n2 = split_name(solution.kernel_name)
        r1, r2 = self._stage(1, n1, key), self._stage(2, n2, key)
        return _costing(lambda *inputs: r2(r1(*inputs).slot_order(), *inputs), self.COST[n1] + self.COST[n2])

    def stage_candidates(self, key, device, stage):
        return ["fast1", "wrong1"] if stage == 1 else ["slow2"]

    def make_stage_runner(self, stage, name, key, device):
        base = mst.stage_runner(key, stage, GM)
        if name == "wrong1":
            return _costing(lambda *inputs: StageOut(base(*inputs).slot_order() * 1.1), self.COST[name])
        return _costing(base, self.COST[name])

    def pair_solution(self, names, key, device):
        return None if tuple(names) == (GM, GM) else Solution(self.name, join_name(*names), 0)


def test_tuner_pairs_a_stage_of_one_backend_with_a_stage_of_another(monkeypatch, tmp_path):
    """Stages timed apart on a fake clock: torch's grouped_mm stage 1 costs 300 us, its stage 2 40 us
    and its whole pair (the default here) 340 us; fakemoe's fast1 10 us, slow2 500 us, wrong1 is
    wrong. The tuner must reject wrong1, pair fast1 with torch's stage 2, write that mixed row with
    its stage times, and fused_moe must then run it."""
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve
    from gemmtune.tuner import candidates
    from gemmtune.tuner.output import result_row, write_row

    backends.register(_FakeStages())
    try:
        tor = mto.TorchMoeBackend
        real_runner, real_stage = tor.make_runner, tor.make_stage_runner
        monkeypatch.setattr(candidates, "bench_gemm", _fake_bench)
        monkeypatch.setattr(tor, "candidates", lambda self, key, device: [mto.GROUPED_MM])
        monkeypatch.setattr(tor, "make_runner", lambda self, s, k, d: _costing(real_runner(self, s, k, d), 340.0))
        monkeypatch.setattr(tor, "make_stage_runner",
                            lambda self, st, n, k, d: _costing(real_stage(self, st, n, k, d), 300.0 if st == 1
                                                               else 40.0))  # fmt: skip
        res = tune_shape(FP32_KEY, CPU, FAST, family="fmoe")
        assert res.winner.name == "fakemoe:fast1|grouped_mm", [(c.name, c.status, c.us) for c in res.candidates]
        assert not res.kept_default and (res.default_us, res.us) == (340.0, 50.0)
        by_name = {c.name: c for c in res.candidates}
        assert by_name["fakemoe:stage1:wrong1"].status == "rejected"
        assert (
            by_name["fakemoe:stage2:slow2"].screen_us == 500.0 and by_name["torch:stage1:grouped_mm"].screen_us == 300
        )
        # the pairs of the 2 fastest per stage were timed whole: fast1 and torch's stage 1 x both stage 2s
        timed = {c.name for c in res.candidates if c.us == c.us}
        assert {"fakemoe:fast1|grouped_mm", "fakemoe:fast1|slow2", "fakemoe:grouped_mm|slow2"} <= timed
        assert (res.extra["us1"], res.extra["us2"]) == ("10", "40")
        path = tmp_path / "tuned_fmoe.csv"
        write_row(str(path), result_row(res, identity(CPU), fmoe.FAMILY))
        row = ConfigTable.load(str(path)).rows[0]
        assert (row.raw["kernelName1"], row.raw["kernelName2"]) == ("fakemoe:fast1", "grouped_mm")
        assert (row.raw["us1"], row.raw["us2"], row.raw["us"]) == ("10", "40", "50")
        gemmtune.set_config(str(path))
        got = resolve(FP32_KEY, "cpu", family="fmoe")
        assert got.solution.libtype == "fakemoe" and got.solution.kernel_name == "fast1|grouped_mm"
        (inp,) = fmoe.FAMILY.make_inputs(FP32_KEY, CPU, 1, seed=5)
        y = gemmtune.fused_moe(*inp[:5])
        assert ((y - _ref(FP32_KEY, inp)).norm() / _ref(FP32_KEY, inp).norm()).item() < 1e-5
    finally:
        backends._registry.pop(("fmoe", "fakemoe"), None)


def test_an_fmoe_row_without_ep_or_shared_experts_is_found():
    """fmoe keys hold 0 in their expert-parallel and shared-expert columns: a zero-size guard that read
    every int of the key never looked such rows up."""
    from gemmtune.configs.schema import TunedRow
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.dispatch import resolve

    ident = identity(CPU)
    row = TunedRow(ident.gfx, ident.cu_num, FP32_KEY, "torch", 0, 0, 5.0, "dense|dense", family=fmoe.FAMILY)
    gemmtune.set_config(ConfigTable([row], family=fmoe.FAMILY))
    got = resolve(FP32_KEY, "cpu", family="fmoe")
    assert got.row is not None and got.solution == mto.DENSE
    # An empty batch reaches the dispatcher itself (the public resolve refuses a key no table can hold).
    empty = gemmtune.get_dispatcher().resolve(FP32_KEY._replace(token=0), CPU, family="fmoe")
    assert empty.row is None


# ---- GPU ------------------------------------------------------------------------------------------
def _need_grouped_mm(device):
    if not mst.grouped_mm_usable(torch.bfloat16, device):
        pytest.skip("torch._grouped_mm has no capturable path on this GPU (sm90/sm100, bf16)")


GPU_CASES = [("bf16", T, H, inter, E, k, routing, 0, 0, 0, extra) for T, H, inter, E, k, routing, extra in (
    (1, 4096, 1792, 8, 2, "random", ""),
    (300, 1024, 384, 60, 4, "low", "shared"),
    (257, 512, 256, 7, 2, "one", "ep"),
    (4096, 512, 256, 7, 1, "random", "doweight"),
    (9, 1000, 520, 13, 8, "random", "badid"),
)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("triton_glue", [False, True], ids=["torch-glue", "triton-glue"])
@pytest.mark.parametrize("case", tiered(GPU_CASES, lambda c: c[1] in (1, 257)), ids=_id)
def test_gpu_grouped_mm_pair_matches_fp32_loop(case, triton_glue, gpu):
    _need_grouped_mm(gpu)
    key, inputs = make_case(case, "cuda")
    with nan_buffers():
        y = mst.pair_runner(key, GM, GM, triton_glue)(*inputs)
    err, nan_y, nan_ref = _rel_rows(y, _ref(key, inputs))
    assert nan_y == nan_ref and err < 1.5e-2


@pytest.mark.gpu
def test_gpu_grouped_mm_rules_match_torch(gpu):
    """Where grouped_mm_usable says yes, torch._grouped_mm captures in a CUDA graph (no host sync) and
    replays right; rows that are not 16-byte multiples are refused by torch as by grouped_mm_fits."""
    assert not mst.grouped_mm_usable(torch.float16, gpu)
    _need_grouped_mm(gpu)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(40, 64, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(3, 64, 32, device="cuda", generator=g).to(torch.bfloat16)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32, device="cuda")
    torch._grouped_mm(a, b, offs=offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch._grouped_mm(a, b, offs=offs)
    offs.copy_(torch.tensor([25, 30, 40], dtype=torch.int32))  # other group sizes, replayed
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.cat([a[:25].float() @ b[0].float(), a[25:30].float() @ b[1].float(), a[30:].float() @ b[2].float()])
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert not mst.grouped_mm_fits(MoeKey(4, 1004, 512, 8, 2), gpu)  # 2008-byte rows
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(torch.zeros(8, 1004, device="cuda", dtype=torch.bfloat16),
                          torch.zeros(2, 1004, 64, device="cuda", dtype=torch.bfloat16),
                          offs=torch.tensor([4, 8], dtype=torch.int32, device="cuda"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_tuning_times_triton_and_grouped_mm_stages_apart(monkeypatch, gpu):
    """A real staged search on a small key, the Triton sweep cut to 3 configs per stage so it is quick:
    every stage kernel checked and timed, the 2 fastest of each stage paired across backends and timed
    whole, the row's stage columns set."""
    _need_grouped_mm(gpu)
    real = mtr.stage_configs
    monkeypatch.setattr(mtr, "stage_configs", lambda key, stage: real(key, stage)[:3])
    monkeypatch.setattr(mto.TorchMoeBackend, "candidates", lambda self, key, device: [])  # no dense / loop
    key = MoeKey(512, 1024, 512, 16, 2)
    res = tune_shape(key, gpu, TuneOptions(reps=10, screen_reps=5, verify_range=False), family="fmoe")
    stage_cands = [c for c in res.candidates if ":stage" in c.name]
    assert {c.kernel_name for c in stage_cands} >= {"stage1:grouped_mm", "stage2:grouped_mm"}
    ok = [c for c in stage_cands if c.status == "ok"]
    assert sum(c.libtype == "triton" for c in ok) >= 4 and all(c.screen_us > 0 for c in ok)
    top = {}
    for st in (1, 2):
        mine = sorted((c for c in ok if c.kernel_name.startswith(f"stage{st}:")), key=lambda c: c.screen_us)
        top[st] = [c.kernel_name.split(":", 1)[1] for c in mine[:2]]
    pairs = {c.kernel_name for c in res.candidates if "|" in c.kernel_name}
    assert {join_name(n1, n2) for n1 in top[1] for n2 in top[2]} <= pairs  # mixed ones too, if grouped_mm is fast
    assert math.isfinite(res.us) and float(res.extra["us1"]) > 0 and float(res.extra["us2"]) > 0


def test_untuned_keys_with_many_tokens_per_expert_prefer_the_grouped_mm_pair():
    # H100 data (backends/fmoe/policy.py): grouped_mm won every key with >= 1024 slots and >= 64 per expert.
    assert mpo.prefers_grouped_mm(MoeKey(1024, 4096, 14336, 8, 2))  # Mixtral: 2048 slots, 256 per expert
    assert mpo.prefers_grouped_mm(MoeKey(1024, 2048, 768, 128, 8))  # Qwen3-30B-A3B: 8192 slots, 64 per expert
    assert not mpo.prefers_grouped_mm(MoeKey(256, 4096, 14336, 8, 2))  # 512 slots
    assert not mpo.prefers_grouped_mm(MoeKey(256, 2048, 768, 128, 8))  # 16 per expert
    assert not mpo.prefers_grouped_mm(MoeKey(16, 4096, 14336, 8, 2))
    # the CPU default is unchanged by it (grouped_mm where it fits, else the loop)
    key = MoeKey(1024, 40, 28, 5, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    assert mto.TorchMoeBackend().default_solution(key, CPU) == mto.GROUPED_MM


@pytest.mark.gpu
def test_untuned_gpu_default_is_grouped_mm_for_prefill_and_triton_for_decode():
    """On a GPU both defaults run Triton kernels (the grouped_mm pair's sort, activation and combine), so
    both are the triton backend's; torch's own pick stays the pure-torch grouped_mm pair."""
    gpu = torch.device("cuda")
    if not mst.grouped_mm_fits(MoeKey(4096, 4096, 14336, 8, 2), gpu):
        pytest.skip("torch._grouped_mm does not run capturably on this GPU")
    assert mpo.fmoe(MoeKey(4096, 4096, 14336, 8, 2), gpu) == ("triton", mtr.GROUPED_MM_GLUED)
    name, sol = mpo.fmoe(MoeKey(4, 4096, 14336, 8, 2), gpu)
    assert name == sol.libtype == "triton" and GM not in split_name(sol.kernel_name)
    assert mto.TorchMoeBackend().default_solution(MoeKey(4096, 4096, 14336, 8, 2), gpu) == mto.GROUPED_MM


@pytest.mark.parametrize("tokens, want", [(1, (1, 3)), (2, (1, 3)), (4, (0, 0))])
def test_direct_stages_take_pdl_only_at_few_slots(tokens, want, monkeypatch):
    """On a device with programmatic dependent launch, the direct pair launches stage 1 with pdl 1 and
    stage 2 (by token up to 16 slots on 16 experts) with pdl 3 up to PDL_MAX_SLOTS slots (top 8: 2
    tokens); more slots keep the plain launch."""
    key, inputs = make_case(("fp32", tokens, 32, 24, 16, 8, "random", 0, 0, 0, ""), "cpu")
    seen = []
    monkeypatch.setattr(mst, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(mst.kmoe, "moe_gemm", lambda *a, pdl=0, **kw: seen.append(pdl))
    monkeypatch.setattr(mst.kmoe, "moe_down_by_token", lambda *a, pdl=0, **kw: seen.append(pdl))
    monkeypatch.setattr(mst.kmoe, "combine", lambda *a, **kw: None)
    cfg = mtr.heuristic_configs(key, 132)
    assert all(c.direct for c in cfg)
    mst.pair_runner(key, *cfg, triton_glue=True)(*inputs)
    assert tuple(seen) == want, seen


@pytest.mark.parametrize("key,narrow", [
    (DSV3_TP8, True),  # 8 experts x 4 N tiles of 64 = 32 programs < 132 SMs
    (MoeKey(1, 2048, 1408, 60, 4), True),  # Qwen2-MoE: 4 x 22 = 88
    (MoeKey(4, 2048, 384, 128, 8), True),  # 32 x 6 = 192 < 2 waves, fine-grained experts
    (MoeKey(2, 2048, 1408, 60, 4), False),  # 8 x 22 = 176 < 2 waves, but I > 512
    (MoeKey(1, 4096, 14336, 8, 2), False),  # 2 x 224 = 448
    (MoeKey(4096, 2048, 768, 128, 8), False),  # sorted
])  # fmt: skip
def test_few_stage1_programs_take_narrow_tiles_with_long_k_steps(key, narrow):
    c1, _ = mtr.heuristic_configs(key, sms=132)
    assert ((c1.block_n, c1.block_k) == (32, 128)) == narrow, c1.name
    waves = mtr.NARROW_STAGE1_WAVES if key.inter_dim <= mtr.BY_TOKEN.max_i else 1
    assert (mtr.stage1_programs(key, c1.block_m, 64) < waves * 132) == narrow
    if narrow:  # 4 pipeline stages below one wave, 3 past it
        assert c1.stages == (4 if mtr.stage1_programs(key, c1.block_m, 64) < 132 else 3)


@pytest.mark.parametrize("key,want", [
    (MoeKey(1, 2048, 384, 128, 8), "moe2_token_bm16_bn64_bk128_sk4_w4_s4"),  # 32 N tiles x 4 splits = 128
    (MoeKey(2, 2048, 384, 128, 8), "moe2_token_bm16_bn64_bk128_sk2_w4_s4"),
    (MoeKey(8, 2048, 384, 128, 8), "moe2_token_bm16_bn64_bk128_sk1_w4_s3"),  # 256 programs: 3 stages
    (MoeKey(1, 7168, 256, 256, 8), "moe2_token_bm16_bn64_bk128_sk1_w4_s4"),  # 112 N tiles: no split
    (MoeKey(1, 2048, 1408, 60, 4, shared_expert=1), "moe2_token_bm16_bn64_bk128_sk4_w4_s4"),  # 5 columns
    (MoeKey(1, 5120, 1024, 128, 1), "moe2_token_bm16_bn64_bk128_sk1_w4_s4"),  # top 1: nothing to split
    (MoeKey(2, 2048, 1408, 60, 4), None),  # past one token: I > 512
    (MoeKey(1, 4096, 4096, 8, 2), None),  # coarse experts
    (MoeKey(16, 2048, 384, 128, 8), None),  # past 8 tokens
    (MoeKey(8, 2048, 384, 32, 8), None),  # more slots than experts
])  # fmt: skip
def test_the_default_stage_2_is_by_token_at_fine_grained_decode(key, want):
    _, c2 = mtr.heuristic_configs(key, sms=132)
    assert (c2.name if c2.by_token else None) == want, c2.name
