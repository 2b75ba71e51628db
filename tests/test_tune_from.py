"""`gemmtune tune SHAPES --from DONOR.csv`: a donor table's winners re-verified here, on the CPU, with
scripted timings (a virtual clock: a kernel's delay advances it without waiting, conftest.VirtualClock).

The `tiles` plugin backend offers a 3x3 grid of configs, `tl_bm{32,64,128}_s{2,3,4}`, each as slow as
TILE_DELAYS says (virtual seconds; 0.03 for any config it does not name), and slows the default by
TILE_DEFAULT_DELAY, in workers too; it compiles its kernels ahead (compile_items), as Triton's do. The
`algos` plugin backend stands for a library (cuBLASLt): ready-made kernels (no compile_items), listed
in its heuristic's order per mode (plain, then `_fa`), each as slow as TILE_DELAYS says (0.03 else)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune import backends, families
from gemmtune.backends.a16w16.pytorch import TorchBackend
from gemmtune.backends.base import Solution, stable_solidx
from gemmtune.capture import key_to_record
from gemmtune.cli.main import cli
from gemmtune.configs.schema import UNTUNED_COLUMNS, TunedRow
from gemmtune.configs.table import ConfigTable, read_table_file
from gemmtune.device import identity
from gemmtune.keys import GemmKey
from gemmtune.tuner import donor as donor_mod
from gemmtune.tuner.donor import CARRIED, DEFAULT_KEPT, FULL_SEARCH, NEIGHBOUR, DonorError, neighbours
from gemmtune.tuner.output import PROFILE_COLUMNS
from gemmtune.tuner.runner import PLUGINS_ENV, summary_lines, tune_file
from gemmtune.tuner.search import TuneOptions

CPU = torch.device("cpu")
HERE = identity(CPU)
GRID = [f"tl_bm{bm}_s{s}" for bm in (32, 64, 128) for s in (2, 3, 4)]
PICK = "tl_bm64_s3"
PICK_NEIGHBOURS = {"tl_bm32_s3", "tl_bm128_s3", "tl_bm64_s2", "tl_bm64_s4"}
KEY = GemmKey(16, 32, 32, False, torch.float32, torch.float32)
OTHER = GemmKey(16, 48, 32, False, torch.float32, torch.float32)  # a shape the donor lacks
OPTS = TuneOptions(reps=7, screen_reps=5)
H100_A8W8 = Path(__file__).resolve().parent.parent / "benchmarks/results/h100/optimize_fp8/a8w8_tuned.csv"

PLUGIN = textwrap.dedent(
    """
    import json, os, time
    import torch.nn.functional as F
    from gemmtune import backends, families
    from gemmtune.backends.a16w16.pytorch import TorchBackend
    from gemmtune.backends.base import Backend, Solution, stable_solidx

    GRID = [f"tl_bm{bm}_s{s}" for bm in (32, 64, 128) for s in (2, 3, 4)]
    CALLS = []  # kernel names run in this process


    class _Clock:
        def __init__(self):
            self.real, self.extra = time.perf_counter, 0.0

        def __call__(self):
            return self.real() + self.extra

        def sleep(self, seconds):
            self.extra += seconds


    def delay(seconds):
        from gemmtune.tuner import timing

        if not hasattr(timing.CPU_CLOCK, "sleep"):  # a worker process: no test installed one
            timing.CPU_CLOCK = _Clock()
        timing.CPU_CLOCK.sleep(seconds)


    class Tiles(Backend):
        name = "tiles"

        def is_available(self, device):
            return True

        def candidates(self, key, device):
            return [Solution("tiles", n, stable_solidx(n)) for n in GRID]

        def solution_from_row(self, solidx, kernel_name, splitk):
            return Solution("tiles", kernel_name, stable_solidx(kernel_name)) if kernel_name in GRID else None

        def supports(self, solution, key, device):
            return True

        def compile_items(self, jobs, scope=None):
            return [(sol.kernel_name, key) for sol, key in jobs]

        def make_runner(self, sol, key, device):
            wait = json.loads(os.environ.get("TILE_DELAYS", "{}")).get(sol.kernel_name, 0.03)

            def run(x, w, b):
                CALLS.append(sol.kernel_name)
                delay(wait)
                return F.linear(x, w, b).to(key.outdtype)

            return run


    # the heuristic's order: the first of each mode is its best guess
    ALGOS = [f"al_a{a}_c{c}{fa}" for fa in ("", "_fa") for a, c in ((1, 3), (1, 2), (2, 0), (1, 0), (1, 1))]


    class Algos(Tiles):
        name = "algos"
        compile_items = None  # a library's kernels: nothing to compile

        def candidates(self, key, device):
            return [Solution("algos", n, stable_solidx(n)) for n in ALGOS]

        def solution_from_row(self, solidx, kernel_name, splitk):
            return Solution("algos", kernel_name, stable_solidx(kernel_name)) if kernel_name in ALGOS else None


    def _slow_default(make):
        def slowed(self, sol, key, device):
            run = make(self, sol, key, device)
            wait = float(os.environ.get("TILE_DEFAULT_DELAY", "0"))

            def slow(x, w, b):
                delay(wait)
                return run(x, w, b)

            return slow

        slowed.tiles_slowed = True
        return slowed


    if not getattr(TorchBackend.make_runner, "tiles_slowed", False):
        TorchBackend.make_runner = _slow_default(TorchBackend.make_runner)
    backends.register(Tiles())
    backends.register(Algos())
    """
)


@pytest.fixture
def tiles(tmp_path, monkeypatch, virtual_clock):
    """The `tiles` plugin importable here and in spawned workers, registered; everything restored after."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "tiles_backend.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(PLUGINS_ENV, "tiles_backend")
    monkeypatch.setenv("TILE_DEFAULT_DELAY", "0.01")
    monkeypatch.setattr(TorchBackend, "make_runner", TorchBackend.make_runner)  # the plugin wraps it
    sys.modules.pop("tiles_backend", None)
    import tiles_backend

    yield tiles_backend
    backends._registry.pop(("a16w16", "tiles"), None)
    backends._registry.pop(("a16w16", "algos"), None)
    sys.modules.pop("tiles_backend", None)


