"""The fmoe family's `triton` backend: every pair with a Triton stage (`moe1_...|moe2_...`, the other stage
may be `grouped_mm`), and `grouped_mm|grouped_mm` with gemmtune's Triton kernels around the two
torch._grouped_mm GEMMs (the sort by expert, gated activation and combine: fmoe/stages.py's glue).
Its kernels compile on their first call; the tuner compiles them ahead (precompile.py: its items, each a
stage config or the glue in one call form, are built by precompile.ItemBuilder, not as solutions).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch

from ...device import Needs, facts
from ...families.fmoe import MoeKey, act_name, join_name, split_name
from ...kernels import fused_moe as kmoe
from ..base import Backend, Runner, Solution
from . import precompile
from .stages import GM, TRITON_DTYPES, Stage, grouped_mm_fits, pair_runner, parse_stage, stage_name, stage_runner


@dataclass(frozen=True)
class Stage1Split:
    """When stage 1 splits H (its K). Fine-grained experts at decode give stage 1 few programs (experts
    hit x I / BLOCK_N, e.g. 8 x 4 at E 256, I 256, T 1), each walking all of H: too few loads in flight to
    stream the weights at full bandwidth. Splitting H multiplies the programs; the last split of each
    tile sums the fp32 partials and finishes the rows (kernels/fused_moe.py). The untuned rule's
    constants, all here (tune them on a GPU: benchmarks/bench_moe.py --part grid --ab-stage1-split)."""

    max_waves: float = 2.0  # the default splits while stage 1's programs fit this many waves of SMs
    min_k_steps: int = 4  # every split still walks at least this many BLOCK_K steps of H
    max_split: int = 16
    sweep_waves: float = 4.0  # the tuner's stage-1 candidates split up to this many waves
    # The default takes a split past one wave only if its last wave is at least this full: a half-empty
    # second wave runs some SMs twice as long, which undoes the split (E=128 I=384 top 8 at T = 1: 96
    # programs, split 2 -> 192 = 1.45 waves was slower than unsplit).
    min_last_wave: float = 0.9


STAGE1_SPLIT = Stage1Split()


@dataclass(frozen=True)
class ByToken:
    """When the default's stage 2 is a by-token launch (kernels/fused_moe.py moe_down_by_token: a program per
    (token, N tile) walks the token's experts and sums them, so no combine kernel runs), and its tiles.
    Decode with fewer slots than experts, where a program's walk (its experts x I) stays short: one token
    up to max_i_one_token, up to max_tokens tokens of fine-grained experts (I <= max_i). The token's
    experts split over up to max_split programs while the grid stays within one wave of SMs (the last
    split sums the partials); past one wave, 3 pipeline stages instead of 4 keep more programs resident.
    Measured on an H100 against the slot-grid stage 2 and its combine (benchmarks/results/h100/
    fused_moe_op/grid_default.md, A/B): 1.01-1.14x at 17 of the 18 grid points it takes (E=64 I=1024
    top 8 at T = 1: 1.6% slower); in a first sweep it lost at T = 1 with I >= 4096 (E=8, E=16) and past
    one token with I >= 1024."""

    max_tokens: int = 8
    max_i: int = 512
    max_i_one_token: int = 1536
    block_n: int = 64
    block_k: int = 128
    max_split: int = 4


BY_TOKEN = ByToken()
# Stage 1 of fine-grained experts (I <= BY_TOKEN.max_i) takes the narrow tiles while its BLOCK_N 64
# programs fill fewer than this many waves of SMs (others below one wave), with 3 pipeline stages past one
# wave. H100 (grid_default.md, A/B): E=128 I=384 top 8 at T = 4, 192 programs, 36.9 -> 35.2 us alone;
# the band at every I (a first A/B round) moved I >= 1024 points by 0.98-1.01x, so it stays fine-grained.
NARROW_STAGE1_WAVES = 2


def by_token_stage2(key: MoeKey, sms: int) -> kmoe.MoeGemmConfig | None:
    """The default's by-token stage 2 for `key`, or None where the slot-grid stage 2 and the combine stay."""
    rule = BY_TOKEN
    tk = key.topk + key.shared_expert
    max_i = rule.max_i_one_token if key.token == 1 else rule.max_i
    if key.token > rule.max_tokens or key.slots > key.expert or key.inter_dim > max_i:
        return None
    programs = key.token * -(-key.model_dim // rule.block_n)
    split = 1
    while split * 2 <= min(rule.max_split, tk) and programs * split * 2 <= sms:
        split *= 2
    stages = 4 if programs * split <= sms else 3
    return kmoe.MoeGemmConfig(2, True, 16, rule.block_n, rule.block_k, split, 4, stages, by_token=True)


def stage1_programs(key: MoeKey, block_m: int, block_n: int) -> int:
    """Programs of an unsplit stage 1 that do work: experts hit (at most) x row blocks x N tiles."""
    slots = key.slots
    hit = max(1, min(key.expert, slots))
    per_expert = -(-slots // hit)
    return hit * max(1, -(-per_expert // block_m)) * -(-key.inter_dim // block_n)


def stage1_splits(key: MoeKey, c1: kmoe.MoeGemmConfig, sms: int, waves: float) -> list[int]:
    """Splits of H (powers of 2 > 1) for stage-1 config c1 whose programs fit `waves` waves of SMs and
    whose every split walks >= min_k_steps BLOCK_K steps; none when c1 alone has as many programs as SMs."""
    rule = STAGE1_SPLIT
    programs = stage1_programs(key, c1.block_m, c1.block_n)
    if programs >= sms or not replace(c1, split_k=2).fits(key.slots):  # a split where it may run at all
        return []
    k_steps = -(-key.model_dim // c1.block_k)
    out, split = [], 2
    while split <= rule.max_split and programs * split <= waves * sms and k_steps // split >= rule.min_k_steps:
        out.append(split)
        split *= 2
    return out


def _full_wave_splits(key: MoeKey, c1: kmoe.MoeGemmConfig, sms: int) -> list[int]:
    """The default's splits: stage1_splits up to max_waves, past one wave only with a full last wave."""
    programs = stage1_programs(key, c1.block_m, c1.block_n)

    def full(split: int) -> bool:
        n = programs * split
        return n <= sms or (n % sms == 0) or n % sms >= STAGE1_SPLIT.min_last_wave * sms

    return [s for s in stage1_splits(key, c1, sms, STAGE1_SPLIT.max_waves) if full(s)]


def heuristic_configs(key: MoeKey, sms: int = 132) -> tuple[kmoe.MoeGemmConfig, kmoe.MoeGemmConfig]:
    """A reasonable (stage 1, stage 2) pair for an untuned key.

    The direct-mode adjustments come from a grid of 12 expert shapes x T 1..4096 on an H100, the untuned
    default against transformers' grouped_mm / batched_mm, and the tuner's winners at the points where it
    lost (benchmarks/results/h100/fused_moe_op/): with many slots per expert (coarse experts, T ~ 64) a
    taller stage-1 tile and a split stage 2; with fewer stage-1 programs than SMs (fine-grained experts
    at decode) a narrow stage-1 tile with long K steps, split over H (STAGE1_SPLIT), and a wide, short-K
    stage 2 where I is small."""
    slots = key.slots
    hit = max(1, min(key.expert, slots))
    per_expert = slots / hit
    direct = slots <= 128
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 256 else 128
    big = bm >= 64
    bk = 64 if big else 128
    bn1 = 64 if not big else 128 if bm == 64 else 64
    bm1, bk1, stages1 = bm, bk, 3 if not big else 4
    crowded = direct and per_expert > 8  # a direct tile re-reads its expert for every 16 slots
    few_programs = direct and hit * -(-2 * key.inter_dim // bn1) < sms
    if crowded:
        bm1 = max(bm1, 32)
    c1 = kmoe.MoeGemmConfig(1, direct, bm1, bn1, bk1, 1, 4 if bm1 < 128 else 8, stages1)
    narrow_waves = NARROW_STAGE1_WAVES if key.inter_dim <= BY_TOKEN.max_i else 1
    if direct and stage1_programs(key, bm1, 64) < narrow_waves * sms:
        # Few stage-1 programs (fine-grained experts at decode): narrow tiles give twice the programs, each
        # walking H in long K steps, then the split over H keeps the SMs streaming. Below one wave they
        # are 1.01-1.17x faster than BLOCK_N 64 / BLOCK_K 64 or 128 at 13 of the 14 grid points measured
        # (H100, grid_default.md: E=128 I=1024 top 1 at T = 1 23.1 -> 19.8 us); between one and two
        # waves, where BLOCK_N 64 leaves the last wave part empty, see NARROW_STAGE1_WAVES.
        c1 = replace(c1, block_n=32, block_k=128, stages=4 if stage1_programs(key, bm1, 64) < sms else 3)
    if direct:
        c1 = replace(c1, split_k=max(_full_wave_splits(key, c1, sms), default=1))
    n_tiles = -(-key.model_dim // 64)
    programs = hit * n_tiles * max(1, -(-slots // hit // bm))
    sk = 1
    while sk < 8 and programs * sk * 2 <= 2 * sms and key.inter_dim // (2 * sk * bk) >= 2:
        sk *= 2
    if crowded and key.inter_dim // (2 * 2 * bk) >= 2:
        sk = max(sk, 2)
    bn2, bk2, stages2 = 64 if not big else 128, bk, 3 if not big else 4
    if few_programs and key.inter_dim <= 512:
        bn2, bk2, stages2 = 128, 64, 4
    elif direct and key.inter_dim <= 384:
        # Fine-grained experts past the first tokens: a wide, long-K stage 2 (H100, A/B in grid_default.md:
        # E=128 I=384 T 4 / 8 / 16: 66.0 / 109.0 / 143.4 -> 61.5 / 100.0 / 139.9 us; E=256 I=256 T 4 / 8:
        # 133.0 / 245.9 -> 124.7 / 219.2 us; at I = 512 (E=512 top 10) it was up to 2.6% slower)
        bn2, bk2, stages2 = 128, 128, 4
    c2 = kmoe.MoeGemmConfig(2, direct, bm, bn2, bk2, sk, 4 if bm < 128 else 8, stages2)
    return c1, (by_token_stage2(key, sms) if direct else None) or c2


def sweep_configs(key: MoeKey, sms: int = 132) -> list[tuple[kmoe.MoeGemmConfig, kmoe.MoeGemmConfig]]:
    """Candidate (stage 1, stage 2) pairs worth timing for `key` (the heuristic first); stage 1 split over
    H where it has fewer programs than SMs (stage1_splits)."""
    slots = key.slots
    out = [heuristic_configs(key, sms)]
    modes = [True, False] if slots <= kmoe.DIRECT_MAX_SLOTS else [False]
    for direct in modes:
        for bm in (16, 32, 64, 128):
            if bm > 16 and bm >= 2 * max(16, slots):
                continue
            for bn, bk, w, s in ((64, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3)):
                if bm == 128 and w == 4 and bn == 128:
                    continue
                c1 = kmoe.MoeGemmConfig(1, direct, bm, bn, bk, 1, w, s)
                for sk1 in (1, *stage1_splits(key, c1, sms, STAGE1_SPLIT.sweep_waves)):
                    for sk in (1, 2, 4) if bm <= 32 else (1,):
                        pair = (replace(c1, split_k=sk1), kmoe.MoeGemmConfig(2, direct, bm, bn, bk, sk, w, s))
                        if pair not in out:
                            out.append(pair)
    if key.slots <= min(key.expert, kmoe.DIRECT_MAX_SLOTS):  # by-token stage 2 after the heuristic stage 1
        for bn, sk in itertools.product((32, 64), (1, 2, 4)):
            pair = (out[0][0], kmoe.MoeGemmConfig(2, True, 16, bn, 128, sk, 4, 4, by_token=True))
            if pair not in out:
                out.append(pair)
    # Nearest the heuristic first (block_m, then mode, then stage 1's split), so a short sweep tries the
    # likely winners.
    h1 = out[0][0]
    rest = sorted(out[1:], key=lambda p: (abs(p[0].block_m.bit_length() - h1.block_m.bit_length()),
                                          p[0].direct != h1.direct,
                                          abs(p[0].split_k.bit_length() - h1.split_k.bit_length())))  # fmt: skip
    return out[:1] + rest


def stage_configs(key: MoeKey, stage: int) -> list[kmoe.MoeGemmConfig]:
    """The distinct configs of one stage among sweep_configs' pairs, in their order (heuristic first)."""
    return list(dict.fromkeys(pair[stage - 1] for pair in sweep_configs(key)))


def solution_of(s1: Stage, s2: Stage) -> Solution:
    """This backend's solution for a pair (solidx: its Triton stage's block_m, 0 for the glued grouped_mm
    pair; splitK: stage 2's)."""
    tri = s1 if s1 != GM else s2
    block_m = 0 if tri == GM else tri.block_m
    return Solution("triton", join_name(stage_name(s1), stage_name(s2)), block_m, 1 if s2 == GM else s2.split_k)


GROUPED_MM_GLUED = solution_of(GM, GM)  # torch._grouped_mm GEMMs with the Triton sort, activation, combine


@functools.cache
def _stages_of(kernel_name: str) -> tuple[Stage, Stage] | None:
    """(stage 1, stage 2) of a pair this backend runs (a Triton stage, or two glued grouped_mm), else None."""
    n1, n2 = split_name(kernel_name)
    s1, s2 = parse_stage(n1, 1), parse_stage(n2, 2)
    if s1 is None or s2 is None:
        return None
    return s1, s2


def _triton_stage_ok(key: MoeKey) -> bool:
    return key.q_type == "QuantType.No" and key.dtype in TRITON_DTYPES and act_name(key.act_type) in kmoe.ACTS


def stage_sweep(key: MoeKey, stage: int) -> list[kmoe.MoeGemmConfig]:
    """The Triton configs of one stage the tuner times apart for `key` (stage_configs that fit its slots)."""
    if not _triton_stage_ok(key):
        return []
    return [c for c in stage_configs(key, stage) if c.fits(key.slots)]


class TritonMoeBackend(Backend):
    name = "triton"
    family = "fmoe"
    needs = Needs(triton=True)

    def candidates(self, key: MoeKey, device: torch.device) -> list[Solution]:
        """The heuristic pair and the grouped_mm pair with Triton glue: the tuner draws every other pair
        from the stages timed apart."""
        sols = [self.default_solution(key, device), GROUPED_MM_GLUED]
        return [s for s in sols if self.supports(s, key, device)]

    def default_solution(self, key: MoeKey, device: torch.device) -> Solution:
        """The heuristic pair of Triton stages."""
        return solution_of(*heuristic_configs(key, facts(device).sms))

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        stages = _stages_of(kernel_name)
        return solution_of(*stages) if stages else None

    def supports(self, solution: Solution, key: MoeKey, device: torch.device) -> bool:
        stages = _stages_of(solution.kernel_name)
        if solution.libtype != self.name or stages is None or not _triton_stage_ok(key):
            return False
        if GM in stages and not grouped_mm_fits(key, device):
            return False
        return all(s.fits(key.slots) for s in stages if s != GM)

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        stages = _stages_of(solution.kernel_name)
        if stages is None:
            raise ValueError(f"not a Triton fused-MoE solution: {solution.kernel_name!r}")
        return pair_runner(key, *stages, triton_glue=True)

    def compile_items(self, jobs: list[tuple[Solution, MoeKey]], scope=None) -> list[tuple[str, MoeKey, type]]:
        """(item name, stand-in key, its builder) that compile the Triton kernels a tune of the jobs' keys runs
        (precompile.py); `scope` (tuner/search.py CompileScope) adds the range verification's token counts."""
        return precompile.compile_items(jobs, stage_sweep, scope)

    # stages: every Triton config of the sweep, per stage
    def stage_candidates(self, key: MoeKey, device: torch.device, stage: int) -> list[str]:
        return [c.name for c in stage_sweep(key, stage)]

    def make_stage_runner(self, stage: int, name: str, key: MoeKey, device: torch.device) -> Runner:
        s = parse_stage(name, stage)
        if s is None or s == GM:
            raise ValueError(f"not a Triton fused-MoE stage-{stage} config: {name!r}")
        return stage_runner(key, stage, s, triton_glue=True)

    def pair_solution(self, names: tuple[str, ...], key: MoeKey, device: torch.device) -> Solution | None:
        """A pair with a Triton stage; two grouped_mm stages are the torch backend's pair (this backend's
        glued twin of it is among its candidates)."""
        stages = _stages_of(join_name(*names))
        return solution_of(*stages) if stages and stages != (GM, GM) else None


BACKENDS = (TritonMoeBackend(),)
