"""Every aiter CSV format as aiter reads it: each file of tests/data/aiter-configs (and, with
GEMMTUNE_AITER_TREE=<aiter checkout>, every CSV under its aiter/configs/) loads into its family with
`gemmtune show-config` rc 0 and writes back byte-identically; aiter's non-GEMM CSVs are named in one
line by show-config (rc 0) and refused in one line where a table is expected. Also: the CSV reader's
record splitting, BOM / CRLF / quoting round trips, the rows aiter reads but no key can use, folders in
GEMMTUNE_CONFIG, a file named twice."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest
from click.testing import CliRunner

from gemmtune.cli.main import cli
from gemmtune.configs import ConfigStore, ConfigTable, table
from gemmtune.configs.shapes import ShapeListFile, read_any
from gemmtune.errors import ConfigError

DATA = pathlib.Path(__file__).parent / "data" / "aiter-configs"
HEAD = DATA / "head"
REFUSED = {
    "asm_a8w8_gemm.csv": "a8w8 assembly kernels",
    "chunk_gdn_h_opt_tuned.csv": "gated-delta-net",
    "chunk_gdn_h_opt_untuned.csv": "gated-delta-net",
    "qwen3_5_35b_chunk_gdn_h_opt_untuned.csv": "gated-delta-net",
}
FAMILY = {
    "a8w8_blockscale_bpreshuffle_untuned_gemm.csv": ("a8w8_blockscale_bpreshuffle", "shapes"),
    "dsv3_a4w4_blockscale_untuned_gemm.csv": ("a4w4_blockscale", "shapes"),
    "kimik3_a4w4_blockscale_tuned_gemm.csv": ("a4w4_blockscale", "table"),
    "dsv4_batched_gemm_a8w8_blockscale_mxscale_tuned.csv": ("batched_a8w8_mxscale", "table"),
    "dsv4_fp8fp4_tuned_fmoe.csv": ("fmoe", "table"),
    "glm47_fp8_tuned_fmoe.csv": ("fmoe", "table"),
    "gptoss_fp4_tuned_fmoe.csv": ("fmoe", "table"),
    "kimik2_i4_tuned_fmoe.csv": ("fmoe", "table"),
    "mimo_v2_5_pro_tuned_fmoe.csv": ("fmoe", "table"),
    "minimax_m3_mxfp8_tuned_fmoe.csv": ("fmoe", "table"),
    "qwen3_8_2400b_fp4_tuned_fmoe.csv": ("fmoe", "table"),
    "qwen32B_untuned_gemm_bf16.csv": ("a16w16", "shapes"),
    "tuned_fhmoe.csv": ("fhmoe", "table"),
    "untuned_fhmoe.csv": ("fhmoe", "shapes"),
    "tuned_grouped_fmoe.csv": ("grouped_fmoe", "table"),
    "untuned_grouped_fmoe.csv": ("grouped_fmoe", "shapes"),
}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    table._warned.clear()  # each test sees the warnings of the files it reads


def _check_file(path: pathlib.Path, tmp: pathlib.Path) -> str:
    """'refused' (aiter's non-GEMM CSV: show-config names it in one line, rc 0, and loading it as a table
    is a one-line error) or the family; asserts rc 0 and a byte-identical rewrite."""
    res = CliRunner().invoke(cli, ["show-config", "--no-conflicts", str(path)])
    assert res.exit_code == 0, res.output
    if "gemmtune has no use for it" in res.output:
        msg = res.output.strip()
        assert len(msg.splitlines()) == 1 and str(path) in msg, msg
        with pytest.raises(ConfigError, match="gemmtune has no use for it"):
            read_any(str(path))
        return "refused"
    got = read_any(str(path))
    out = tmp / path.name
    got.write(str(out))
    assert out.read_bytes() == path.read_bytes(), path
    return got.family.name


def test_head_subset_covers_every_listed_format():
    assert sorted(p.name for p in HEAD.glob("*.csv")) == sorted([*REFUSED, *FAMILY])


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_format_loads_into_its_family_and_writes_back_identically(name, tmp_path):
    fam, kind = FAMILY[name]
    assert _check_file(HEAD / name, tmp_path) == fam
    got = read_any(str(HEAD / name))
    assert isinstance(got, ShapeListFile) == (kind == "shapes")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_aiter_non_gemm_csvs_are_named_in_one_line(name, tmp_path):
    assert _check_file(HEAD / name, tmp_path) == "refused"
    with pytest.raises(ConfigError, match=REFUSED[name]):
        ConfigTable.load(str(HEAD / name))


def test_show_config_says_what_cannot_run_here_once():
    files = [str(HEAD / n) for n in ("kimik2_i4_tuned_fmoe.csv", "gptoss_fp4_tuned_fmoe.csv", "tuned_fhmoe.csv")]
    res = CliRunner().invoke(cli, ["show-config", "--no-conflicts", *files])
    assert res.exit_code == 0, res.output
    assert res.output.count("[fhmoe] cannot run here") == 1
    assert "rows cannot run here (torch.int4 MoE" in res.output
    assert "rows cannot run here (torch.float4_e2m1fn_x2 MoE" in res.output


def test_short_rows_warn_with_file_and_line_and_stay(tmp_path, caplog):
    path = HEAD / "dsv4_fp8fp4_tuned_fmoe.csv"
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        tf = read_any(str(path))
    assert f"{path}:9" in caplog.text and "shorter than the header" in caplog.text
    assert len(tf.rows) + len(tf.inert) == 17


def test_shape_list_where_a_table_is_expected_says_where_it_belongs():
    path = str(DATA / "a8w8_untuned_gemm.csv")
    with pytest.raises(ConfigError, match=r"a shape list of the a8w8 family .*`gemmtune tune") as exc:
        ConfigStore.from_env({"GEMMTUNE_CONFIG": path})
    assert "\n" not in str(exc.value)


# ---- the reader and writer ------------------------------------------------------------------------------
HEADER = "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio"
ROW = "sm90,132,{m},256,512,False,torch.bfloat16,torch.bfloat16,False,False,torch,0,0,{us},{name},0"


@pytest.mark.parametrize("nl", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("bom", ["", "\ufeff"])
def test_bom_line_ends_and_quoting_round_trip(tmp_path, nl, bom):
    rows = [ROW.format(m=16, us=1.0, name='"native"'), ROW.format(m=32, us=2.0, name='"a\u2028b\x0cc\u0085d"'),
            "", ROW.format(m=64, us=3.0, name='"x,""y""\nz"')]  # fmt: skip
    text = bom + nl.join([HEADER, *rows]) + nl
    p = tmp_path / "t.csv"
    p.write_bytes(text.encode())
    tf = read_any(str(p))
    assert [r.kernel_name for r in tf.rows] == ["native", "a\u2028b\x0cc\u0085d", 'x,"y"\nz']
    assert [r.line for r in tf.rows] == [2, 3, 5]
    out = tmp_path / "out.csv"
    tf.write(str(out))
    assert out.read_bytes() == p.read_bytes()


@pytest.mark.parametrize(
    "row, why",
    [
        (ROW.format(m=16, us="nan", name="native"), "column 'us' is missing or empty"),
        (ROW.format(m=16, us="", name="native"), "column 'us' is missing or empty"),
        (ROW.format(m=16, us="inf", name="native"), "not a finite time"),
        (ROW.format(m=2**70, us=1.0, name="native"), "beyond any GEMM"),
        (ROW.format(m="", us=1.0, name="native"), "column 'M' is missing or empty"),
        (ROW.format(m=16, us=1.0, name="native") + ",64,32", "M_lo=64 > M_hi=32"),
    ],
)  # fmt: skip
def test_rows_that_never_answer_are_kept_and_named(tmp_path, caplog, row, why):
    header = HEADER + (",M_lo,M_hi" if row.count(",") > HEADER.count(",") else "")
    good = ROW.format(m=8, us=1.0, name="native") + (",1,8" if "M_lo" in header else "")
    p = tmp_path / "t.csv"
    p.write_text(f"{header}\n{good}\n{row}\n")
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        table = ConfigTable.load(str(p))
    assert len(table) == 1 and f"{p}:3: " in caplog.text and why in caplog.text
    out = tmp_path / "out.csv"
    read_any(str(p)).write(str(out))
    assert out.read_bytes() == p.read_bytes()


def test_more_fields_than_the_header_is_refused_with_file_line_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(f"{HEADER}\n{ROW.format(m=8, us=1.0, name='native')},extra\n")
    with pytest.raises(ConfigError, match=r"t.csv:2:17: 17 fields, header has 16"):
        ConfigTable.load(str(p))


def test_a_file_named_twice_warns_once(tmp_path, caplog):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "\n" + "\n".join(ROW.format(m=m, us=1.0, name="native") for m in (8, 16, 32)) + "\n")
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        store = ConfigStore.from_env({"GEMMTUNE_CONFIG": f"{p}:{p}"})
    assert len(store.table("a16w16")) == 3 and not store.table("a16w16").conflicts
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1 and "named twice" in caplog.text


# ---- folders ------------------------------------------------------------------------------------------
def _rows(store: ConfigStore) -> dict:
    return {name: sorted((r.source, r.line) for r in t.rows) for name, t in store.tables.items()}


def test_a_folder_resolves_the_same_rows_as_listing_its_tables(tmp_path):
    folder_store = ConfigStore.from_env({"GEMMTUNE_CONFIG": str(HEAD)})
    tables = [str(HEAD / n) for n, (_, kind) in sorted(FAMILY.items()) if kind == "table"]
    listed = ConfigStore.from_env({"GEMMTUNE_CONFIG": ":".join(tables)})
    assert _rows(folder_store) == _rows(listed) and len(folder_store) > 0
    assert {"fmoe", "fhmoe", "grouped_fmoe", "a4w4_blockscale", "batched_a8w8_mxscale"} <= set(folder_store.tables)


def test_a_family_variable_takes_that_familys_tables_from_a_folder():
    store = ConfigStore.from_env({"GEMMTUNE_CONFIG_FMOE": str(HEAD)})
    assert set(store.tables) == {"fmoe"}
    n = sum(1 for n, (f, k) in FAMILY.items() if f == "fmoe" and k == "table")
    assert len({r.source for r in store.table("fmoe").rows}) == n


def test_a_folder_without_tables_is_an_error(tmp_path):
    (tmp_path / "shapes.csv").write_text("M,N,K\n1,2,3\n")
    with pytest.raises(ConfigError, match="folder has no tuned table"):
        ConfigStore.from_env({"GEMMTUNE_CONFIG": str(tmp_path)})


# ---- a full aiter checkout ------------------------------------------------------------------------------
_TREE = os.environ.get("GEMMTUNE_AITER_TREE", "")
_TREE_FILES = sorted(pathlib.Path(_TREE).glob("aiter/configs/**/*.csv")) if _TREE else []


@pytest.mark.skipif(not _TREE, reason="GEMMTUNE_AITER_TREE names no aiter checkout")
@pytest.mark.parametrize("path", _TREE_FILES, ids=lambda p: str(p.relative_to(_TREE)))
def test_every_csv_of_an_aiter_tree(path, tmp_path):
    got = _check_file(path, tmp_path)
    assert got != "refused" or any(k in path.name for k in ("asm_a8w8_gemm", "chunk_gdn")), path