def delays(monkeypatch, **by_name):
    monkeypatch.setenv("TILE_DELAYS", json.dumps(by_name))


def write_shapes(path: Path, keys) -> str:
    path.write_text(",".join(UNTUNED_COLUMNS) + "\n" + "".join(",".join(key_to_record(k)) + "\n" for k in keys))
    return str(path)


def write_donor(path: Path, picks: dict, gfx: str = "gfx942", cu_num: int = 304) -> str:
    """A tuned a16w16 table of another GPU: one row per (key, kernel name)."""
    rows = [TunedRow(gfx, cu_num, k, "tiles", stable_solidx(n), 0, us, n) for k, names in picks.items()
            for n, us in names]  # fmt: skip
    ConfigTable(rows=rows).write(str(path))
    return str(path)


def run_from(tmp_path, keys, picks, **kw):
    shapes = write_shapes(tmp_path / "shapes.csv", keys)
    donor = write_donor(tmp_path / "donor.csv", picks)
    out = tmp_path / "new.csv"
    report = tune_file(shapes, str(out), kw.pop("opts", OPTS), CPU, progress=False, log=lambda m: None,
                       donor=donor, **kw)  # fmt: skip
    return report, out


def by_key(report):
    return {r.key: r for r in report.results}


# ---- the decision ---------------------------------------------------------------------------------
def test_the_donors_pick_is_kept_where_it_beats_the_default_and_only_its_short_list_is_timed(tiles, tmp_path,
                                                                                           monkeypatch):  # fmt: skip
    delays(monkeypatch, **{PICK: 0.0})
    report, out = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.donor == CARRIED and res.winner.kernel_name == PICK and not res.kept_default
    timed = {c.kernel_name for c in res.candidates if c.libtype == "tiles"}
    assert timed == {PICK} | PICK_NEIGHBOURS  # not the whole 3x3 grid
    row = read_table_file(str(out)).rows[0]
    assert (row.gfx, row.cu_num) == (HERE.gfx, HERE.cu_num)  # the donor's rows were gfx942/304
    assert (row.libtype, row.kernel_name) == ("tiles", PICK)


