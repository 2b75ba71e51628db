"""The CLI: --help everywhere, doctor, show-config, missing extras named; dir(gemmtune)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner

from gemmtune.cli.main import cli
from gemmtune.errors import missing_extra


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


# ---- optional dependencies and what --help and dir() show -----------------------------------------
def _usage_error(res) -> str:
    """The command stopped with a usage error (exit 2), one Error: line and no traceback; returns that line."""
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    return errors[0]


def test_bench_model_without_transformers_names_the_models_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails as if not installed
    out = tmp_path / "bm"
    res = CliRunner().invoke(cli, ["bench-model", "--device", "cpu", "--model", "tiny-llama", "-o", str(out)])
    line = _usage_error(res)
    assert "bench-model needs transformers" in line and "pip install 'gemmtune[models]'" in line, line
    assert not out.exists()


def test_profile_of_a_script_missing_transformers_names_the_models_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    script = tmp_path / "uses_hf.py"
    script.write_text("from transformers import AutoConfig\n")
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", "--device", "cpu", "-o", str(out), "--", "python", str(script)])
    line = _usage_error(res)
    assert "needs transformers" in line and "pip install 'gemmtune[models]'" in line, line
    assert not out.exists()


def test_profile_of_a_script_missing_another_module_keeps_its_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import no_such_module_of_any_extra\n")
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", "--device", "cpu", "-o", str(out), "--", "python", str(script)])
    assert res.exit_code == 1 and "gemmtune[" not in res.output, res.output
    assert "no_such_module_of_any_extra" in res.output  # its traceback, not an extra to install
    # it failed before any op: no profile (it would chart only the host time of the failed import)
    assert "before running any op: no profile written" in res.output and not (out / "profile.json").exists()


@pytest.mark.parametrize(
    "module, extra", [("transformers", "models"), ("transformers.models.llama", "models"), ("nvmath", "blaslt")]
)
def test_missing_extra_maps_a_package_to_its_extra(module, extra):
    err = missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module), "x")
    assert err is not None and f"pip install 'gemmtune[{extra}]'" in str(err), err
    assert missing_extra(ModuleNotFoundError("No module named 'numpyx'", name="numpyx"), "x") is None
    assert missing_extra(ImportError("cannot import name 'X'", name=module), "x") is None  # installed, but broken


def test_help_texts_match_the_packaging():
    bench = CliRunner().invoke(cli, ["bench", "--help"]).output
    assert "PNG" in bench and "gemmtune[plot]" not in bench  # matplotlib is a core dependency
    assert "--test-break" in CliRunner().invoke(cli, ["bench-model", "--help"]).output


def test_dir_lists_every_public_name():
    import gemmtune

    missing = [name for name in gemmtune.__all__ if name not in dir(gemmtune)]
    assert missing == [], missing
    assert {"optimize", "restore", "profile", "load_fp8_checkpoint"} <= set(dir(gemmtune))
