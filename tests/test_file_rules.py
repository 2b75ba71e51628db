"""The one file rule (configs/files.py): special files are refused by type before they are read; every
output is written through symlinks, keeps hard links, is never an input of its command nor a file of another
kind, and a read-only or missing folder is a one-line error before any work, naming the path(s); under
online tuning a serving call never raises for it. Every file a user owns is byte-identical after a refusal.

Unwritable folders are faked through files.writable, the one probe every check asks: these tests may run as
root, and root passes every permission check whatever the mode bits say (and chattr is not available).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
import torch
from click.testing import CliRunner

import gemmtune
from gemmtune import families, settings
from gemmtune.capture import ShapeCapture, read_shape_list
from gemmtune.cli.main import cli
from gemmtune.configs import TUNED_COLUMNS, ConfigStore, ConfigTable, read_table_file
from gemmtune.configs import files as file_rule
from gemmtune.configs.io import locked
from gemmtune.errors import ConfigError, EnvVarError, OutputFileError, ReadOnlyPathError, ShapesFileError
from gemmtune.keys import GemmKey
from gemmtune.tuner import online
from gemmtune.tuner.online_background import BackgroundTuner
from gemmtune.tuner.online_common import OnlineSettings
from gemmtune.tuner.output import write_row
from gemmtune.tuner.runner import tune_file
from gemmtune.tuner.search import TuneOptions

CPU = torch.device("cpu")
ROW_A = "gfx942,304,16,256,512,False,torch.bfloat16,torch.bfloat16,False,False,hipblaslt,7,0,3.5,algo7,0,1,1\n"
ROW_B = "gfx942,304,32,256,512,False,torch.bfloat16,torch.bfloat16,False,False,hipblaslt,8,0,4.5,algo8,0,1,1\n"
SHAPES = "M,N,K,bias,dtype,outdtype\n4,32,16,False,torch.float32,torch.float32\n"
CAPTURE = (
    "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,count\n4,32,16,False,torch.bfloat16,torch.bfloat16,False,False,3\n"
)
TUNE = ["--device", "cpu", "--mp", "0", "--no-precompile", "--reps", "5", "--no-progress"]


def table(path, *rows):
    path.write_text(",".join(TUNED_COLUMNS) + "\n" + "".join(rows or (ROW_A,)))
    return path


def shapes(path, text=SHAPES):
    path.write_text(text)
    return path


def fifo(tmp_path, name="pipe.csv"):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def bounded(fn, seconds=60.0):
    """fn()'s exception (None when it returned): it must end, never block on a FIFO."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a special file"
    return box.get("exc")


def invoke(args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def refused(res, *names):
    """A usage error (exit 2) in one line naming each of `names`."""
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    for n in names:
        assert str(n) in text, (n, res.output)
    return text


@pytest.fixture
def unwritable(monkeypatch):
    """Make files.writable answer False for the paths added to the returned set."""
    paths: set[str] = set()
    real = file_rule.writable
    monkeypatch.setattr(file_rule, "writable", lambda p: os.path.realpath(p) not in paths and real(p))
    return paths


# ---- special files are refused by type, before they are read ------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/null", "folder"])
def test_read_csv_refuses_special_files_by_type(tmp_path, kind):
    path = {"fifo": lambda: fifo(tmp_path), "folder": lambda: tmp_path}.get(kind, lambda: kind)()
    exc = bounded(lambda: read_table_file(str(path)))
    assert isinstance(exc, ConfigError) and str(path) in str(exc) and "not a regular file" in str(exc)


@pytest.mark.parametrize("var", ["GEMMTUNE_CONFIG", "GEMMTUNE_CONFIG_BATCHED"])
@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "folder holding a fifo"])
def test_gemmtune_config_naming_a_special_file_is_an_error_not_a_hang(tmp_path, special, var):
    """Refused in the user's first call: the one line names the variable, its value and the file."""
    value = {"fifo": lambda: str(fifo(tmp_path)), "folder holding a fifo": lambda: str(fifo(tmp_path).parent)}
    path = value.get(special, lambda: special)()
    exc = bounded(lambda: ConfigStore.from_env({var: path}))
    msg = str(exc)
    assert isinstance(exc, ConfigError) and msg.startswith(f"{var}={path}: ") and "not a regular file" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("api", ["set_config", "load_config"])
def test_set_config_and_load_config_refuse_a_fifo(tmp_path, api):
    path = str(fifo(tmp_path))
    exc = bounded(lambda: getattr(gemmtune, api)(path))
    assert isinstance(exc, ConfigError) and path in str(exc) and "FIFO" in str(exc)