def test_the_default_is_kept_where_the_donors_pick_loses(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.02})  # twice the default's delay; its neighbours 0.03
    report, out = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.donor == DEFAULT_KEPT and res.kept_default and res.winner.libtype == "torch"
    assert read_table_file(str(out)).rows[0].libtype == "torch"


def test_a_neighbour_that_beats_the_donors_pick_wins(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.005, "tl_bm128_s3": 0.0})
    report, _ = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.donor == NEIGHBOUR and res.winner.kernel_name == "tl_bm128_s3"


def test_several_donor_rows_of_one_key_are_all_timed(tiles, tmp_path, monkeypatch):
    """Rows of two GPU kinds for one key: both solutions (and their neighbours) are candidates."""
    delays(monkeypatch, **{"tl_bm128_s4": 0.0, "tl_bm32_s2": 0.0})
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY])
    donor = tmp_path / "donor.csv"
    second = "tl_bm128_s4"
    rows = [TunedRow("gfx942", 304, KEY, "tiles", stable_solidx(PICK), 0, 9.0, PICK),
            TunedRow("sm90-H100-80GB-HBM3", 132, KEY, "tiles", stable_solidx(second), 0, 7.0, second)]  # fmt: skip
    ConfigTable(rows=rows).write(str(donor))
    report = tune_file(shapes, str(tmp_path / "new.csv"), OPTS, CPU, progress=False, log=lambda m: None,
                       donor=str(donor))  # fmt: skip
    res = report.results[0]
    timed = {c.kernel_name for c in res.candidates if c.libtype == "tiles"}
    assert {PICK, second} <= timed
    assert "tl_bm32_s2" not in timed  # as fast, but no step from either pick
    assert res.donor == CARRIED and res.winner.kernel_name == second


def test_a_key_the_donor_lacks_gets_the_full_search(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0, "tl_bm32_s2": 0.0})
    report, out = run_from(tmp_path, [KEY, OTHER], {KEY: [(PICK, 9.0)]})
    res = by_key(report)
    assert res[KEY].donor == CARRIED
    full = res[OTHER]
    assert full.donor == FULL_SEARCH and "no donor row" in full.note
    assert {c.kernel_name for c in full.candidates if c.libtype == "tiles"} == set(GRID)
    lines = summary_lines(report, str(out))
    assert any(line.startswith("from ") and "carried over 1" in line and "full search 1" in line for line in lines)


def test_a_key_between_the_donors_ms_takes_the_rows_of_the_nearest_ms_of_its_shape(tiles, tmp_path, monkeypatch):
    """The donor tuned the shape at M 4 and 64, not 16: both rows' solutions are timed, the nearer first."""
    delays(monkeypatch, **{"tl_bm128_s4": 0.0})
    low, high = KEY._replace(M=4), KEY._replace(M=64)
    report, out = run_from(tmp_path, [KEY], {low: [(PICK, 5.0)], high: [("tl_bm128_s4", 9.0)]})
    res = report.results[0]
    timed = {c.kernel_name for c in res.candidates if c.libtype == "tiles"}
    assert {PICK, "tl_bm128_s4"} <= timed and len(timed) < len(GRID)
    assert res.donor == CARRIED and res.winner.kernel_name == "tl_bm128_s4"
    assert "donor rows of M=4,64" in res.note
    assert read_table_file(str(out)).rows[0].key == KEY


