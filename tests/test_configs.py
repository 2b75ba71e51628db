"""Config store: aiter's reference tables load, round-trip and look up; merge and M rules; bad rows."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from gemmtune.configs import TUNED_COLUMNS, ConfigTable, read_table_file
from gemmtune.configs.table import load_paths_env
from gemmtune.device import DeviceIdentity
from gemmtune.errors import ConfigError
from gemmtune.keys import GemmKey

HEADER = ",".join(TUNED_COLUMNS)


def tuned_files(folder):
    """Every reference table with the 18-column bf16 schema (others, e.g. a8w8, have other columns)."""
    files = []
    for path in sorted(folder.glob("*.csv")):
        header = path.read_text().splitlines()[0].split(",")
        if "libtype" in header and "solidx" in header:
            files.append(path)
    assert files, "no tuned reference tables found"
    return files


def test_reference_tables_load_roundtrip_and_every_row_is_found(aiter_configs, tmp_path):
    for path in tuned_files(aiter_configs):
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        table = ConfigTable.load(str(path))
        rows = read_table_file(str(path)).rows
        assert len(table) == len(rows) > 0
        out = tmp_path / path.name
        table.write(str(out))
        assert out.read_bytes() == path.read_bytes(), f"{path.name} did not round-trip"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # loading never writes
        for row in rows:
            found = table.lookup(row.key, DeviceIdentity(row.gfx, row.cu_num))
            assert found is not None, f"{row.where} not found"
            assert found.where == row.where


def test_other_family_table_is_rejected_where_a16w16_is_required(aiter_configs):
    a8w8 = aiter_configs / "a8w8_tuned_gemm.csv"
    with pytest.raises(ConfigError, match=r"a8w8_tuned_gemm.csv:1: expected a a16w16 table, but its columns are"):
        ConfigTable.load(str(a8w8), family="a16w16")
    assert ConfigTable.load(str(a8w8)).family.name == "a8w8"  # unnamed: the header decides


def write(tmp_path, name, lines, header=HEADER):
    p = tmp_path / name
    p.write_text(header + "\n" + "\n".join(lines) + "\n")
    return p


def row(M, us, libtype="torch", gfx="sm90", cu=132, N=256, K=512, kernel="native", outdtype="torch.bfloat16"):
    return f"{gfx},{cu},{M},{N},{K},False,torch.bfloat16,{outdtype},False,False,{libtype},0,0,{us},{kernel},0.0,1.0,2.0"


H100 = DeviceIdentity("sm90", 132)


def key(M, N=256, K=512):
    return GemmKey(M, N, K, False, torch.bfloat16, torch.bfloat16)


def test_legacy_file_without_gfx_applies_to_any_arch_with_its_cu_num(tmp_path):
    legacy_header = ",".join(c for c in TUNED_COLUMNS if c != "gfx")
    line = row(16, 5.0).split(",", 1)[1]
    p = write(tmp_path, "legacy.csv", [line], header=legacy_header)
    table = ConfigTable.load(str(p))
    assert table.lookup(key(16), H100) is not None
    assert table.lookup(key(16), DeviceIdentity("gfx942", 132)) is not None
    assert table.lookup(key(16), DeviceIdentity("sm90", 114)) is None
    out = tmp_path / "out.csv"
    table.write(str(out))
    assert out.read_text() == p.read_text()


def test_err_ratio_alias_and_missing_optional_columns(tmp_path):
    p = tmp_path / "old.csv"
    p.write_text("cu_num,M,N,K,libtype,solidx,us,kernelName,errRatio\n132,8,64,64,torch,0,1.5,native,0.01\n")
    r = ConfigTable.load(str(p)).lookup(GemmKey(8, 64, 64), DeviceIdentity("sm90", 132))
    assert r is not None and r.err_ratio == 0.01 and r.key.dtype == torch.bfloat16


def test_merge_lowest_us_wins_and_conflict_reported_once(tmp_path, caplog):
    a = write(tmp_path, "a.csv", [row(16, 9.0, kernel="slow"), row(32, 4.0)])
    b = write(tmp_path, "b.csv", [row(16, 5.0, kernel="fast"), row(64, 3.0)])
    digests = {p: p.read_bytes() for p in (a, b)}
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        table = ConfigTable.load(f"{a}:{b}")
    assert len(table) == 3
    assert table.lookup(key(16), H100).kernel_name == "fast"
    assert len(table.conflicts) == 1
    assert sum("duplicate config key" in r.message for r in caplog.records) == 1
    assert all(p.read_bytes() == d for p, d in digests.items())  # never rewrites the user's files
    # Order of files does not change a timed winner.
    assert ConfigTable.load([str(b), str(a)]).lookup(key(16), H100).kernel_name == "fast"


def test_override_rows_beat_timed_rows(tmp_path):
    a = write(tmp_path, "a.csv", [row(16, 2.0, kernel="timed")])
    b = write(tmp_path, "b.csv", [row(16, 0, kernel="override")])
    c = write(tmp_path, "c.csv", [row(16, 0, kernel="second-override")])
    assert ConfigTable.load([str(a), str(b)]).lookup(key(16), H100).kernel_name == "override"
    assert ConfigTable.load([str(b), str(a)]).lookup(key(16), H100).kernel_name == "override"
    # Between two overrides the earlier file wins.
    assert ConfigTable.load([str(b), str(c)]).lookup(key(16), H100).kernel_name == "override"


def test_duplicate_inside_one_file_does_not_raise(tmp_path):
    p = write(tmp_path, "dup.csv", [row(16, 3.0, kernel="x"), row(16, 2.0, kernel="y")])
    table = ConfigTable.load(str(p))
    assert table.lookup(key(16), H100).kernel_name == "y" and len(table.conflicts) == 1


def test_other_gpu_rows_are_kept_but_not_used(tmp_path):
    p = write(tmp_path, "t.csv", [row(16, 3.0, gfx="gfx942", cu=304), row(16, 3.0)])
    table = ConfigTable.load(str(p))
    assert len(table) == 2 and len(table.rows_for(H100)) == 1
    assert table.lookup(key(16), DeviceIdentity("gfx950", 256)) is None


@pytest.mark.parametrize(
    "M, expect",
    [(1, 16), (15, 16), (16, 16), (17, None), (48, None), (49, 64), (64, 64), (65, None), (241, 256), (256, 256),
     (257, None), (9999, None)],
)  # fmt: skip
def test_unverified_rows_answer_only_the_ms_aiter_pads_to_them(tmp_path, M, expect):
    p = write(tmp_path, "t.csv", [row(16, 1.0), row(64, 1.0), row(256, 1.0), row(32, 1.0, N=128)])
    got = ConfigTable.load(str(p)).lookup(key(M), H100)
    assert (got.key.M if got else None) == expect


@pytest.mark.parametrize("M, expect", [(1, 16), (16, 16), (17, None), (20, 64), (64, 64), (65, 256), (256, 256),
                                       (257, None)])  # fmt: skip
def test_verified_ranges_answer_exactly_their_ms(tmp_path, M, expect):
    header = HEADER + ",M_lo,M_hi"
    lines = [row(16, 1.0) + ",1,16", row(64, 1.0) + ",20,64", row(256, 1.0) + ",65,256"]
    p = write(tmp_path, "t.csv", lines, header=header)
    got = ConfigTable.load(str(p)).lookup(key(M), H100)
    assert (got.key.M if got else None) == expect


def test_family_must_match_entirely(tmp_path):
    p = write(tmp_path, "t.csv", [row(16, 1.0)])
    table = ConfigTable.load(str(p))
    assert table.lookup(key(16, N=255), H100) is None
    assert table.lookup(GemmKey(16, 256, 512, True, torch.bfloat16, torch.bfloat16), H100) is None
    assert table.lookup(GemmKey(16, 256, 512, False, torch.bfloat16, torch.float32), H100) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (row(16, 1.0).replace(",16,", ",sixteen,", 1), r"t.csv:3: column 'M': bad value 'sixteen'"),
        (row(16, 1.0).replace(",16,", ",-4,", 1), r"t.csv:3: column 'M'.*positive"),
        (row(16, "fast"), r"t.csv:3: column 'us': bad value 'fast'"),
        (row(16, 1.0).replace("torch.bfloat16", "torch.bf99", 1), r"t.csv:3: column 'dtype'"),
        (row(16, 1.0).replace(",False,", ",maybe,", 1), r"t.csv:3: column 'bias'"),
        (row(16, 1.0) + ",extra", r"t.csv:3:19: 19 fields, header has 18"),
    ],
)
def test_bad_rows_name_file_line_and_column(tmp_path, bad, match):
    p = write(tmp_path, "t.csv", [row(8, 1.0), bad])
    with pytest.raises(ConfigError, match=match):
        ConfigTable.load(str(p))


def test_unreadable_tables_never_become_no_table(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty file"):
        ConfigTable.load(str(empty))
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ConfigError, match="missing column"):
        ConfigTable.load(str(wrong))
    with pytest.raises(ConfigError, match="no such file"):
        load_paths_env(f"{tmp_path / 'missing.csv'}")
    with pytest.raises(ConfigError, match="names no file"):
        load_paths_env(":")


def test_written_merged_table_reloads_identically(tmp_path):
    a = write(tmp_path, "a.csv", [row(16, 9.0), row(32, 4.0)])
    b = write(tmp_path, "b.csv", [row(16, 5.0), row(64, 3.0, gfx="gfx942", cu=304)])
    merged = ConfigTable.load([str(a), str(b)])
    out = tmp_path / "merged.csv"
    merged.write(str(out))
    again = ConfigTable.load(str(out))
    assert sorted(r.full_key for r in again.rows) == sorted(r.full_key for r in merged.rows)
    assert {r.full_key: r.us for r in again.rows} == {r.full_key: r.us for r in merged.rows}


def test_nvidia_rows_are_per_product_with_bare_arch_rows_as_fallback(tmp_path):
    h100, h200 = DeviceIdentity("sm90-H100-80GB-HBM3", 132), DeviceIdentity("sm90-H200", 132)
    p = write(
        tmp_path,
        "t.csv",
        [
            row(16, 1.0, gfx="sm90-H100-80GB-HBM3", kernel="h100"),
            row(16, 1.0, gfx="sm90", kernel="any-sm90"),
            row(64, 1.0, gfx="sm90-H200", kernel="h200"),
        ],  # fmt: skip
    )
    table = ConfigTable.load(str(p))
    assert table.lookup(key(16), h100).kernel_name == "h100"  # exact product beats the bare arch
    assert table.lookup(key(16), h200).kernel_name == "any-sm90"  # an H100 row never serves an H200
    assert table.lookup(key(8), h100).kernel_name == "h100"  # the M rule over the rows that apply
    assert table.lookup(key(64), h100) is None  # the H200's M=64 row is not for this GPU
    assert len(table.rows_for(h100)) == 2 and len(table.rows_for(h200)) == 2
