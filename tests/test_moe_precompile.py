"""The fmoe triton backend's precompile (backends/fmoe/precompile.py, launches.py): its items for a list of
keys, one per binary, and stand-in keys that compile the real key's binaries on little memory.

The stand-in property is shown on launches recorded instead of run: every fmoe Triton kernel's `run` is
replaced by one that asks Triton's own binder (with a CUDA backend, no GPU needed) how it would specialize
the call (the key of its binary cache: each argument's specialization, constexprs, options), and the
runners run on meta tensors, so the real keys (DeepSeek-V3's 256 experts: 7.5 GB for stage 1) cost
nothing. The recorded tune's launches: the stage sweep, each whole candidate in every call form of the
full check (families/fmoe.py check_variants), and at the range verification's token counts the candidates
that can win (every form) and the default there. On the CPU the items also build and run under Triton's
interpreter; on a GPU, a tune's launches add no binary to a cache its items filled.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from tiers import SWEEP_TIERS, tiered_at

from gemmtune.backends.fmoe import launches
from gemmtune.backends.fmoe import precompile as pc
from gemmtune.backends.fmoe import stages as mst
from gemmtune.backends.fmoe import triton as mtr
from gemmtune.backends.fmoe.policy import prefers_grouped_mm
from gemmtune.backends.fmoe.precompile import GLUE, ItemBuilder, describe_item, parse_item, stand_in
from gemmtune.backends.fmoe.stages import GM
from gemmtune.families import fmoe
from gemmtune.families.fmoe import MoeKey, join_name
from gemmtune.kernels.fused_moe import MoeGemmConfig
from gemmtune.tuner.candidates import TuneOptions
from gemmtune.tuner.search import CompileScope

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


# Each key's M floor, as a tune of a list of shapes gets it (one above the next smaller token count): the
# range verification walks range_points(floor, T) (none for the T = 1 key).
FLOORS = {KEYS[1]: 2, KEYS[2]: 17, KEYS[3]: 65, KEYS[4]: 2, ODD_KEYS[0]: 1, ODD_KEYS[1]: 4, ODD_KEYS[2]: 2}
FORMS = ("", *launches.FORMS)


class H100Scope(CompileScope):
    """The tune's scope as an H100 gives it: the default there is the heuristic pair (132 SMs), or the
    grouped_mm pair for keys with many slots per expert; the range keys come from the floors."""

    def default(self, key):
        if key.dtype == torch.bfloat16 and prefers_grouped_mm(key):
            return GM_GLUED
        return mtr.solution_of(*mtr.heuristic_configs(key, 132))


def scope_of(search: str = "fast", floors=None, **opts) -> H100Scope:
    return H100Scope(fmoe.FAMILY, META, TuneOptions(search=search, **opts), FLOORS if floors is None else floors)


def candidates_of(key, glued: bool = True):
    """The backend's candidates for `key` as an H100 offers them: the heuristic pair (132 SMs) and, in
    bf16, the grouped_mm pair with the Triton glue."""
    gm = [GM_GLUED] if glued and key.dtype == torch.bfloat16 else []
    return [mtr.solution_of(*mtr.heuristic_configs(key, 132)), *gm]


def jobs_of(keys, glued: bool = True):
    return [(s, k) for k in keys for s in candidates_of(k, glued)]


def items_of(keys, glued: bool = True, scope=None):
    return mtr.TritonMoeBackend().compile_items(jobs_of(keys, glued), scope=scope)


def launched_by_items(items) -> set:
    return {launch for name, key, _ in items for launch in describe_item(name)(key)}


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
    monkeypatch.setattr(mst, "pdl_enabled", lambda device: True)  # as on an sm90 GPU: PDL launches specialize
    backend = make_backend(GPUTarget("cuda", 90, 32))
    log: list = []
    for k in (kmoe._moe_gemm_direct, kmoe._moe_gemm_sorted, kmoe._moe_down_by_token, kmoe._combine,
              moe_route._expert_sort_kernel, activations._act_mul_kernel):  # fmt: skip
        if not isinstance(k, JITFunction):
            pytest.skip("Triton's interpreter is on in this process")
        binder = create_function_from_signature(k.signature, k.params, backend)

        def run(*args, grid, warmup, _name=k.fn.__name__, _bind=binder, **kwargs):
            _, specialization, options = _bind(*args, **kwargs)
            log.append((_name, str(specialization), tuple(sorted((n, str(v)) for n, v in options.items()))))

        monkeypatch.setattr(k, "run", run)

    def launched(key, name: str, form: str | None = None) -> frozenset:
        """The launches of building precompile item `name` on `key` (form None), or of the tuner's call of
        the backend's solution `name` on `key`'s inputs in call form `form` ('' as made)."""
        (inputs,) = fmoe.FAMILY.make_inputs(key, META, 1, 0)
        del log[:]
        if form is None:
            ItemBuilder().build_item(name, key, META)
            return frozenset(log)
        be = mtr.TritonMoeBackend()
        if form:
            (inputs,) = [args for what, args, _ in fmoe.FAMILY.check_variants(key, inputs)
                         if what == launches.FORMS[form]]  # fmt: skip
        del log[:]
        be.make_runner(be.solution_from_row(0, name, 0), key, META)(*inputs)
        return frozenset(log)

    return launched


def tune_calls(key, scope, glued: bool = True) -> list[tuple[str, MoeKey, str | None]]:
    """(name, key, form) of what a tune of `key` runs Triton kernels for, as `record` takes them: every
    stage config it times (alone, as the items' builder runs it), each candidate pair in every call form
    (the default's full check, the would-be winner's), and at each range key the candidates that can win
    in every form and the default there; the exhaustive search checks every stage pair fully."""
    cands = candidates_of(key, glued)
    sweep = [c for s in (1, 2) for c in mtr.stage_sweep(key, s)]
    out = [(c.name, key, None) for c in sweep]
    out += [(s.kernel_name, key, f) for s in cands for f in FORMS]
    for km in scope.range_keys(key):
        out += [(s.kernel_name, km, f) for s in cands if s != scope.default(key) for f in FORMS]
        out.append((scope.default(km).kernel_name, km, ""))
    if scope.opts.search == "exhaustive":  # every pair of a stage-1 and a stage-2 config, grouped_mm too
        ones = [c.name for c in sweep if c.stage == 1] + [GM]
        twos = [c.name for c in sweep if c.stage == 2] + [GM]
        out += [(join_name(a, b), key, f) for a in ones for b in twos if (a, b) != (GM, GM) for f in FORMS]
    return out


# The default tier: a grid over slots split at decode, the sorted Qwen3 key and the fp16 ungated GELU one.
@pytest.mark.parametrize("key", tiered_at(KEYS + ODD_KEYS, {1, 3, 7}), ids=lambda k: fmoe.FAMILY.describe(k))
def test_each_stand_in_makes_the_real_keys_launches_and_the_items_make_every_launch_of_its_tune(key, record):
    scope = scope_of()
    items = items_of([key], scope=scope)
    made = set()
    for _, small, builder in items:
        assert builder is ItemBuilder
        assert fmoe.FAMILY.set_bytes(small) <= fmoe.FAMILY.set_bytes(key)
    for name, small, _ in items:
        # the key the item stands in for: the tuned key, or one of its range keys (another token count)
        for real in (key, *scope.range_keys(key)):
            if describe_item(name)(real) == describe_item(name)(small):
                break
        else:
            pytest.fail(f"{name}: {small} stands in for no key of the tune")
        launched = record(small, name)
        assert launched == record(real, name), f"{name}: {small} launches otherwise than {real}"
        made |= launched
    calls = tune_calls(key, scope)
    for name, k, form in calls:
        assert record(k, name, form) <= made, f"{name} on {k} ({form or 'as made'}) launches a kernel no item compiles"
    assert len(items) <= len(calls)


@pytest.mark.parametrize("key", tiered_at([KEYS[1], KEYS[3], ODD_KEYS[1]], {2}), ids=lambda k: fmoe.FAMILY.describe(k))
def test_for_the_exhaustive_search_the_items_also_make_every_stage_pair_in_every_call_form(key, record):
    """The exhaustive search gives every pair the full check (the stage phase's fastest: any of them)."""
    scope = scope_of("exhaustive")
    items = items_of([key], scope=scope)
    made = set()
    for name, small, _ in items:
        made |= record(small, name)
    calls = tune_calls(key, scope)
    pairs = [c for c in calls if "|" in c[0]]
    for name, k, form in pairs[:: max(1, len(pairs) // 60)]:  # a spread of them: each records in ~ms
        assert record(k, name, form) <= made, f"{name} ({form or 'as made'}) launches a kernel no item compiles"
    assert len(items) > len(items_of([key], scope=scope_of()))


def test_the_stand_ins_are_small():
    """Every item of the representative keys builds on under 256 MB of weights and activations (their real
    keys: 1.2 to 2.8 GB; an item in another call form holds a second copy of its set at most), the range's
    and the exhaustive search's too."""
    for scope in (None, scope_of(), scope_of("exhaustive")):
        worst = max(fmoe.FAMILY.set_bytes(k) for _, k, _ in items_of(KEYS, scope=scope))
        assert worst < 256e6 < max(fmoe.FAMILY.set_bytes(k) for k in KEYS)
    direct = [k for n, k, _ in items_of(KEYS[:1]) if n.startswith("moe1_direct")]
    assert direct and all(k.expert > k.token * k.topk for k in direct)  # still a grid over slots


def test_the_description_tells_binaries_apart_exactly_as_triton_does(record):
    """launches.py's description of a stage or the glue is equal for two keys exactly when Triton's
    specialization of their launches is: the dedup neither merges two binaries nor keeps one twice."""
    seen: dict = {}
    for key in KEYS + ODD_KEYS:
        names = [c.name for s in (1, 2) for c in mtr.stage_sweep(key, s)]
        if key.dtype == torch.bfloat16:  # torch._grouped_mm runs bf16 (on sm90)
            names.append(GLUE)
        names += [pc.item_name(n, f) for n in names[::4] for f in launches.FORMS]  # each call form
        for name in names:
            seen.setdefault(describe_item(name)(key), set()).add(record(key, name))
    assert all(len(recorded) == 1 for recorded in seen.values())  # one description, one binary set
    assert len({r for recorded in seen.values() for r in recorded}) == len(seen)  # and the other way round


def test_the_items_of_a_list_of_keys():
    keys = KEYS[:2] + [KEYS[3]]
    items = items_of(keys)
    names = [n for n, _, _ in items]
    assert items == items_of(keys)  # deterministic
    assert names.count(GLUE) == 3  # each key's glue sorts into its own bins
    assert {parse_item(n)[1] for n in names} == set(FORMS)  # each call form: the candidates' full check
    described = [describe_item(n)(k) for n, k, _ in items]
    for i, made in enumerate(described):  # each item makes a launch no item before it makes
        assert not set(made) <= {x for earlier in described[:i] for x in earlier}, names[i]
    # every stage config of every key is made by an item of the same description
    units = [launches.stage_launches(k, c) for k in keys for s in (1, 2) for c in mtr.stage_sweep(k, s)]
    assert set(units) <= set(described)
    assert len(items) < len(units)
    # without the grouped_mm pair among the candidates (fp16, or no sm90): no glue item
    assert not [n for n, _, _ in items_of(keys, glued=False) if parse_item(n)[0] == GLUE]
    # a key Triton cannot run has no items
    assert mtr.TritonMoeBackend().compile_items([]) == []
    assert mtr.stage_sweep(MoeKey(1, 64, 64, 8, 2, q_type="QuantType.per_Token"), 1) == []


def test_the_scope_adds_the_range_keys_and_respects_the_options():
    keys = KEYS[:2] + [KEYS[3]]
    plain = items_of(keys)
    fast = items_of(keys, scope=scope_of())
    assert launched_by_items(plain) < launched_by_items(fast)  # the range verification's token counts
    # each range key's default (timed beside the winner there) and the candidate that can win in every form
    for key in keys:
        for km in scope_of().range_keys(key):
            default = scope_of().default(km)
            need = {x for n in pc._solution_units(default) for x in describe_item(n)(km)}
            need |= {x for f in FORMS for x in launches.glue_launches(km, f)}
            assert need <= launched_by_items(fast), km
    # no floors, or no range verification: the candidates at their own key alone
    assert items_of(keys, scope=scope_of(floors={})) == plain
    assert items_of(keys, scope=scope_of(verify_range=False)) == plain
    # --stage-limit: the stage phase times the first N configs of each stage
    limited = items_of(keys, scope=scope_of(floors={}, stage_limit=2))
    assert len(limited) < len(plain)
    sweep = {launches.stage_launches(k, c) for k in keys for s in (1, 2) for c in mtr.stage_sweep(k, s)[:2]}
    assert set().union(*sweep) <= launched_by_items(limited)
    # the exhaustive search: every stage config in every call form
    exhaustive = items_of(keys, scope=scope_of("exhaustive"))
    every = {x for k in keys for s in (1, 2) for c in mtr.stage_sweep(k, s) for f in FORMS
             for x in launches.stage_launches(k, c, f)}  # fmt: skip
    assert every <= launched_by_items(exhaustive) and not every <= launched_by_items(fast)


def test_the_call_forms_specialize_what_they_change():
    """Each call form changes the launches it should: the strided hidden state stage 1's A (an address off 16
    bytes in 16-bit), int32 ids the launches that read ids (direct GEMMs, combine, sort), (E, K, N) weights
    the GEMMs' B strides; the others keep their binaries."""
    key = KEYS[0]
    c1, c2 = mtr.heuristic_configs(key, 132)
    sorted1 = MoeGemmConfig(1, False, 16, 64, 128)
    same = lambda describe, form: describe(key, form) == describe(key, "")
    s1 = lambda k, form: launches.stage_launches(k, c1, form)
    s2 = lambda k, form: launches.stage_launches(k, c2, form)
    so1 = lambda k, form: launches.stage_launches(k, sorted1, form)
    glue = lambda k, form: launches.glue_launches(k, form)
    assert not same(s1, "strided") and same(s2, "strided") and same(glue, "strided")
    assert "bfloat16 unaligned" in launches.stage_launches(key, c1, "strided")[0].pointers
    f32 = key._replace(dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    assert "float32" == launches.stage_launches(f32, c1, "strided")[0].pointers[0]  # 16 bytes in: aligned
    assert not same(s1, "ids32") and not same(s2, "ids32") and not same(glue, "ids32") and same(so1, "ids32")
    assert not same(s1, "ekn") and not same(s2, "ekn") and same(glue, "ekn")
    with pytest.raises(ValueError, match="unknown call form"):
        launches.stage_launches(key, c1, "padded")


def test_keys_that_specialize_alike_share_their_items_and_others_do_not():
    a = MoeKey(256, 2048, 768, 128, 8)  # sorted launches; 16 slots per expert hit
    twin = MoeKey(512, 2048, 768, 256, 8)  # twice the tokens and experts: the same binaries
    odd = a._replace(inter_dim=776)  # I not a multiple of 16: other binaries
    assert mtr.heuristic_configs(a) == mtr.heuristic_configs(twin)
    alone = items_of([a], glued=False)
    assert items_of([a, twin], glued=False) == alone  # one item per binary
    both = items_of([a, odd], glued=False)
    plain = lambda items: [n for n, _, _ in items if not parse_item(n)[1]]  # as made: every launch depends on I
    assert len(plain(both)) == 2 * len(plain(alone)) and set(plain(both)) == set(plain(alone))
    # in the other call forms only some do (the combine of int32 ids does not): the union of both keys' binaries
    assert launched_by_items(both) == launched_by_items(alone) | launched_by_items(items_of([odd], glued=False))
    assert len(alone) < len(both) < 2 * len(alone)


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


def test_an_item_is_built_by_its_builder_and_is_no_solution_of_the_backend():
    be = mtr.TritonMoeBackend()
    key = MoeKey(4, 7168, 256, 256, 8)
    cfg = mtr.stage_sweep(key, 2)[0]
    for name in (cfg.name, pc.item_name(cfg.name, "ids32"), pc.item_name(GLUE, "ekn")):
        assert all(b is ItemBuilder for n, _, b in items_of([key]) if n == name)
        assert be.solution_from_row(0, name, 0) is None or name == GLUE  # a table row never names an item
    assert parse_item(pc.item_name(cfg.name, "ids32")) == (cfg, "ids32") and parse_item(GLUE) == (GLUE, "")
    for bad in ("moe2_direct_bm16+padded", cfg.name + "+padded", "tg_bm64_bn64"):
        with pytest.raises(ValueError):
            parse_item(bad)
    assert be.solution_from_row(0, join_name(cfg.name, cfg.name), 0) is None  # a stage-2 config is no stage 1


# ---- Triton's interpreter: an item builds and runs end to end ---------------------------------------------
def _interp_main(tier: str) -> None:
    """Each kind of item of a small key built and run by the pool's worker code, on the CPU: the default
    tier builds every other kind in name order, the slow tier the rest."""
    from gemmtune.backends.lib.triton_tiles import _precompile_worker
    from gemmtune.kernels.fused_moe import stage1_ref

    f32 = dict(dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    key = MoeKey(2, 1024, 256, 64, 8, **f32)  # 16 slots: both modes, stage 1 split; the items' keys are small
    be = mtr.TritonMoeBackend()
    cpu = torch.device("cpu")
    scope = CompileScope(fmoe.FAMILY, cpu, TuneOptions(search="exhaustive"))  # every stage config in every form
    items = be.compile_items([(s, key) for s in be.candidates(key, cpu)], scope=scope)
    pick = {}
    for name, small, builder in items:
        unit, form = parse_item(name)
        kind = "glue" if unit == GLUE else name.split("_bm")[0] + ("_split" if unit.split_k > 1 else "")
        pick.setdefault(kind + (f"+{form}" if form else ""), (name, small, builder))
    built = sorted(pick)[tier == "slow" :: 2]
    names, keys, (builder, *_) = zip(*(pick[kind] for kind in built), strict=True)
    failed = _precompile_worker((builder, list(names), list(keys), "cpu"))
    # a stage-1 item's runner computes the stage-1 rows, in its call form too
    errs = []
    for kind in ("moe1_direct_split", "moe1_direct_split+ekn"):
        name, small, _ = pick[kind]
        (inp,) = fmoe.FAMILY.make_inputs(small, cpu, 1, 0)
        out = pc.item_runner(name, small)(*inp)
        ref = stage1_ref(inp[0], inp[1], inp[3], inp[4], "silu", inter=small.inter_dim)
        errs.append(((out.h - ref).norm() / ref.norm()).item())
    print(json.dumps({"kinds": sorted(pick), "built": built, "failed": [str(f) for f in failed], "err": max(errs)}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below builds the items for real")
@pytest.mark.slow
@pytest.mark.parametrize("tier", SWEEP_TIERS)
def test_each_kind_of_item_builds_and_runs_under_the_interpreter(tier):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interp", tier], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["built"] == got["kinds"][tier == "slow" :: 2] and got["failed"] == []
    assert set(got["kinds"]) >= {"glue", "moe1_direct", "moe1_direct_split", "moe2_direct", "moe2_direct_split",
                                 "moe1_sorted", "moe2_sorted", "glue+ids32", "moe1_direct_split+strided",
                                 "moe1_direct_split+ekn", "moe2_direct+ids32", "moe2_direct+ekn"}  # fmt: skip
    assert got["err"] < 1e-5


# ---- GPU: a tune's launches load what the precompile compiled ----------------------------------------------
def _gpu_main(cache: str) -> None:
    from gemmtune import backends
    from gemmtune.tuner.search import precompile_all

    dev = torch.device("cuda")
    keys = [MoeKey(4, 1024, 256, 64, 8), MoeKey(64, 1024, 256, 16, 2)]  # a grid over slots, split; sorted
    floors = {keys[0]: 2, keys[1]: 5}
    cubins = lambda: sorted(str(p) for p in pathlib.Path(cache).rglob("*") if p.suffix in (".cubin", ".hsaco"))
    opts = TuneOptions()
    fails = precompile_all(keys, dev, opts, workers=4, family="fmoe", floors=floors)
    before = cubins()
    be = mtr.TritonMoeBackend()
    scope = CompileScope(fmoe.FAMILY, dev, opts, floors)

    def run_in_every_form(sol, key):
        (inp,) = fmoe.FAMILY.make_inputs(key, dev, 1, 0)
        run = backends.get(sol.libtype, "fmoe").make_runner(sol, key, dev)
        for args in [inp, *(args for _, args, _ in fmoe.FAMILY.check_variants(key, inp))]:
            run(*args)

    for key in keys:
        sets = fmoe.FAMILY.make_inputs(key, dev, 1, 0)
        for stage in (1, 2):
            for name in be.stage_candidates(key, dev, stage):
                be.make_stage_runner(stage, name, key, dev)(*fmoe.FAMILY.stage_inputs(key, stage, sets)[0])
        cands = be.candidates(key, dev)
        for sol in cands:  # the default's full check, the would-be winner's
            run_in_every_form(sol, key)
        for km in scope.range_keys(key):  # the candidates that can win there, the default there
            for sol in cands:
                if sol != scope.default(key):
                    run_in_every_form(sol, km)
            (inp,) = fmoe.FAMILY.make_inputs(km, dev, 1, 0)
            default_backend, default = backends.default("fmoe", km, dev)
            default_backend.make_runner(default, km, dev)(*inp)
    torch.cuda.synchronize()
    new = sorted(set(cubins()) - set(before))
    print(json.dumps({"fails": [str(f) for f in fails], "before": len(before), "new": new}))


@pytest.mark.gpu
def test_a_tunes_launches_add_no_binary_to_a_cache_the_precompile_filled(tmp_path):
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
        _interp_main(sys.argv[2])
    else:
        _gpu_main(sys.argv[2])