def test_donor_picks_of_other_ms_come_nearest_first_and_only_from_the_same_shape():
    fam = families.get("a16w16")
    pick = lambda name, m: donor_mod.DonorPick("tiles", name, stable_solidx(name), 0, 9.0, "gfx942", 304, m)  # noqa: E731
    picks = {KEY._replace(M=2): (pick("a", 2),), KEY._replace(M=64): (pick("b", 64), pick("a", 64)),
             KEY._replace(M=2048): (pick("c", 2048),), OTHER._replace(M=1): (pick("d", 1),)}  # fmt: skip
    keys = [KEY, KEY._replace(M=8), KEY._replace(M=4096), KEY._replace(M=2048), OTHER._replace(M=8),
            KEY._replace(N=8)]  # fmt: skip
    got = {k: [(p.kernel_name, p.m) for p in ps] for k, ps in donor_mod.picks_for(keys, picks, fam).items()}
    assert got[KEY] == [("b", 64), ("a", 64)]  # 64/16 = 4 is nearer than 16/2 = 8; "a" once
    assert got[KEY._replace(M=8)] == [("a", 2), ("b", 64)]  # 8/2 = 4 is nearer than 64/8 = 8
    assert got[KEY._replace(M=4096)] == [("c", 2048)]  # above the largest: the largest alone
    assert got[KEY._replace(M=2048)] == [("c", 2048)]  # its own row, no other M
    assert got[OTHER._replace(M=8)] == [("d", 1)]
    assert KEY._replace(N=8) not in got  # a shape the donor never tuned: the full search


def test_a_donor_solution_that_cannot_run_here_falls_back_to_the_full_search(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0})
    report, _ = run_from(tmp_path, [KEY], {KEY: [("tl_bm256_s9", 9.0)]})  # a kernel this backend lacks
    res = report.results[0]
    assert res.donor == FULL_SEARCH and "cannot run this key here" in res.note
    assert res.winner.kernel_name == PICK


def test_the_m_range_is_verified_as_the_full_tune_verifies_it(tiles, tmp_path, monkeypatch):
    """Two Ms of one shape: the upper row's range reaches down to one above the lower M, checked there."""
    delays(monkeypatch, **{PICK: 0.0})
    low = KEY._replace(M=4)
    report, out = run_from(tmp_path, [low, KEY], {low: [(PICK, 5.0)], KEY: [(PICK, 9.0)]})
    rows = {r.key.M: r for r in read_table_file(str(out)).rows}
    assert (rows[16].m_lo, rows[16].m_hi) == (5, 16) and (rows[4].m_lo, rows[4].m_hi) == (1, 4)
    (tmp_path / "off").mkdir()
    _, out2 = run_from(tmp_path / "off", [low, KEY], {low: [(PICK, 5.0)], KEY: [(PICK, 9.0)]},
                       opts=TuneOptions(reps=7, verify_range=False))  # fmt: skip
    assert {(r.key.M, r.m_lo) for r in read_table_file(str(out2)).rows} == {(4, 4), (16, 16)}


def test_the_written_table_loads_and_dispatches_the_carried_kernel(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0})
    _, out = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    gemmtune.set_config(str(out))
    res = gemmtune.resolve(KEY, CPU)
    assert res.row is not None and res.solution == Solution("tiles", PICK, stable_solidx(PICK))
    tiles.CALLS.clear()
    x, w = torch.randn(KEY.M, KEY.K), torch.randn(KEY.N, KEY.K)
    y = gemmtune.gemm(x, w)
    assert tiles.CALLS == [PICK] and torch.allclose(y, x @ w.T, atol=1e-5)


def test_the_donor_goes_to_worker_processes(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0})
    report, _ = run_from(tmp_path, [KEY, OTHER], {KEY: [(PICK, 9.0)]}, mp_workers=1, timeout=120)
    assert not report.failures
    res = by_key(report)
    assert res[KEY].donor == CARRIED and res[OTHER].donor == FULL_SEARCH


def test_the_cli_reports_each_keys_verdict_and_the_profile_file_says_it(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0})
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY, OTHER])
    donor = write_donor(tmp_path / "donor.csv", {KEY: [(PICK, 9.0)]})
    out, prof = tmp_path / "new.csv", tmp_path / "prof.csv"
    got = CliRunner().invoke(cli, ["tune", shapes, "--from", donor, "-o", str(out), "--reps", "7", "--no-progress",
                                   "--profile-file", str(prof)])  # fmt: skip
    assert got.exit_code == 0, got.output
    table = [line for line in got.output.splitlines() if "x " in line and ("16x32x32" in line or "16x48x32" in line)]
    assert any("16x32x32" in line and line.endswith(CARRIED) for line in table), got.output
    assert any("16x48x32" in line and line.endswith(FULL_SEARCH) for line in table), got.output
    assert f"from {donor}: carried over 1, neighbour won 0, default kept 0, full search 1" in got.output
    text = prof.read_text().splitlines()
    assert text[0] == ",".join(PROFILE_COLUMNS)
    assert {line.rsplit(",", 1)[1] for line in text[1:]} == {CARRIED, FULL_SEARCH}