def test_a_shape_list_that_is_a_fifo_is_refused(tmp_path):
    path = str(fifo(tmp_path))
    exc = bounded(lambda: read_shape_list(path))
    assert isinstance(exc, ShapesFileError) and path in str(exc)


def test_tune_and_bench_inputs_that_are_special_files_are_refused(tmp_path):
    pipe = fifo(tmp_path)
    for args in (["tune", pipe, "-o", tmp_path / "t.csv", *TUNE], ["bench", "/dev/zero", "--device", "cpu"]):
        box: dict = {}
        assert bounded(lambda a=args, b=box: b.setdefault("res", invoke(a))) is None
        res = box["res"]
        assert res.exit_code != 0 and str(args[1]) in res.output and "not a regular file" in res.output
    assert not (tmp_path / "t.csv").exists()


def test_a_model_config_that_is_a_fifo_is_refused(tmp_path):
    pipe = fifo(tmp_path, "config.json")
    box = {}
    assert bounded(lambda: box.setdefault("res", invoke(["shapes", "--model", pipe]))) is None
    assert box["res"].exit_code != 0 and str(pipe) in box["res"].output and "FIFO" in box["res"].output


@pytest.mark.parametrize("cmd", ["capture", "tune", "shapes"])
def test_an_output_that_is_a_fifo_or_device_is_refused(tmp_path, cmd):
    out = fifo(tmp_path)
    args = {"capture": ["capture", "-o", out, "--", "true"],
            "tune": ["tune", shapes(tmp_path / "s.csv"), "-o", out, *TUNE],
            "shapes": ["shapes", "--model", "llama-3-70b", "-o", out]}[cmd]  # fmt: skip
    box = {}
    assert bounded(lambda: box.setdefault("res", invoke(args))) is None
    refused(box["res"], out, "FIFO")
    assert os.path.exists(out) and not os.path.isfile(out)  # still the FIFO
    refused(invoke(["tune", tmp_path / "s.csv", "-o", "/dev/null", *TUNE]), "/dev/null", "character device")


@pytest.mark.parametrize("where", ["file", "in a folder", "index"])
def test_an_fp8_checkpoint_that_is_a_fifo_is_refused(tmp_path, where):
    if where == "file":
        checkpoint = path = fifo(tmp_path, "model.safetensors")
    else:
        checkpoint = tmp_path
        path = fifo(tmp_path, "model.safetensors" if where == "in a folder" else "model.safetensors.index.json")
    exc = bounded(lambda: gemmtune.load_fp8_checkpoint(torch.nn.Linear(2, 2), str(checkpoint)))
    msg = str(exc)
    assert isinstance(exc, ValueError) and msg.startswith(f"load_fp8_checkpoint: {path} is a FIFO"), msg
    assert "\n" not in msg


def test_capture_api_refuses_a_fifo(tmp_path):
    path = str(fifo(tmp_path))
    for make in (lambda: ShapeCapture(path), lambda: gemmtune.set_capture(path)):
        exc = bounded(make)
        assert isinstance(exc, ShapesFileError) and path in str(exc) and "FIFO" in str(exc)


# ---- symlinks: written through to the file they name ---------------------------------------------------
def test_tune_o_a_symlink_writes_the_shared_table_and_keeps_the_link(tmp_path):
    shared = table(tmp_path / "shared.csv", ROW_A)
    link = tmp_path / "mine.csv"
    link.symlink_to(shared)
    res = invoke(["tune", shapes(tmp_path / "s.csv"), "-o", link, *TUNE])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and os.readlink(link) == str(shared)
    rows = read_table_file(str(shared)).rows
    assert len(rows) == 2 and rows[0].text is not None  # the old row kept, the new one added
    assert not (tmp_path / "mine.csv.lock").exists()  # the lock is the shared table's


def test_write_row_through_a_symlink(tmp_path):
    target = table(tmp_path / "t.csv", ROW_B)
    link = tmp_path / "l.csv"
    link.symlink_to(target)
    write_row(str(link), read_table_file(str(table(tmp_path / "a.csv", ROW_A))).rows[0])
    assert link.is_symlink() and len(read_table_file(str(target)).rows) == 2


def test_capture_through_a_symlink(tmp_path):
    target = shapes(tmp_path / "cap.csv", CAPTURE)
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    ShapeCapture(str(link)).add_key(GemmKey(8, 32, 16))
    assert link.is_symlink() and len(read_shape_list(str(target))[1]) == 2


