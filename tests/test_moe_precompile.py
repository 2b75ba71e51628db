"""The fmoe triton backend's precompile (backends/fmoe/precompile.py, launches.py): its items for a list of
keys, one per binary, and stand-in keys that compile the real key's binaries on little memory.

The stand-in property is shown on launches recorded instead of run: every fmoe Triton kernel's `run` is
replaced by one that asks Triton's own binder (with a CUDA backend, no GPU needed) how it would specialize
the call (the key of its binary cache: each argument's specialization, constexprs, options), and the
runners run on meta tensors, so the real keys (DeepSeek-V3's 256 experts: 7.5 GB for stage 1) cost
nothing. On the CPU the items also build and run under Triton's interpreter; on a GPU, a key's stage
configs add no binary to a cache its items filled.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from gemmtune.backends.fmoe import launches
from gemmtune.backends.fmoe import triton as mtr
from gemmtune.backends.fmoe.precompile import one_stage, stand_in
from gemmtune.families import fmoe
from gemmtune.families.fmoe import MoeKey, join_name

triton = pytest.importorskip("triton")

META = torch.device("meta")
GM_GLUED = mtr.GROUPED_MM_GLUED
# The representative keys: DeepSeek-V3-like experts at decode (a direct grid over slots, stage 1 split;
# at T = 4 32 slots, too many for a split), Mixtral-8x7B (few experts: a grid over experts), Qwen3-30B-A3B
# at T = 256 (sorted), and DeepSeek-V3's own key (a shared expert, tp 8).
KEYS = [
    MoeKey(1, 7168, 256, 256, 8),
    MoeKey(4, 7168, 256, 256, 8),
    MoeKey(64, 4096, 14336, 8, 2),
    MoeKey(256, 2048, 768, 128, 8),
    MoeKey(16, 7168, 256, 257, 8, shared_expert=1),
]
# Rarer launch arguments: expert parallelism, doweight_stage1, ungated, gelu, fp16, topk 1, odd sizes.
FP16 = dict(dtype=torch.float16, q_dtype_a=torch.float16, q_dtype_w=torch.float16)
ODD_KEYS = [
    MoeKey(2, 2048, 768, 16, 8, global_expert=128),
    MoeKey(40, 1000, 520, 13, 4, doweight_stage1=True),
    MoeKey(3, 1024, 384, 60, 1, use_g1u1=False, act_type="ActivationType.GeluTanh", **FP16),
]


def jobs_of(keys, glued: bool = True):
    """The backend's candidates for `keys` as an H100 offers them: the heuristic pair (132 SMs) and, in
    bf16, the grouped_mm pair with the Triton glue."""
    gm = lambda k: [GM_GLUED] if glued and k.dtype == torch.bfloat16 else []
    sols = lambda k: [mtr.solution_of(*mtr.heuristic_configs(k, 132)), *gm(k)]
    return [(s, k) for k in keys for s in sols(k)]


def items_of(keys, glued: bool = True):
    return mtr.TritonMoeBackend().compile_items(jobs_of(keys, glued))


@pytest.fixture
def record(monkeypatch):
    """Every fmoe Triton launch recorded, not run: (kernel, Triton's specialization, options). The family's
    inputs made on the meta device (no generator there)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from gemmtune.kernels import activations, moe_route
    from gemmtune.kernels import fused_moe as kmoe

    monkeypatch.setattr(fmoe, "generator", lambda device, seed: None)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    log: list = []
    for k in (kmoe._moe_gemm_direct, kmoe._moe_gemm_sorted, kmoe._combine, moe_route._expert_sort_kernel,
              activations._act_mul_kernel):  # fmt: skip
        if not isinstance(k, JITFunction):
            pytest.skip("Triton's interpreter is on in this process")
        binder = create_function_from_signature(k.signature, k.params, backend)

        def run(*args, grid, warmup, _name=k.fn.__name__, _bind=binder, **kwargs):
            _, specialization, options = _bind(*args, **kwargs)
            log.append((_name, str(specialization), tuple(sorted((n, str(v)) for n, v in options.items()))))

        monkeypatch.setattr(k, "run", run)

    def launched(key, name: str) -> frozenset:
        """The launches of running what `name` names (a pair, or a bare stage config) on `key`'s inputs."""
        be = mtr.TritonMoeBackend()
        (inputs,) = fmoe.FAMILY.make_inputs(key, META, 1, 0)
        del log[:]
        be.make_runner(be.solution_from_row(0, name, 0), key, META)(*inputs)
        return frozenset(log)

    return launched


def unit_names(key) -> list[str]:
    """What a tune of `key` runs Triton kernels for: every stage config it times, both candidate pairs."""
    return [c.name for s in (1, 2) for c in mtr.stage_sweep(key, s)] + [s.kernel_name for s, _ in jobs_of([key])]


@pytest.mark.parametrize("key", KEYS + ODD_KEYS, ids=lambda k: fmoe.FAMILY.describe(k))
def test_each_stand_in_makes_the_real_keys_launches_and_the_items_make_every_launch_of_its_tune(key, record):
    items = items_of([key])
    made = set()
    for name, small in items:
        real = record(key, name)
        assert record(small, name) == real, f"{name}: {small} launches otherwise than {key}"
        made |= real
        assert fmoe.FAMILY.set_bytes(small) <= fmoe.FAMILY.set_bytes(key)
    for name in unit_names(key):
        assert record(key, name) <= made, f"{name} launches a kernel no item compiles"
    assert len(items) <= len(unit_names(key))


def test_the_stand_ins_are_small():
    """Every item of the representative keys builds on under 256 MB of weights and activations (their real
    keys: 1.2 to 2.8 GB)."""
    worst = max(fmoe.FAMILY.set_bytes(k) for _, k in items_of(KEYS))
    assert worst < 256e6 < max(fmoe.FAMILY.set_bytes(k) for k in KEYS)
    direct = [k for n, k in items_of(KEYS[:1]) if n.startswith("moe1_direct")]
    assert direct and all(k.expert > k.token * k.topk for k in direct)  # still a grid over slots


def test_the_description_tells_binaries_apart_exactly_as_triton_does(record):
    """launches.py's description of a stage or the glue is equal for two keys exactly when Triton's
    specialization of their launches is: the dedup neither merges two binaries nor keeps one twice."""
    seen: dict = {}
    for key in KEYS + ODD_KEYS:
        units = [(c.name, launches.stage_launches(key, c)) for s in (1, 2) for c in mtr.stage_sweep(key, s)]
        if key.dtype == torch.bfloat16:  # torch._grouped_mm runs bf16 (on sm90)
            units.append((GM_GLUED.kernel_name, launches.glue_launches(key)))
        for name, described in units:
            seen.setdefault(described, set()).add(record(key, name))
    assert all(len(recorded) == 1 for recorded in seen.values())  # one description, one binary set
    assert len({r for recorded in seen.values() for r in recorded}) == len(seen)  # and the other way round


def test_the_items_of_a_list_of_keys():
    keys = KEYS[:2] + [KEYS[3]]
    items = items_of(keys)
    names = [n for n, _ in items]
    assert items == items_of(keys)  # deterministic
    assert names.count(GM_GLUED.kernel_name) == 3  # each key's glue sorts into its own bins
    assert all(n == GM_GLUED.kernel_name or one_stage(n) is not None for n in names)
    described = [launches.glue_launches(k) if one_stage(n) is None else launches.stage_launches(k, one_stage(n))
                 for n, k in items]  # fmt: skip
    for i, made in enumerate(described):  # each item makes a launch no item before it makes
        assert not set(made) <= {x for earlier in described[:i] for x in earlier}, names[i]
    # every stage config of every key is made by an item of the same description
    units = [launches.stage_launches(k, c) for k in keys for s in (1, 2) for c in mtr.stage_sweep(k, s)]
    assert set(units) <= set(described)
    assert len(items) < len(units)
    # without the grouped_mm pair among the candidates (fp16, or no sm90): no glue item
    assert GM_GLUED.kernel_name not in [n for n, _ in items_of(keys, glued=False)]
    # a key Triton cannot run has no items
    assert mtr.TritonMoeBackend().compile_items([]) == []
    assert mtr.stage_sweep(MoeKey(1, 64, 64, 8, 2, q_type="QuantType.per_Token"), 1) == []


def test_keys_that_specialize_alike_share_their_items_and_others_do_not():
    a = MoeKey(256, 2048, 768, 128, 8)  # sorted launches; 16 slots per expert hit
    twin = MoeKey(512, 2048, 768, 256, 8)  # twice the tokens and experts: the same binaries
    odd = a._replace(inter_dim=776)  # I not a multiple of 16: other binaries
    assert mtr.heuristic_configs(a) == mtr.heuristic_configs(twin)
    alone = items_of([a], glued=False)
    assert items_of([a, twin], glued=False) == alone  # one item per binary
    both = items_of([a, odd], glued=False)
    assert len(both) == 2 * len(alone) and {n for n, _ in both} == {n for n, _ in alone}


def test_a_stand_in_keeps_what_specializes_and_lowers_the_rest():
    key = MoeKey(1, 7168, 256, 256, 8)
    c1 = mtr.heuristic_configs(key)[0]
    assert c1.direct and c1.split_k > 1
    small = stand_in(key, lambda k: launches.stage_launches(k, c1))
    # 8 slots: a grid over slots needs more experts than slots, routed experts a multiple of 16 like 256
    assert small == key._replace(expert=16, inter_dim=16, model_dim=16)
    # the sort's bins follow the experts (p2(E + 2)): the glue keeps E = 256, the act*mul and combine
    # blocks keep I's power of two and H's (capped at 1024)
    glue = stand_in(key, launches.glue_launches)
    assert (glue.expert, glue.inter_dim, glue.model_dim) == (256, 144, 528)
    assert launches.spec(1) == "1" and launches.spec(48) == "i32D" and launches.spec(2**31 + 16) == "i64D"


def test_a_bare_stage_config_is_a_precompile_item_the_tuner_never_runs():
    be = mtr.TritonMoeBackend()
    key = MoeKey(4, 7168, 256, 256, 8)
    name = mtr.stage_sweep(key, 2)[0].name
    sol = be.solution_from_row(0, name, 0)
    assert sol is not None and sol.kernel_name == name and not be.supports(sol, key, META)
    assert be.solution_from_row(0, join_name(name, name), 0) is None  # a stage-2 config is no stage 1


# ---- Triton's interpreter: an item builds and runs end to end ---------------------------------------------
def _interp_main() -> None:
    """Each kind of item of a small key built and run by the pool's worker code, on the CPU."""
    from gemmtune.backends.lib.triton_tiles import _precompile_worker
    from gemmtune.kernels.fused_moe import stage1_ref

    f32 = dict(dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    key = MoeKey(2, 1024, 256, 64, 8, **f32)  # 16 slots: both modes, stage 1 split; the items' keys are small
    be = mtr.TritonMoeBackend()
    cpu = torch.device("cpu")
    items = be.compile_items([(s, key) for s in be.candidates(key, cpu)])  # the heuristic and grouped_mm pairs
    pick = {}
    for name, small in items:
        kind = "glue" if "|" in name else name.split("_bm")[0] + ("_split" if "_sk1_" not in name else "")
        pick.setdefault(kind, (name, small))
    names, keys = zip(*pick.values(), strict=True)
    failed = _precompile_worker((mtr.TritonMoeBackend, list(names), list(keys), "cpu"))
    # a stage-1 item's runner computes the stage-1 rows
    name, small = pick["moe1_direct_split"]
    (inp,) = fmoe.FAMILY.make_inputs(small, cpu, 1, 0)
    out = be.make_runner(be.solution_from_row(0, name, 0), small, cpu)(*inp)
    ref = stage1_ref(inp[0], inp[1], inp[3], inp[4], "silu", inter=small.inter_dim)
    err = ((out.h - ref).norm() / ref.norm()).item()
    print(json.dumps({"kinds": sorted(pick), "failed": [str(f) for f in failed], "err": err}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below builds the items for real")
def test_each_kind_of_item_builds_and_runs_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interp"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["failed"] == []
    assert set(got["kinds"]) >= {"glue", "moe1_direct", "moe1_direct_split", "moe2_direct", "moe2_direct_split",
                                 "moe1_sorted", "moe2_sorted"}  # fmt: skip
    assert got["err"] < 1e-5


# ---- GPU: a tune's stage configs load what the precompile compiled --------------------------------------
def _gpu_main(cache: str) -> None:
    from gemmtune.tuner.candidates import TuneOptions
    from gemmtune.tuner.search import precompile_all

    dev = torch.device("cuda")
    keys = [MoeKey(4, 1024, 256, 64, 8), MoeKey(64, 1024, 256, 16, 2)]  # a grid over slots, split; sorted
    cubins = lambda: sorted(str(p) for p in pathlib.Path(cache).rglob("*") if p.suffix in (".cubin", ".hsaco"))
    fails = precompile_all(keys, dev, TuneOptions(), workers=4, family="fmoe")
    before = cubins()
    be = mtr.TritonMoeBackend()
    for key in keys:
        sets = fmoe.FAMILY.make_inputs(key, dev, 1, 0)
        for stage in (1, 2):
            for name in be.stage_candidates(key, dev, stage):
                be.make_stage_runner(stage, name, key, dev)(*fmoe.FAMILY.stage_inputs(key, stage, sets)[0])
        for sol in be.candidates(key, dev):
            be.make_runner(sol, key, dev)(*sets[0])
    torch.cuda.synchronize()
    new = sorted(set(cubins()) - set(before))
    print(json.dumps({"fails": [str(f) for f in fails], "before": len(before), "new": new}))


@pytest.mark.gpu
def test_a_tunes_stage_configs_add_no_binary_to_a_cache_the_precompile_filled(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, __file__, "--gpu", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fails"] == [] and got["before"] > 0
    assert got["new"] == []


if __name__ == "__main__":
    if sys.argv[1] == "--interp":
        _interp_main()
    else:
        _gpu_main(sys.argv[2])