# ---- bad input ------------------------------------------------------------------------------------
def _bad_donor_cases(tmp_path: Path, shapes: str, out: Path) -> dict[str, tuple[str, str]]:
    """name -> (the --from value, a piece of the one-line error)."""
    a8w8 = tmp_path / "a8w8_tuned.csv"
    shutil.copy(H100_A8W8, a8w8)
    good = write_donor(tmp_path / "good.csv", {KEY: [(PICK, 9.0)]})
    malformed = tmp_path / "malformed.csv"
    malformed.write_text(Path(good).read_text().replace("\ngfx942,304,16,", "\ngfx942,304,sixteen,"))
    unreadable = tmp_path / "latin1.csv"
    unreadable.write_bytes(Path(good).read_bytes().replace(b"gfx942", b"gfx\xe9942"))
    return {
        "another family": (str(a8w8), "expected a a16w16 table"),
        "missing": (str(tmp_path / "nope.csv"), "no such file"),
        "malformed": (str(malformed), "malformed.csv:2"),
        "unreadable": (str(unreadable), "cannot read"),
        "the output": (str(out), "is the output table"),
        "the shapes": (shapes, "is the shape list"),
    }


CASES = ["another family", "missing", "malformed", "unreadable", "the output", "the shapes"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_donor_is_a_usage_error_naming_the_file_and_writes_nothing(case, tiles, tmp_path):
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY])
    out = tmp_path / "new.csv"
    write_donor(out, {OTHER: [(PICK, 3.0)]}, gfx=HERE.gfx, cu_num=HERE.cu_num)  # the user's table, kept as is
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    donor, why = _bad_donor_cases(tmp_path, shapes, out)[case]
    before.update({p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name not in before})
    got = CliRunner().invoke(cli, ["tune", shapes, "--from", donor, "-o", str(out), "--no-progress"])
    assert got.exit_code == 2, got.output
    error = [line for line in got.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "'--from'" in error[0] and donor in error[0] and why in error[0], got.output
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_the_python_api_raises_the_donor_error(tiles, tmp_path):
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY])
    with pytest.raises(DonorError, match="nope.csv: no such file"):
        tune_file(shapes, str(tmp_path / "new.csv"), OPTS, CPU, progress=False, log=lambda m: None,
                  donor=str(tmp_path / "nope.csv"))  # fmt: skip
    assert not (tmp_path / "new.csv").exists()


# ---- neighbours -----------------------------------------------------------------------------------
def _sols(names):
    return [Solution("triton", n, stable_solidx(n)) for n in names]


