"""Clear errors instead of tracebacks, packaging and docs that match the code, a self-contained checkout."""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gemmtune.cli.main import cli
from gemmtune.device import identity, parse_device
from gemmtune.errors import DeviceError
from gemmtune.models.linear import linear_skip_reason
from gemmtune.models.version import MAX_EXCLUSIVE, MIN_VERSION

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _missing_gpu() -> str:
    """A GPU this machine does not have: any on a CPU-only build, one past the last otherwise."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _one_line_error(res) -> str:
    """The CLI failed through click (exit code, message), not a traceback; returns its Error: line."""
    assert res.exit_code not in (0, None) and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    return errors[0]


# ---- tracebacks -> messages ---------------------------------------------------------------------
def test_cli_device_cuda_on_cpu_build_is_one_line_error(tmp_path):
    # `--device cuda` on a CPU build used to end in torch's AssertionError traceback.
    dev = _missing_gpu()
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n1,64,64\n")
    table = tmp_path / "tuned.csv"
    res = CliRunner().invoke(cli, ["tune", str(shapes), "-o", str(table), "--device", dev, "--no-progress"])
    line = _one_line_error(res)
    assert f"device {dev!r}" in line and ("no CUDA/ROCm support" in line or "GPU" in line), line
    assert not table.exists()
    res = CliRunner().invoke(cli, ["bench", str(shapes), "--device", dev])
    line = _one_line_error(res)
    assert "--device" in line and f"device {dev!r}" in line, line


def test_cli_unknown_device_is_one_line_error(tmp_path):
    table = tmp_path / "tuned.csv"
    table.write_text("M,N,K\n1,64,64\n")
    for bad, match in (("foo", "unknown device 'foo' (expected cpu, cuda or cuda:N)"), ("meta", "cpu or cuda")):
        assert match in _one_line_error(CliRunner().invoke(cli, ["bench", str(table), "--device", bad]))


def test_device_errors_name_the_device():
    with pytest.raises(DeviceError, match=re.escape(f"device {_missing_gpu()!r}")):
        identity(_missing_gpu())
    with pytest.raises(DeviceError, match="unknown device 'cuda:x'"):
        parse_device("cuda:x")
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None).type in ("cpu", "cuda")


def test_cli_bench_unknown_plugin_is_one_line_error(tmp_path):
    table = tmp_path / "tuned.csv"
    table.write_text("M,N,K\n1,64,64\n")
    res = CliRunner().invoke(cli, ["bench", str(table), "--plugin", "no_such_gemmtune_plugin"])
    assert "cannot import plugin module: No module named 'no_such_gemmtune_plugin'" in _one_line_error(res)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_optimize_leaves_linears_of_dtypes_gemm_rejects_alone(dtype):
    why = linear_skip_reason(nn.Linear(8, 4).to(dtype))
    assert why == f"weight dtype {dtype} is not one gemmtune.gemm takes (float16, bfloat16, float32)"
    assert linear_skip_reason(nn.Linear(8, 4).to(torch.bfloat16)) is None


# ---- packaging and docs -------------------------------------------------------------------------
def _pyproject_list(name: str) -> list[str]:
    """The strings of a `name = [...]` list in pyproject.toml (no tomllib on Python 3.10)."""
    m = re.search(rf"^{name} = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert m, name
    return re.findall(r'"([^"]+)"', m.group(1))


def test_extras_require_transformers_517():
    # The extras allowed transformers 4.48 while optimize() refuses anything below 5.17.
    lo, hi = MIN_VERSION, MAX_EXCLUSIVE
    for extra in ("models", "test"):
        reqs = [r for r in _pyproject_list(extra) if r.startswith("transformers")]
        assert reqs == [f"transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"], (extra, reqs)


def test_numpy_is_a_dependency():
    # torch's CPU wheel does not pull numpy in, and torch then warns "Failed to initialize NumPy".
    assert any(re.match(r"numpy\b", r) for r in _pyproject_list("dependencies"))


def _quickstart() -> list[str]:
    """The command lines of README's quick start (its bash block, comments left out)."""
    section = README.read_text().split("## Quick start", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_names_cpu_wheel_index():
    # A plain `pip install torch==2.13.0` brings the CUDA build and ~17 nvidia packages to a CPU machine.
    cmds = _quickstart()
    assert all(c.startswith(f"pip install torch==2.13.0 {CPU_INDEX} && pip install -e ") for c in cmds), cmds
    text = README.read_text()
    assert "On a GPU machine" in text and "`pip install torch==2.13.0` (PyPI's Linux wheel is the CUDA build)" in text


def test_readme_quickstart_is_two_commands_and_ci_runs_the_test_one():
    main, tests = _quickstart()
    assert all(f"gemmtune {c} " in main for c in ("shapes", "tune", "bench")), main
    # everything but torch pinned: a commit's CI result does not change with what the registry serves
    assert tests.endswith('pip install -e ".[test]" -c constraints.txt && python -m pytest -q'), tests
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line and line[0] != "#"]
    assert all("==" in line for line in pins) and any(line.startswith("transformers==") for line in pins), pins
    ci = CI.read_text().splitlines()
    assert tests in ci, "CI must run the README's test command verbatim"
    # CI's pip has a local CPU torch but no download.pytorch.org: torch comes first, plainly installed;
    # lint runs before the tests.
    torch_line = ci.index("pip install -q torch==2.13.0")
    lint = next(i for i, line in enumerate(ci) if "ruff check ." in line and "ruff format --check ." in line)
    assert torch_line < lint < ci.index(tests)
    # the README's command is the fast tier (pyproject's addopts deselect slow): CI runs the slow one after it
    assert ci.index("python -m pytest -q -m slow") > ci.index(tests)