def test_shapes_o_a_symlink_rewrites_its_target(tmp_path):
    target = shapes(tmp_path / "old.csv")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    res = invoke(["shapes", "--model", "llama-3-70b", "--nsets", "1", "-o", link])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and len(read_shape_list(str(target))[1]) > 1


def test_a_dangling_symlink_output_creates_its_target(tmp_path):
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "new.csv")
    ConfigTable.load(str(table(tmp_path / "a.csv"))).write(str(link))
    assert link.is_symlink() and len(read_table_file(str(tmp_path / "new.csv")).rows) == 1


def test_two_links_to_one_table_take_one_lock(tmp_path):
    target = table(tmp_path / "t.csv")
    link = tmp_path / "l.csv"
    link.symlink_to(target)
    with locked(str(link)):
        assert (tmp_path / "t.csv.lock").exists() and not (tmp_path / "l.csv.lock").exists()


def test_a_symlink_into_a_missing_folder_is_refused(tmp_path):
    link = tmp_path / "l.csv"
    link.symlink_to(tmp_path / "gone" / "t.csv")
    res = refused(invoke(["tune", shapes(tmp_path / "s.csv"), "-o", link, *TUNE]), link, tmp_path / "gone")
    assert "does not exist" in res and not (tmp_path / "gone").exists()


# ---- hard links: every name keeps seeing one file ------------------------------------------------------
def test_write_row_keeps_the_hard_link(tmp_path):
    one = table(tmp_path / "one.csv", ROW_B)
    two = tmp_path / "two.csv"
    os.link(one, two)
    write_row(str(two), read_table_file(str(table(tmp_path / "a.csv", ROW_A))).rows[0])
    assert os.path.samefile(one, two) and one.read_bytes() == two.read_bytes()
    assert len(read_table_file(str(one)).rows) == 2


def test_table_write_and_capture_keep_hard_links(tmp_path):
    one = table(tmp_path / "one.csv")
    os.link(one, tmp_path / "two.csv")
    tab = ConfigTable.load(str(table(tmp_path / "b.csv", ROW_A, ROW_B)))
    tab.write(str(tmp_path / "two.csv"))
    assert len(read_table_file(str(one)).rows) == 2 and os.stat(one).st_nlink == 2
    cap = shapes(tmp_path / "cap.csv", CAPTURE)
    os.link(cap, tmp_path / "cap2.csv")
    ShapeCapture(str(tmp_path / "cap2.csv")).add_key(GemmKey(8, 32, 16))
    assert len(read_shape_list(str(cap))[1]) == 2 and os.path.samefile(cap, tmp_path / "cap2.csv")


def test_a_rewrite_keeps_the_file_mode(tmp_path):
    path = table(tmp_path / "t.csv")
    os.chmod(path, 0o640)
    ConfigTable.load(str(table(tmp_path / "b.csv", ROW_A, ROW_B))).write(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o640 and len(read_table_file(str(path)).rows) == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".gemmtune-")]  # no temp file left


# ---- never onto an input of the same command -----------------------------------------------------------
@pytest.mark.parametrize("name", ["same", "symlink", "hardlink"])
def test_tune_o_its_own_input_is_refused_naming_both(tmp_path, name):
    src = shapes(tmp_path / "s.csv")
    out = tmp_path / "o.csv"
    if name == "same":
        out = src
    elif name == "symlink":
        out.symlink_to(src)
    else:
        os.link(src, out)
    before = src.read_bytes()
    text = refused(invoke(["tune", src, "-o", out, *TUNE]), out, src)
    assert "is the input" in text and src.read_bytes() == before


def test_profile_file_onto_the_input_or_the_output_is_refused(tmp_path):
    src = shapes(tmp_path / "s.csv")
    out = table(tmp_path / "o.csv")
    before = src.read_bytes(), out.read_bytes()
    refused(invoke(["tune", src, "-o", tmp_path / "n.csv", "--profile-file", src, *TUNE]), src, "is the input")
    text = refused(invoke(["tune", src, "-o", out, "--profile-file", out, *TUNE]), "--profile-file", "-o", out)
    assert "one file cannot hold both" in text
    assert (src.read_bytes(), out.read_bytes()) == before and not (tmp_path / "n.csv").exists()