def test_neighbours_are_one_step_along_one_axis_of_the_name_or_one_flag_toggled():
    base = "tg_bm128_bn128_bk64_g8_w8_s4_sk1"
    tma = "tg_bm128_bn128_bk64_g8_w8_s4_sk1_tma"
    offered = _sols([
        "tg_bm64_bn128_bk64_g8_w8_s4_sk1",  # bm down
        "tg_bm32_bn128_bk64_g8_w8_s4_sk1",  # bm two steps down: not the nearest
        "tg_bm256_bn128_bk64_g8_w8_s4_sk1",  # bm up
        "tg_bm128_bn128_bk64_g8_w8_s3_sk1",  # stages down
        "tg_bm128_bn128_bk64_g8_w8_s4_sk2f",  # split-K up
        "tg_bm128_bn128_bk64_g8_w8_s4_sk2r",  # the same split in the other mode: one is enough
        "tg_bm64_bn256_bk64_g8_w8_s4_sk1",  # two axes at once
        tma,  # a flag added: one step
        "tg_bm128_bn128_bk64_g8_w8_s3_sk1_tma",  # a flag added and a step: two
        "tg_bm128_bn128_bk64_g8_w8_s4_sk1_pf_tma",  # two flags added
        base,
    ])  # fmt: skip
    got = [s.kernel_name for s in neighbours(Solution("triton", base, 0), offered)]
    assert set(got) == {"tg_bm64_bn128_bk64_g8_w8_s4_sk1", "tg_bm256_bn128_bk64_g8_w8_s4_sk1",
                        "tg_bm128_bn128_bk64_g8_w8_s3_sk1", "tg_bm128_bn128_bk64_g8_w8_s4_sk2f", tma}  # fmt: skip
    # the toggles first, then one step of every axis before a second step of any, never more than asked
    assert got[:4] == [tma, "tg_bm64_bn128_bk64_g8_w8_s4_sk1", "tg_bm128_bn128_bk64_g8_w8_s3_sk1",
                       "tg_bm128_bn128_bk64_g8_w8_s4_sk2f"]  # fmt: skip
    assert len(neighbours(Solution("triton", base, 0), offered, most=2)) == 2
    assert neighbours(Solution("torch", "native", 0), _sols(["native"]) + [Solution("torch", "mm_out_dtype", 1)]) == []


def test_a_fast_accumulation_toggle_is_one_step_both_ways():
    """cuBLASLt's a8w8 names: `_fa` added to or dropped from the default's algorithm is a neighbour."""
    plain = "lt130100_a66_t20_s36_k1_r0_w0_c7_i0_cl2"
    names = [plain, plain + "_fa", "lt130100_a66_t20_s36_k1_r0_w0_c0_i0_cl3_fa",  # three steps: no
             "lt130100_a66_t20_s36_k1_r0_w0_c6_i0_cl2", "lt130100_a66_t20_s36_k1_r0_w0_c7_i0_cl3",
             "lt130100_a66_t20_s36_k1_r0_w0_c6_i0_cl2_fa"]  # fmt: skip
    offered = [Solution("blaslt", n, stable_solidx(n)) for n in names]
    got = [s.kernel_name for s in neighbours(offered[0], offered)]
    assert got[0] == plain + "_fa"
    assert set(got) == {plain + "_fa", names[3], names[4]}
    back = [s.kernel_name for s in neighbours(offered[1], offered)]
    assert back[0] == plain and names[5] in back and names[2] not in back


def test_neighbours_of_a_real_triton_config_come_from_its_candidate_list():
    from gemmtune.backends.lib.triton_tiles import Hardware, config_solution, config_space

    key = GemmKey(4096, 4096, 4096, False, torch.bfloat16, torch.bfloat16)
    offered = [config_solution(c) for c in config_space(key, Hardware(132, 227 * 1024, True))]
    pick = next(s for s in offered if s.kernel_name.startswith("tg_bm128_bn128_bk64_g8_w8_s4"))
    near = neighbours(pick, offered)
    assert near and len(near) <= donor_mod.MAX_NEIGHBOURS and pick not in near
    assert all(s in offered for s in near)


def test_a_donor_row_naming_the_default_times_only_the_defaults_neighbourhood(tiles, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.0})
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY])
    donor = tmp_path / "donor.csv"
    ConfigTable(rows=[TunedRow("gfx942", 304, KEY, "torch", 0, 0, 9.0, "native")]).write(str(donor))
    report = tune_file(shapes, str(tmp_path / "new.csv"), OPTS, CPU, progress=False, log=lambda m: None,
                       donor=str(donor))  # fmt: skip
    res = report.results[0]
    assert res.donor == DEFAULT_KEPT and {c.libtype for c in res.candidates} == {"torch"}


# ---- the default's neighbourhood -------------------------------------------------------------------
DEFAULT_ALGO = "al_a1_c3"  # the algos plugin's heuristic pick: the first of its list
DEFAULT_NEAR = {"al_a1_c3_fa", "al_a1_c2"}  # its flag toggled, one step down its c axis
LIBRARY_FIRST = {"al_a1_c2_fa"}  # the `_fa` mode's second pick (its first is the toggle above)


