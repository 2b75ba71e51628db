"""The CLI: --help everywhere, doctor, show-config."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gemmtune.cli.main import cli


def all_commands():
    return sorted(cli.commands)


def test_every_command_has_help():
    runner = CliRunner()
    res = runner.invoke(cli, ["--help"])
    assert res.exit_code == 0 and "capture" in res.output and "doctor" in res.output
    for name in all_commands():
        res = runner.invoke(cli, [name, "--help"])
        assert res.exit_code == 0, (name, res.output)
        assert "Usage" in res.output


def test_doctor_reports_device_and_backends():
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    for field in ("torch", "triton", "gfx", "cu_num", "device", "backends"):
        assert field in report
    assert report["backends"]["torch"] == "available"
    if not torch.cuda.is_available():
        assert report["programmatic dependent launch"].startswith("off (")


def test_show_config_counts_rows_and_conflicts(tmp_path):
    from gemmtune.configs import TUNED_COLUMNS

    p = tmp_path / "t.csv"
    line = "gfx942,304,16,256,512,False,torch.bfloat16,torch.bfloat16,False,False,torch,0,0,{us},native,0,1,1"
    p.write_text(",".join(TUNED_COLUMNS) + "\n" + line.format(us=3) + "\n" + line.format(us=2) + "\n")
    res = CliRunner().invoke(cli, ["show-config", str(p)])
    assert res.exit_code == 0, res.output
    assert "rows: 1 after merge" in res.output
    assert "gfx=gfx942 cu_num=304: 1 rows" in res.output
    assert "conflicts (duplicate keys): 1" in res.output


@pytest.mark.parametrize("content", ["", "M,N\n1,2\n"])
def test_show_config_reports_bad_tables(tmp_path, content):
    p = tmp_path / "bad.csv"
    p.write_text(content)
    res = CliRunner().invoke(cli, ["show-config", str(p)])
    assert res.exit_code != 0 and "bad.csv" in res.output