def test_tune_file_api_refuses_its_input_as_output(tmp_path):
    src = shapes(tmp_path / "s.csv")
    before = src.read_bytes()
    with pytest.raises(OutputFileError, match="is the input") as info:
        tune_file(str(src), str(src), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    assert str(info.value).count(str(src)) == 2 and src.read_bytes() == before


def test_bench_o_the_table_itself_is_refused(tmp_path):
    tab = table(tmp_path / "TABLE.csv")
    before = tab.read_bytes()
    refused(invoke(["bench", tab, "-o", tmp_path / "TABLE", "--device", "cpu"]), tab, "is the input")
    assert tab.read_bytes() == before


def test_bench_o_a_table_gemmtune_config_names_is_refused(tmp_path):
    tab, other = table(tmp_path / "a.csv"), table(tmp_path / "b.csv")
    before = other.read_bytes()
    res = invoke(["bench", tab, "-o", tmp_path / "b", "--device", "cpu"], env={"GEMMTUNE_CONFIG": str(other)})
    refused(res, other, "is the input")
    assert other.read_bytes() == before


def test_shapes_o_the_model_config_is_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    refused(invoke(["shapes", "--model", cfg, "-o", cfg]), cfg, "is the input")
    assert cfg.read_text() == "{}"


# ---- never onto a file of another kind -----------------------------------------------------------------
def test_bench_o_another_tuned_table_is_refused(tmp_path):
    prod = table(tmp_path / "prod.csv", ROW_B)
    before = prod.read_bytes()
    text = refused(invoke(["bench", table(tmp_path / "a.csv"), "-o", tmp_path / "prod", "--device", "cpu"]), prod)
    assert "is a tuned table" in text and "not a bench report" in text and prod.read_bytes() == before


@pytest.mark.parametrize("ext, content", [(".json", '{"mine": 1}'), (".png", "not a picture")])
def test_bench_o_a_prefix_whose_json_or_png_is_someone_elses_is_refused(tmp_path, ext, content):
    theirs = tmp_path / f"res{ext}"
    theirs.write_text(content)
    refused(invoke(["bench", table(tmp_path / "a.csv"), "-o", tmp_path / "res", "--device", "cpu"]), theirs)
    assert theirs.read_text() == content


@pytest.mark.parametrize("existing", ["tuned", "capture"])
def test_shapes_o_a_tuned_table_or_capture_file_is_refused(tmp_path, existing):
    out = table(tmp_path / "o.csv") if existing == "tuned" else shapes(tmp_path / "o.csv", CAPTURE)
    before = out.read_bytes()
    what = "a tuned table" if existing == "tuned" else "a capture file"
    text = refused(invoke(["shapes", "--model", "llama-3-70b", "-o", out]), out, what)
    assert "not a shape list" in text and out.read_bytes() == before


def test_shapes_o_an_existing_shape_list_regenerates_it(tmp_path):
    out = shapes(tmp_path / "o.csv")
    assert invoke(["shapes", "--model", "llama-3-70b", "--nsets", "1", "-o", out]).exit_code == 0
    assert len(read_shape_list(str(out))[1]) > 1


@pytest.mark.parametrize("existing", ["shapes", "capture", "other"])
def test_table_write_onto_another_kind_is_refused(tmp_path, existing):
    out = tmp_path / "o.csv"
    out.write_text({"shapes": SHAPES, "capture": CAPTURE, "other": "name,value\nx,1\n"}[existing])
    before = out.read_bytes()
    with pytest.raises(OutputFileError, match="not a tuned table") as info:
        ConfigTable.load(str(table(tmp_path / "a.csv"))).write(str(out))
    assert str(out) in str(info.value) and out.read_bytes() == before


def test_tune_o_a_capture_file_and_profile_file_onto_a_table_are_refused(tmp_path):
    src, cap, tab = shapes(tmp_path / "s.csv"), shapes(tmp_path / "c.csv", CAPTURE), table(tmp_path / "t.csv")
    before = cap.read_bytes(), tab.read_bytes()
    refused(invoke(["tune", src, "-o", cap, *TUNE]), cap, "a capture file", "not a tuned table")
    refused(invoke(["tune", src, "-o", tmp_path / "n.csv", "--profile-file", tab, *TUNE]), tab, "tuner profile")
    assert (cap.read_bytes(), tab.read_bytes()) == before


def test_profile_o_a_folder_with_someone_elses_profile_json_is_refused(tmp_path):
    (tmp_path / "prof").mkdir()
    theirs = tmp_path / "prof" / "profile.json"
    theirs.write_text(json.dumps({"notes": "mine"}))
    refused(invoke(["profile", "-o", tmp_path / "prof", "--", "python", "-c", "pass"]), theirs, "profile report")
    assert json.loads(theirs.read_text()) == {"notes": "mine"}


def test_a_bench_report_is_rewritten_by_the_next_bench(tmp_path):
    # The writers' own kinds are recognised: a second bench run replaces its own report.
    from gemmtune.tuner.bench import write_outputs

    pytest.importorskip("matplotlib")
    for _ in range(2):
        write_outputs([], {}, str(tmp_path / "r"), {"title": "t"})
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == []
    assert file_rule.is_png(str(tmp_path / "r.png"))


# ---- read-only / unwritable folders and files ----------------------------------------------------------
@pytest.mark.parametrize("cmd", ["tune", "capture", "shapes", "profile"])
def test_an_unwritable_folder_is_a_usage_error_naming_it(tmp_path, unwritable, cmd):
    ro = tmp_path / "ro"
    ro.mkdir()
    unwritable.add(str(ro))
    args = {"tune": ["tune", shapes(tmp_path / "s.csv"), "-o", ro / "t.csv", *TUNE],
            "capture": ["capture", "-o", ro / "t.csv", "--", "true"],
            "shapes": ["shapes", "--model", "llama-3-70b", "-o", ro / "t.csv"],
            "profile": ["profile", "-o", ro, "--", "python", "-c", "pass"]}[cmd]  # fmt: skip
    refused(invoke(args), ro, "not writable")
    assert os.listdir(ro) == []


def _mode_bits_apply() -> list[str] | None:
    """An argv prefix under which this process's mode bits bind (as root: setpriv dropping the two
    capabilities that override them), or None where that cannot be had."""
    if os.geteuid() != 0:
        return []
    prefix = [shutil.which("setpriv") or "setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        ok = False
    return prefix if ok else None


ONLINE_SCRIPT = "import torch, gemmtune; print(gemmtune.gemm(torch.ones(3, 16), torch.ones(8, 16)).sum().item())"


@pytest.mark.slow
def test_a_really_read_only_folder_is_one_line_for_every_writer_and_online_serving_goes_on(tmp_path):
    """The same folder made read-only by its mode bits, not faked: the probe the fakes stand in for agrees."""
    prefix = _mode_bits_apply()
    if prefix is None:
        pytest.skip("mode bits cannot be made to bind here (root without setpriv)")
    ro = tmp_path / "ro"
    ro.mkdir()
    table(ro / "t.csv")
    before = {p.name: p.read_bytes() for p in ro.iterdir()}
    s = shapes(tmp_path / "s.csv")
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        gt = [*prefix, sys.executable, "-m", "gemmtune.cli.main"]
        for args in (["tune", s, "-o", ro / "t.csv", *TUNE], ["tune", s, "-o", ro / "new.csv", *TUNE],
                     ["capture", "-o", ro / "c.csv", "--", "true"],
                     ["shapes", "--model", "tiny-llama", "-o", ro / "s.csv"]):  # fmt: skip
            p = subprocess.run([*gt, *map(str, args)], capture_output=True, text=True, timeout=300)
            errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
            assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
            assert str(ro) in errors[0] and "not writable" in errors[0], errors[0]
        env = {**os.environ, online.ENV: str(ro / "on.csv"), settings.TUNE_ONLINE_MODE.name: "blocking"}
        p = subprocess.run([*prefix, sys.executable, "-c", ONLINE_SCRIPT], capture_output=True, text=True, env=env,
                           timeout=300)  # fmt: skip
        assert p.returncode == 0 and p.stdout.split() == ["384.0"], p.stderr
        assert "Traceback" not in p.stderr and p.stderr.count("online tuning is off") == 1, p.stderr
    finally:
        ro.chmod(stat.S_IRWXU)
    assert {p.name: p.read_bytes() for p in ro.iterdir()} == before


def test_a_read_only_table_is_refused_before_tuning(tmp_path, unwritable):
    tab = table(tmp_path / "t.csv")
    unwritable.add(str(tab))
    before = tab.read_bytes()
    refused(invoke(["tune", shapes(tmp_path / "s.csv"), "-o", tab, *TUNE]), tab, "read-only")
    assert tab.read_bytes() == before


def test_capture_api_in_an_unwritable_folder(tmp_path, unwritable):
    unwritable.add(str(tmp_path))
    with pytest.raises(ShapesFileError, match="not writable") as info:
        ShapeCapture(str(tmp_path / "cap.csv"))
    assert str(tmp_path) in str(info.value)


def test_a_lock_file_that_cannot_be_made_is_one_error_naming_it(tmp_path):
    tab = table(tmp_path / "t.csv")
    (tmp_path / "t.csv.lock").mkdir()  # a lock path no lock can take, even as root
    with pytest.raises(ReadOnlyPathError, match="cannot create its lock file") as info:
        write_row(str(tab), read_table_file(str(tab)).rows[0])
    assert f"{tab}.lock" in str(info.value)


def test_set_online_tuning_refuses_an_unwritable_folder(tmp_path, unwritable):
    unwritable.add(str(tmp_path))
    with pytest.raises(ReadOnlyPathError, match="not writable") as info:
        gemmtune.set_online_tuning(str(tmp_path / "t.csv"), mode="blocking")
    assert str(tmp_path) in str(info.value)


def test_online_tuning_from_the_environment_in_a_read_only_folder_logs_and_serves(tmp_path, unwritable, caplog):
    unwritable.add(str(tmp_path))
    with caplog.at_level(logging.WARNING, "gemmtune"):
        assert online.from_env({online.ENV: str(tmp_path / "t.csv")}) is None
    assert "online tuning is off" in caplog.text and str(tmp_path) in caplog.text


def _fail_if_tuned(*args, **kwargs):
    raise AssertionError("a key was tuned for a table that cannot be written")


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_a_folder_that_turns_read_only_while_serving_logs_once_and_serves(tmp_path, unwritable, caplog, monkeypatch,
                                                                         mode):  # fmt: skip
    tuner = gemmtune.set_online_tuning(str(tmp_path / "t.csv"), mode=mode)
    if mode == "background":
        tuner = BackgroundTuner(str(tmp_path / "t.csv"), tune=_fail_if_tuned)
        gemmtune.dispatch.get_dispatcher().set_miss_hook(tuner)
    else:
        monkeypatch.setattr("gemmtune.tuner.search.tune_shape", _fail_if_tuned)
    unwritable.add(str(tmp_path))
    with caplog.at_level(logging.WARNING, "gemmtune"):
        for n in (3, 5):  # two new keys: two misses
            y = gemmtune.gemm(torch.ones(n, 16), torch.ones(8, 16))
            assert torch.equal(y, torch.full((n, 8), 16.0))
        if mode == "background":
            assert tuner.wait(60)
    assert caplog.text.count("online tuning cannot write its table") == 1
    assert not (tmp_path / "t.csv").exists()


def test_a_row_that_cannot_be_written_is_said_once_and_not_raised(tmp_path, unwritable, caplog):
    settings = OnlineSettings(str(tmp_path / "t.csv"))
    row = read_table_file(str(table(tmp_path / "a.csv"))).rows[0]
    unwritable.add(str(tmp_path))
    fam = families.get("a16w16")
    with caplog.at_level(logging.WARNING, "gemmtune"):
        assert settings.write(fam, row) is False and settings.write(fam, row) is False
    assert caplog.text.count("cannot write its table") == 1 and not (tmp_path / "t.csv").exists()


# ---- missing folders and wrong files for online tables -------------------------------------------------
def test_online_tuning_refuses_a_missing_folder(tmp_path):
    path = str(tmp_path / "no" / "such" / "t.csv")
    with pytest.raises(OutputFileError, match="does not exist") as info:
        gemmtune.set_online_tuning(path)
    assert str(tmp_path / "no" / "such") in str(info.value) and not (tmp_path / "no").exists()
    with pytest.raises(EnvVarError, match="GEMMTUNE_TUNE_ONLINE=.*does not exist"):
        online.from_env({online.ENV: path})


@pytest.mark.parametrize("existing", ["shapes", "fifo"])
def test_online_tuning_refuses_a_shape_list_or_a_fifo(tmp_path, existing):
    path = shapes(tmp_path / "t.csv") if existing == "shapes" else fifo(tmp_path, "t.csv")
    exc = bounded(lambda: gemmtune.set_online_tuning(str(path), mode="blocking"))
    assert isinstance(exc, OutputFileError) and str(path) in str(exc)
    if existing == "shapes":
        assert path.read_text() == SHAPES


def test_a_table_write_into_a_missing_folder_makes_no_folder(tmp_path):
    with pytest.raises(OutputFileError, match="does not exist"):
        ConfigTable.load(str(table(tmp_path / "a.csv"))).write(str(tmp_path / "new" / "t.csv"))
    assert not (tmp_path / "new").exists()