@pytest.fixture
def algos_default(tiles, monkeypatch):
    """The family's default is the algos library's heuristic pick (as the a8w8 default is cuBLASLt's)."""
    sol = Solution("algos", DEFAULT_ALGO, stable_solidx(DEFAULT_ALGO))
    monkeypatch.setitem(backends._policies, "a16w16", lambda key, device: ("algos", sol))
    return sol


def test_a_neighbour_of_the_default_is_timed_and_wins_where_the_donor_never_looked(algos_default, tmp_path,
                                                                                   monkeypatch):  # fmt: skip
    """The donor names a Triton-like tile; the library's fast-accumulation twin of its default wins here."""
    delays(monkeypatch, **{PICK: 0.02, DEFAULT_ALGO: 0.01, "al_a1_c3_fa": 0.0, "al_a1_c0": 0.0})
    report, out = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.default.kernel_name == DEFAULT_ALGO
    assert res.donor == NEIGHBOUR and res.winner.kernel_name == "al_a1_c3_fa" and not res.kept_default
    timed = {c.kernel_name for c in res.candidates if c.libtype == "algos"} - {DEFAULT_ALGO}
    assert timed == DEFAULT_NEAR | LIBRARY_FIRST  # not al_a1_c0: as fast, but off the short list
    assert {c.kernel_name for c in res.candidates if c.libtype == "tiles"} == {PICK} | PICK_NEIGHBOURS
    assert read_table_file(str(out)).rows[0].kernel_name == "al_a1_c3_fa"


def test_the_librarys_first_picks_are_timed_and_can_win(algos_default, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.02, DEFAULT_ALGO: 0.01, "al_a1_c2_fa": 0.0})
    report, _ = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.donor == NEIGHBOUR and res.winner.kernel_name == "al_a1_c2_fa"


def test_the_default_is_kept_where_its_neighbours_lose_too(algos_default, tmp_path, monkeypatch):
    delays(monkeypatch, **{PICK: 0.02, DEFAULT_ALGO: 0.01})  # every other algo 0.03
    report, _ = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    res = report.results[0]
    assert res.donor == DEFAULT_KEPT and res.winner.kernel_name == DEFAULT_ALGO


def test_a_compiling_backend_adds_no_first_picks_of_its_list(tiles, tmp_path, monkeypatch):
    """tiles compiles its kernels: its list's first entries are no cheaper than any other, so only the
    steps from the donor's pick are timed (GRID[0] is two steps from PICK)."""
    delays(monkeypatch, **{PICK: 0.0})
    report, _ = run_from(tmp_path, [KEY], {KEY: [(PICK, 9.0)]})
    assert GRID[0] not in {c.kernel_name for c in report.results[0].candidates}


class _Grid(TorchBackend):
    """A backend of a 4-axis grid (3^4 configs) with a mode flag, compiling nothing; `lib` names it."""

    name = "grid"
    NAMES = [f"gr_a{a}_b{b}_c{c}_d{d}{fa}" for fa in ("", "_fa") for a in (1, 2, 3) for b in (1, 2, 3)
             for c in (1, 2, 3) for d in (1, 2, 3)]  # fmt: skip

    def candidates(self, key, device):
        return [Solution("grid", n, stable_solidx(n)) for n in self.NAMES]

    def solution_from_row(self, solidx, kernel_name, splitk):
        return Solution("grid", kernel_name, stable_solidx(kernel_name))

    def supports(self, solution, key, device):
        return True


