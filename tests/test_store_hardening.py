"""Files are never destroyed and bad tables are clear errors: capture vs tuned tables, the tuner's full
schema in legacy files, byte-order marks, header-only tables, an empty GEMMTUNE_CONFIG, the tuner's ETA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune import families
from gemmtune.capture import ShapeCapture
from gemmtune.cli.main import cli
from gemmtune.configs import TUNED_COLUMNS, ConfigStore, ConfigTable, read_table_file
from gemmtune.device import identity
from gemmtune.errors import ConfigError, ShapesFileError
from gemmtune.keys import GemmKey
from gemmtune.tuner.runner import _Progress, estimated_cost, tune_file
from gemmtune.tuner.search import TuneOptions

CPU = torch.device("cpu")
TUNED_ROW = "gfx942,304,16,256,512,False,torch.bfloat16,torch.bfloat16,False,False,hipblaslt,7,0,3.5,algo7,0,1,1\n"


def tuned_table(path):
    path.write_text(",".join(TUNED_COLUMNS) + "\n" + TUNED_ROW)
    return path


def test_capture_never_rewrites_a_tuned_table(tmp_path):
    table = tuned_table(tmp_path / "tuned.csv")
    before = table.read_bytes()
    res = CliRunner().invoke(cli, ["capture", "-o", str(table), "--", sys.executable, "-c", "pass"])
    assert res.exit_code != 0 and "is a tuned table" in res.output and "tuned.csv" in res.output
    with pytest.raises(ShapesFileError, match="is a tuned table"):
        ShapeCapture(str(table))
    with pytest.raises(ShapesFileError, match="is a tuned table"):
        gemmtune.set_capture(str(table))
    assert table.read_bytes() == before
    # Through the environment variable too: the first GEMM raises, the table is untouched.
    code = "import torch, gemmtune; gemmtune.gemm(torch.randn(2, 4), torch.randn(3, 4))"
    proc = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "GEMMTUNE_CAPTURE":
                          str(table)}, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "is a tuned table" in proc.stderr
    assert table.read_bytes() == before


def test_tuner_writes_the_full_schema_into_a_legacy_file(tmp_path):
    legacy = tmp_path / "legacy.csv"  # aiter's old bf16 columns: no gfx, bias, dtype, outdtype ...
    legacy.write_text("cu_num,M,N,K,libtype,solidx,splitK,us,kernelName\n304,16,256,512,hipblaslt,7,0,3.5,algo7\n")
    shapes = tmp_path / "s.csv"
    shapes.write_text("M,N,K,bias,dtype,outdtype\n4,32,16,True,torch.float16,torch.float32\n")
    rep = tune_file(str(shapes), str(legacy), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    assert len(rep.results) == 1
    tf = read_table_file(str(legacy))
    assert tf.columns == [*TUNED_COLUMNS, "M_lo", "M_hi"]
    old, new = tf.rows
    here = identity(CPU)
    assert new.key == GemmKey(4, 32, 16, True, torch.float16, torch.float32) and new.gfx == here.gfx
    assert old.gfx == "" and old.key == GemmKey(16, 256, 512) and old.kernel_name == "algo7"  # meaning kept
    # Resume: a rerun finds the row for this GPU and tunes nothing again, no duplicate.
    rep2 = tune_file(str(shapes), str(legacy), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    assert rep2.skipped == 1 and not rep2.results and len(read_table_file(str(legacy)).rows) == 2


def test_byte_order_mark_does_not_hide_columns(tmp_path):
    bom = "\ufeff"
    table = tmp_path / "bom.csv"
    table.write_text(bom + ",".join(TUNED_COLUMNS) + "\n" + TUNED_ROW, encoding="utf-8")
    row = ConfigTable.load(str(table)).rows[0]
    assert row.gfx == "gfx942"  # the gfx column was found: the row is for another GPU, not "any arch"
    assert ConfigTable.load(str(table)).rows_for(identity(CPU)) == []
    shapes = tmp_path / "shapes.csv"
    shapes.write_text(bom + "M,N,K\n4,8,16\n", encoding="utf-8")
    assert gemmtune.capture.read_shapes(str(shapes))[0][0] == GemmKey(4, 8, 16)


def test_header_only_table_is_an_error(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(TUNED_COLUMNS) + "\n")
    with pytest.raises(ConfigError, match="has a header but no rows"):
        ConfigTable.load(str(empty))
    res = CliRunner().invoke(cli, ["show-config", str(empty)])
    assert res.exit_code != 0 and "has a header but no rows" in res.output
    # As the tuner's output (resume) it is simply a table with nothing tuned yet.
    shapes = tmp_path / "s.csv"
    shapes.write_text("M,N,K\n2,8,8\n")
    tune_file(str(shapes), str(empty), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    assert len(read_table_file(str(empty)).rows) == 1


def test_empty_config_variable_means_no_table_everywhere(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_CONFIG", "")
    d = gemmtune.get_dispatcher()
    d._store, d._store_from_env = None, True
    d.clear_cache()
    y = gemmtune.gemm(torch.randn(2, 4), torch.randn(3, 4))  # the first GEMM works
    assert y.shape == (2, 3) and len(d.store()) == 0
    res = CliRunner().invoke(cli, ["show-config"])
    assert res.exit_code == 0 and "No table in effect" in res.output
    assert len(ConfigStore.from_env({"GEMMTUNE_CONFIG": " : "})) == 0


def test_eta_weighs_keys_by_cost(monkeypatch):
    monkeypatch.setattr("gemmtune.tuner.runner.stderr_is_tty", lambda: True)  # the bar, as on a terminal
    fam = families.get("a16w16")
    small, big = GemmKey(1, 4096, 4096), GemmKey(4096, 28672, 4096)
    assert estimated_cost(fam, big) > 5 * estimated_cost(fam, small)
    bar = _Progress(fam, [small, big], enabled=True, log=lambda m: None)
    assert bar.bar.total == pytest.approx(estimated_cost(fam, small) + estimated_cost(fam, big))
    from gemmtune.tuner.workers import ShapeFailure

    bar.done(ShapeFailure(small, "x"))
    assert bar.bar.n == pytest.approx(estimated_cost(fam, small))
    bar.close()