# ---- a self-contained checkout ------------------------------------------------------------------


def test_no_test_needs_shared_folder(aiter_configs, model_configs):
    # Reference data, the measurement method and model configs used to live in a shared folder beside
    # the checkout; 19 tests skipped without it.
    assert (aiter_configs / "LICENSE-aiter").is_file() and len(list(aiter_configs.glob("*.csv"))) == 18
    assert (model_configs / "tiny-llama.json").is_file() and (model_configs / "llama-3-8b.json").is_file()
    assert (REPO / "docs" / "benchmarking.md").read_text().startswith("# How gemmtune measures speed")
    assert "[docs/benchmarking.md](docs/benchmarking.md)" in README.read_text()
    # [D]: a plain grep for the variable's name does not find this line.
    outside = re.compile(r"\.\./shared|GEMMTUNE_SHARED_[D]IR|shared/BENCHMARKING")
    files = [README, *REPO.glob("docs/*.md"), *REPO.glob("benchmarks/**/*.md"), *REPO.glob("benchmarks/*.py"),
             *REPO.glob("src/**/*.py"), *REPO.glob("tests/*.py")]  # fmt: skip
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in files
        if p != pathlib.Path(__file__).resolve()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if outside.search(line)
    ]
    assert hits == []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_quickstart_outputs_are_gitignored(tmp_path, monkeypatch):
    # The quick start's first command, run in a checkout, left shapes.csv, tuned.csv, its lock and the
    # bench outputs untracked in the repository root.
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", ".gitignore"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "ignore"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    main = _quickstart()[0]
    steps = [shlex.split(s)[1:] for s in main.split(" && ") if s.startswith("gemmtune ")]
    assert [s[0] for s in steps] == ["shapes", "tune", "bench"]
    extra = {"shapes": ["--nsets", "1,2"], "tune": ["--no-progress"], "bench": ["--no-progress"]}  # faster, same files
    for args in steps:
        res = CliRunner().invoke(cli, args + extra[args[0]])
        assert res.exit_code == 0, (args, res.output)
    written = sorted(p.name for p in tmp_path.iterdir() if p.name not in (".git", ".gitignore"))
    assert {"shapes.csv", "tuned.csv", "tuned.bench.csv", "tuned.bench.json"} <= set(written), written
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert status == "", status