def test_the_short_list_is_bounded_and_deterministic():
    grid = _Grid()
    picks = tuple(donor_mod.DonorPick("grid", n, stable_solidx(n), 0, 9.0 + i, "gfx942", 304, 16)
                  for i, n in enumerate(["gr_a2_b2_c2_d2", "gr_a1_b3_c2_d1_fa", "gr_a3_b1_c1_d3"]))  # fmt: skip
    default = Solution("grid", "gr_a2_b2_c2_d1", 0)

    def plan():
        return donor_mod.plan_for(picks, KEY, CPU, {"grid": grid}, default)

    first = plan()
    entries = first.by_backend["grid"]
    donors = [s.kernel_name for role, s in entries if role == donor_mod.DONOR]
    near = [s.kernel_name for role, s in entries if role == donor_mod.NEAR]
    assert donors == [p.kernel_name for p in picks]
    # three origins' neighbours (each up to MAX_NEIGHBOURS) and the default's exceed the bound
    assert len(near) == donor_mod.MAX_NEAR and len(set(near)) == len(near)
    assert default.kernel_name not in near and not set(donors) & set(near)
    assert plan().by_backend == first.by_backend  # the same list every time
    one = donor_mod.neighbours(Solution("grid", "gr_a2_b2_c2_d2", 0), grid.candidates(KEY, CPU))
    assert len(one) == donor_mod.MAX_NEIGHBOURS
    firsts = donor_mod.library_first(grid.candidates(KEY, CPU))
    assert [s.kernel_name for s in firsts] == grid.NAMES[:2] + grid.NAMES[81:83]  # per mode


def test_the_precompile_builds_only_what_a_donor_tune_times(tiles):
    from gemmtune.tuner.search import ahead_items

    picks = {KEY: (donor_mod.DonorPick("tiles", PICK, stable_solidx(PICK), 0, 9.0, "gfx942", 304, 16),)}
    names = lambda opts: {it.name for _, it in ahead_items([KEY, OTHER], CPU, opts) if it.key == KEY}  # noqa: E731
    assert names(TuneOptions(libtypes=["tiles"], donor=picks)) == {PICK} | PICK_NEIGHBOURS
    assert names(TuneOptions(libtypes=["tiles"])) == set(GRID)
    other = {it.name for _, it in ahead_items([OTHER], CPU, TuneOptions(libtypes=["tiles"], donor=picks))}
    assert other == set(GRID)  # a key the donor lacks: the full search's kernels


def test_the_precompile_lists_no_candidates_of_a_backend_that_compiles_nothing(algos_default, monkeypatch):
    """A library's candidate list costs a heuristic query and a check per algorithm, and the precompile
    has nothing to build from it; the tune itself lists it (the default's neighbourhood)."""
    from gemmtune.tuner.search import ahead_items, donor_plan

    algos = backends.get("algos")
    listed = []

    def candidates(key, device):
        listed.append(key)
        return type(algos).candidates(algos, key, device)

    monkeypatch.setattr(algos, "candidates", candidates)
    pick = lambda lib, name: donor_mod.DonorPick(lib, name, stable_solidx(name), 0, 9.0, "gfx942", 304, 16)  # noqa: E731
    picks = {KEY: (pick("tiles", PICK), pick("algos", "al_a1_c2"))}
    opts = TuneOptions(libtypes=["tiles", "algos"], donor=picks)
    items = ahead_items([KEY], CPU, opts)
    assert {it.name for _, it in items} == {PICK} | PICK_NEIGHBOURS and listed == []
    plan, _ = donor_plan(families.get("a16w16"), KEY, CPU, opts, {n: backends.get(n) for n in opts.libtypes})
    assert listed and {s.kernel_name for _, s in plan.by_backend["algos"]} > {"al_a1_c2", "al_a1_c3_fa"}


@pytest.mark.slow
def test_a_fleet_reads_the_donor_on_rank_0_and_tunes_from_it(tiles, tmp_path, monkeypatch):
    from test_distributed import torchrun

    delays(monkeypatch, **{PICK: 0.0})
    shapes = write_shapes(tmp_path / "shapes.csv", [KEY, OTHER])
    donor = write_donor(tmp_path / "donor.csv", {KEY: [(PICK, 9.0)]})
    out = tmp_path / "new.csv"
    p = torchrun("tune", shapes, "--from", donor, "-o", str(out), "--reps", "7", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"from {donor}: carried over 1, neighbour won 0, default kept 0, full search 1" in p.stdout, p.stdout
    rows = {r.key: r for r in read_table_file(str(out)).rows}
    assert rows[KEY].kernel_name == PICK and rows[KEY].gfx == HERE.gfx
