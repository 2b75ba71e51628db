"""GEMM families: every aiter table loads into its family, byte-identical rewrites, per-family env vars,
dispatch and tuning of the batched family, family-safe tuning and capture."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune import families
from gemmtune.cli.main import cli
from gemmtune.configs import ConfigStore, ConfigTable, TunedRow, read_table_file
from gemmtune.configs.io import read_csv
from gemmtune.device import identity
from gemmtune.errors import ConfigError, ShapesFileError
from gemmtune.families.batched import BatchedKey
from gemmtune.tuner.runner import tune_file
from gemmtune.tuner.search import TuneOptions

EXPECTED = {
    "a4w4_blockscale_tuned_gemm.csv": "a4w4_blockscale",
    "a8w8_blockscale_bpreshuffle_tuned_gemm.csv": "a8w8_blockscale_bpreshuffle",
    "a8w8_blockscale_tuned_gemm.csv": "a8w8_blockscale",
    "a8w8_blockscale_untuned_gemm.csv": "a8w8_blockscale",
    "a8w8_bpreshuffle_tuned_gemm.csv": "a8w8_bpreshuffle",
    "a8w8_bpreshuffle_untuned_gemm.csv": "a8w8_bpreshuffle",
    "a8w8_tuned_batched_gemm.csv": "batched_a8w8",
    "a8w8_tuned_gemm.csv": "a8w8",
    "a8w8_untuned_gemm.csv": "a8w8",
    "bf16_tuned_batched_gemm.csv": "batched",
    "bf16_tuned_gemm.csv": "a16w16",
    "bf16_untuned_batched_gemm.csv": "batched",
    "dsv3_bf16_tuned_gemm.csv": "a16w16",
    "dsv3_bf16_untuned_gemm.csv": "a16w16",
    "llama70B_bf16_tuned_gemm.csv": "a16w16",
    "llama70B_untuned_gemm.csv": "a16w16",
    "tuned_fmoe.csv": "fmoe",
    "untuned_fmoe.csv": "fmoe",
}
CPU = torch.device("cpu")


@pytest.fixture
def aiter(aiter_configs):
    return aiter_configs


def test_every_aiter_table_loads_into_its_family(aiter):
    found = sorted(p.name for p in aiter.glob("*.csv"))
    assert found == sorted(EXPECTED), "a reference table without an expected family"
    for name, fam in EXPECTED.items():
        path = str(aiter / name)
        if "untuned" in name:
            got, keys = gemmtune.capture.read_shape_list(path)
            assert got.name == fam and keys, name
            continue
        tf = read_table_file(path)
        assert tf.family.name == fam, name
        n_records = len(read_csv(path).records)
        assert len(tf.rows) == n_records  # rows for other GPUs are kept too
        # Each row's key really is that family's key type.
        assert isinstance(tf.rows[0].key, families.get(fam).key_type)


def test_bf16_and_batched_tables_rewrite_byte_identically(aiter, tmp_path):
    rewritten = 0
    for name, fam in EXPECTED.items():
        if "untuned" in name or fam not in ("a16w16", "batched"):
            continue
        src = aiter / name
        out = tmp_path / name
        read_table_file(str(src)).write(str(out))
        assert out.read_bytes() == src.read_bytes(), name
        rewritten += 1
    assert rewritten == 4  # bf16_tuned_gemm, dsv3, llama70B and the batched table


def test_every_tuned_table_rewrites_byte_identically(aiter, tmp_path):
    for name in EXPECTED:
        if "untuned" not in name:
            out = tmp_path / name
            read_table_file(str(aiter / name)).write(str(out))
            assert out.read_bytes() == (aiter / name).read_bytes(), name


def test_store_routes_files_to_families_and_unrunnable_rows_fall_back(aiter, caplog):
    store = ConfigStore.load([str(aiter / n) for n in EXPECTED if "untuned" not in n])
    assert set(store.tables) == set(EXPECTED.values())
    assert len(store.table("batched")) == 26 and len(store.table("fmoe")) > 0
    # An aiter batched row on this machine's identity: its CK kernel cannot run here -> torch.bmm.
    row = store.table("batched").rows[0]
    here = identity(CPU)
    moved = TunedRow(here.gfx, here.cu_num, row.key, row.libtype, row.solidx, row.splitk, row.us, row.kernel_name,
                     family=families.get("batched"))  # fmt: skip
    table = ConfigTable([moved], family="batched")
    gemmtune.set_config(table)
    res = gemmtune.resolve(row.key, CPU, family="batched")
    assert res.row is moved and res.solution.libtype == "torch" and "ck" in res.note


def test_per_family_env_var_merges_files(tmp_path, monkeypatch):
    fam = families.get("batched")
    here = identity(CPU)
    key = BatchedKey(4, 16, 64, 32, torch.float32, torch.float32, False, False)

    def table(path, us, kernel):
        row = TunedRow(here.gfx, here.cu_num, key, "torch", 0, 0, us, kernel, family=fam)
        ConfigTable([row], family=fam).write(str(path))
        return str(path)

    a, b = table(tmp_path / "a.csv", 9.0, "native"), table(tmp_path / "b.csv", 5.0, "native")
    monkeypatch.setenv("GEMMTUNE_CONFIG_BATCHED", f"{a}:{b}")
    gemmtune.get_dispatcher().set_config(None)
    store = ConfigStore.from_env(os.environ)
    merged = store.table("batched")
    assert len(merged) == 1 and merged.rows[0].us == 5.0 and len(merged.conflicts) == 1
    assert merged.files == [a, b]
    # A file of another family in a family's variable is an error naming both.
    bf16 = tmp_path / "bf16.csv"
    ConfigTable([TunedRow(here.gfx, here.cu_num, gemmtune.GemmKey(1, 8, 8), "torch", 0, 0, 1.0, "native")]).write(
        str(bf16)
    )
    monkeypatch.setenv("GEMMTUNE_CONFIG_BATCHED", str(bf16))
    with pytest.raises(ConfigError, match="expected a batched table"):
        ConfigStore.from_env(os.environ)


def test_quantized_list_is_never_tuned_as_bf16(aiter, tmp_path):
    out = tmp_path / "t.csv"
    res = CliRunner().invoke(cli, ["tune", str(aiter / "a8w8_untuned_gemm.csv"), "-o", str(out), "--family",
                                   "a16w16", "--no-progress"])  # fmt: skip
    assert res.exit_code != 0 and "not a shape list of family a16w16" in res.output and "q_dtype_w" in res.output
    assert not out.exists()
    with pytest.raises(ShapesFileError, match="a16w16"):
        gemmtune.capture.read_shape_list(str(aiter / "a8w8_untuned_gemm.csv"), "a16w16")


def test_batched_list_tunes_into_a_batched_table(tmp_path):
    shapes = tmp_path / "b.csv"
    shapes.write_text("B,M,N,K,dtype,transA,transB\n3,5,16,24,torch.float32,False,True\n2,4,8,8,torch.float32,True,"
                      "False\n")  # fmt: skip
    out = tmp_path / "tuned.csv"
    rep = tune_file(str(shapes), str(out), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    assert rep.family == "batched" and len(rep.results) == 2 and not rep.failures
    tf = read_table_file(str(out))
    assert tf.family.name == "batched"
    with open(out, newline="") as fh:
        header = next(csv.reader(fh))
    assert header == list(families.get("batched").table_columns())  # aiter's 13, gemmtune's, M range
    assert [r.key for r in tf.rows] == [BatchedKey(3, 5, 16, 24, torch.float32, torch.float32, False, True),
                                        BatchedKey(2, 4, 8, 8, torch.float32, torch.float32, True, False)]  # fmt: skip
    gemmtune.set_config(str(out))
    a, b = torch.randn(3, 5, 24), torch.randn(3, 16, 24)
    y = gemmtune.batched_gemm(a, b, transpose_b=True)
    torch.testing.assert_close(y, a @ b.transpose(1, 2))
    assert gemmtune.resolve(tf.rows[0].key, CPU, family="batched").row is not None


def test_batched_capture_goes_beside_the_a16w16_file(tmp_path):
    cap = tmp_path / "shapes.csv"
    gemmtune.set_capture(str(cap))
    gemmtune.batched_gemm(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    gemmtune.gemm(torch.randn(3, 4), torch.randn(5, 4))
    gemmtune.get_dispatcher().capture().flush()
    fam, keys = gemmtune.capture.read_shape_list(str(tmp_path / "shapes.batched.csv"))
    assert fam.name == "batched" and [k.B for k, _ in keys] == [2]
    assert gemmtune.capture.read_shape_list(str(cap))[0].name == "a16w16"


def test_show_config_names_each_files_family(aiter):
    paths = [str(aiter / n) for n in ("bf16_tuned_gemm.csv", "bf16_tuned_batched_gemm.csv",
                                      "a4w4_blockscale_tuned_gemm.csv", "tuned_fmoe.csv")]  # fmt: skip
    res = CliRunner().invoke(cli, ["show-config", "--no-conflicts", *paths])
    assert res.exit_code == 0, res.output
    assert "bf16_tuned_gemm.csv: a16w16 table, 232 rows" in res.output
    assert "bf16_tuned_batched_gemm.csv: batched table, 26 rows" in res.output
    assert "a4w4_blockscale_tuned_gemm.csv: a4w4_blockscale table" in res.output
    assert "[a4w4_blockscale] cannot run here: MXFP4" in res.output
    assert "tuned_fmoe.csv: fmoe table" in res.output


def test_batched_op_validates_and_matches_bmm():
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 4)
    ref = torch.bmm(a, b)
    for ta in (False, True):
        for tb in (False, True):
            aa = a.transpose(1, 2).contiguous() if ta else a
            bb = b.transpose(1, 2).contiguous() if tb else b
            torch.testing.assert_close(gemmtune.batched_gemm(aa, bb, ta, tb), ref)
    y = gemmtune.batched_gemm(a.half(), b.half(), out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 4)
    bad = [((a[0], b), "3-D"), ((a, b[:2]), "batch sizes differ"), ((a, b[:, :6]), "inner dimensions"),
           ((a, b.double()), "dtype mismatch"), ((a.int(), b.int()), "unsupported dtype")]  # fmt: skip
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gemmtune.batched_gemm(*args)
    compiled = torch.compile(lambda a, b: gemmtune.batched_gemm(a, b) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, b), 2 * ref)


def test_one_runner_serves_every_m_of_a_row(monkeypatch):
    from gemmtune.backends.a16w16.pytorch import TorchBackend

    made = []
    real = TorchBackend.make_runner
    monkeypatch.setattr(TorchBackend, "make_runner", lambda self, s, k, d: made.append(k.M) or real(self, s, k, d))
    w = torch.randn(16, 8)
    for m in (1, 3, 7, 64):
        gemmtune.gemm(torch.randn(m, 8), w)
    assert made == [1]  # the default runner was made once, for the first M, and reused
    gemmtune.gemm(torch.randn(2, 8), torch.randn(12, 8))
    assert made == [1, 2]  # another N: another runner
