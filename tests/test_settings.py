"""gemmtune/settings.py declares every GEMMTUNE_* variable: the source names no other, reads none around it,
docs/settings.md's table is generated from it, a bad value is one EnvVarError, and doctor reports each."""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest
from click.testing import CliRunner

import gemmtune
from gemmtune import families, settings
from gemmtune.cli.main import cli
from gemmtune.errors import EnvVarError

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "gemmtune"
DOCS = REPO / "docs" / "settings.md"
NAME = re.compile(r"\bGEMMTUNE_[A-Z0-9_]*")
TABLE = re.compile(r"<!-- settings table start -->\n(.*?)<!-- settings table end -->", re.S)
# A value each parser refuses (text and path parsers take any value).
BAD = {
    settings.boolean: "maybe",
    settings.positive_seconds: "nan",
}


def _mentions(path: Path) -> list[tuple[str, int]]:
    """(GEMMTUNE_* word, line) in the strings and comments of a file: where a variable's name appears
    (identifiers such as profiling's GEMMTUNE_KERNELS are Python names, not variables)."""
    out = []
    kinds = {tokenize.STRING, tokenize.COMMENT} | {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in kinds:
            out += [(m.group(), tok.start[0]) for m in NAME.finditer(tok.string)]
    return out


def _declared(word: str) -> bool:
    # In prose "GEMMTUNE_*" means them all, "GEMMTUNE_CONFIG_<FAMILY>" the pattern entry itself.
    return (
        word == "GEMMTUNE_" or settings.declared(word) or any(s.pattern and s.name == word for s in settings.SETTINGS)
    )


def test_every_variable_the_source_names_is_declared():
    undeclared = [
        f"{path.relative_to(REPO)}:{line}: {word}"
        for path in sorted(SRC.rglob("*.py"))
        for word, line in _mentions(path)
        if not _declared(word)
    ]
    assert undeclared == []


def test_the_scan_finds_the_variables_the_readers_use():
    # The scan above cannot pass by finding nothing: it sees the readers' names and skips Python names.
    words = {w for path in SRC.rglob("*.py") for w, _ in _mentions(path)}
    assert {"GEMMTUNE_CONFIG_FMOE", "GEMMTUNE_TUNE_ONLINE", "GEMMTUNE_PDL"} <= words
    assert "GEMMTUNE_KERNELS" not in words and not settings.declared("GEMMTUNE_KERNELS")


def test_every_family_variable_is_declared():
    assert [f.env_var for f in families.all_families() if not settings.declared(f.env_var)] == []
    assert settings.lookup("GEMMTUNE_CONFIG_FMOE").pattern and not settings.lookup("GEMMTUNE_CONFIG").pattern


def _environ_reads(tree: ast.AST) -> list[ast.AST]:
    """Reads of the environment: environ.get(...), environ[...] loaded, os.getenv(...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner_name = getattr(owner, "attr", None) or getattr(owner, "id", None)
            if (node.func.attr == "get" and owner_name == "environ") or node.func.attr == "getenv":
                out.append(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if (getattr(node.value, "attr", None) or getattr(node.value, "id", None)) == "environ":
                out.append(node)
    return out


def test_no_gemmtune_variable_is_read_outside_the_settings_module():
    # Other variables (TRITON_INTERPRET, torchrun's RANK ...) may be read where they are used.
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "settings.py":
            continue
        for node in _environ_reads(ast.parse(path.read_text(encoding="utf-8"))):
            key = node.args[0] if isinstance(node, ast.Call) and node.args else getattr(node, "slice", None)
            text = ast.unparse(key) if key is not None else ""
            if "GEMMTUNE" in text or "ENV" in text or (isinstance(key, ast.Name) and key.id.isupper()):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


def test_the_read_check_flags_a_direct_read():
    code = 'import os\nos.environ.get("GEMMTUNE_LOG", "")\nos.environ[PLUGINS_ENV]\nos.environ.get("RANK")\n'
    reads = [ast.unparse(n) for n in _environ_reads(ast.parse(code))]
    assert reads == ["os.environ.get('GEMMTUNE_LOG', '')", "os.environ[PLUGINS_ENV]", "os.environ.get('RANK')"]


def test_docs_table_is_generated_from_the_settings():
    found = TABLE.search(DOCS.read_text(encoding="utf-8"))
    assert found, "docs/settings.md lacks the generated table's markers"
    assert found.group(1) == settings.markdown_table(), "regenerate: gemmtune doctor --settings-table"
    res = CliRunner().invoke(cli, ["doctor", "--settings-table"])
    assert res.exit_code == 0 and res.output == settings.markdown_table()


def test_the_table_has_a_row_per_setting():
    rows = settings.markdown_table().splitlines()[2:]
    assert len(rows) == len(settings.SETTINGS)
    assert all(f"`{s.name}" in row for s, row in zip(settings.SETTINGS, rows))
    assert all(s.read in (settings.IMPORT, settings.FIRST_USE, settings.PER_CALL) for s in settings.SETTINGS)


def _bad_value(s: settings.Setting) -> str | None:
    modes = getattr(s.parse, "modes", None)
    if modes:
        return "no-such-mode"
    if s.parse in BAD:
        return BAD[s.parse]
    return "-1" if s.parse.__qualname__.startswith("whole_number") else None


REFUSING = [s for s in settings.SETTINGS if _bad_value(s) is not None]


def test_every_parsed_kind_of_setting_has_a_bad_value_case():
    assert {s.name for s in REFUSING} >= {
        "GEMMTUNE_LOG", "GEMMTUNE_PDL", "GEMMTUNE_ATTENTION", "GEMMTUNE_TUNE_ONLINE_BUDGET",
        "GEMMTUNE_COMPILE_PROCESSES", "GEMMTUNE_TUNE_EXIT_AFTER", "GEMMTUNE_BLASLT_SEARCH",
    }  # fmt: skip


@pytest.mark.parametrize("setting", REFUSING, ids=[s.name for s in REFUSING])
def test_a_bad_value_is_an_env_var_error_naming_variable_and_value(setting):
    bad = _bad_value(setting)
    with pytest.raises(EnvVarError, match=rf"^{setting.name}='{re.escape(bad)}': expected"):
        setting.get({setting.name: f" {bad} "})
    assert setting.get({}) == setting.default and setting.get({setting.name: "  "}) == setting.default


def test_parsers_read_what_the_docs_say():
    env = {"GEMMTUNE_LOG": "Yes", "GEMMTUNE_PDL": "off", "GEMMTUNE_CONFIG_FMOE": "a.csv::b.csv",
           "GEMMTUNE_PLUGINS": " m1, ,m2", "GEMMTUNE_TUNE_ONLINE": "Off", "GEMMTUNE_ATTENTION": "SDPA"}  # fmt: skip
    assert settings.LOG.get(env) is True and settings.PDL.get(env) is False
    assert settings.get("GEMMTUNE_CONFIG_FMOE", env) == ["a.csv", "b.csv"]
    assert settings.PLUGINS.get(env) == ["m1", "m2"] and settings.TUNE_ONLINE.get(env) == ""
    assert settings.ATTENTION.get(env) == "sdpa"


def test_a_check_from_above_fails_as_the_parser_does():
    def no_triton(libs):
        if "triton" in libs:
            raise ValueError("not here")

    env = {"GEMMTUNE_TUNE_ONLINE_LIBTYPES": "torch,triton"}
    with pytest.raises(EnvVarError, match=r"^GEMMTUNE_TUNE_ONLINE_LIBTYPES='torch,triton': not here$"):
        settings.TUNE_ONLINE_LIBTYPES.get(env, check=no_triton)


def test_an_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="GEMMTUNE_NOPE"):
        settings.lookup("GEMMTUNE_NOPE")
    assert not settings.declared("GEMMTUNE_CONFIG_")  # the prefix alone names no family


def test_readers_raise_env_var_error(monkeypatch):
    from gemmtune.tuner.online import from_env

    monkeypatch.setenv("GEMMTUNE_COMPILE_OPS", "fast")
    with pytest.raises(EnvVarError, match=r"^GEMMTUNE_COMPILE_OPS='fast': compile ops 'fast': bad part"):
        settings.COMPILE_OPS.get(check=__import__("gemmtune.kernels.compile_mode").kernels.compile_mode.parse)
    with pytest.raises(EnvVarError, match=r"^GEMMTUNE_TUNE_ONLINE_MODE='lazy': expected one of background"):
        from_env({"GEMMTUNE_TUNE_ONLINE": "o.csv", "GEMMTUNE_TUNE_ONLINE_MODE": "lazy"})


def test_effective_settings_name_their_source(monkeypatch):
    monkeypatch.setattr(settings, "_api_calls", set())
    env = {"GEMMTUNE_BLASLT_SEARCH": "wide", "GEMMTUNE_PDL": "maybe", "GEMMTUNE_CONFIG_FMOE": "f.csv"}
    got = settings.effective(env, names=["GEMMTUNE_CONFIG", "GEMMTUNE_CONFIG_FMOE"])
    assert got["GEMMTUNE_BLASLT_SEARCH"] == "wide (environment)"
    assert got["GEMMTUNE_MLA_DECODE"] == "triton (default)"
    assert got["GEMMTUNE_CONFIG_FMOE"] == "f.csv (environment)" and got["GEMMTUNE_CONFIG"] == "- (default)"
    assert got["GEMMTUNE_PDL"].startswith("bad value (GEMMTUNE_PDL='maybe'")
    assert list(got)[:2] == ["GEMMTUNE_CONFIG", "GEMMTUNE_CONFIG_FMOE"]
    settings.api_called("set_config")
    got = settings.effective(env, names=["GEMMTUNE_CONFIG_FMOE"])
    assert got["GEMMTUNE_CONFIG_FMOE"] == "set by set_config() (environment: f.csv)"
    assert got["GEMMTUNE_CONFIG"] == "set by set_config() (environment: unset)"


def test_api_calls_are_recorded(monkeypatch):
    monkeypatch.setattr(settings, "_api_calls", set())
    assert settings.CONFIG.source({}) == "default"
    gemmtune.set_config(None)
    gemmtune.set_capture(None)
    assert settings.CONFIG.source({}) == "set_config()" and settings.CAPTURE.source({}) == "set_capture()"
    assert settings.TUNE_ONLINE.source({}) == "default"


def test_doctor_prints_the_settings_and_their_source(monkeypatch):
    monkeypatch.setattr(settings, "_api_calls", set())
    env = {"GEMMTUNE_BLASLT_SEARCH": "wide", "GEMMTUNE_CONFIG_FMOE": "f.csv"}
    res = CliRunner().invoke(cli, ["doctor"], env=env)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    at = lines.index("settings:")
    shown = dict(re.match(r"  (\S+)\s+(.*)$", line).groups() for line in lines[at + 1 :])
    assert shown["GEMMTUNE_BLASLT_SEARCH"] == "wide (environment)"
    assert shown["GEMMTUNE_CONFIG_FMOE"] == "f.csv (environment)"
    assert shown["GEMMTUNE_TUNE_ONLINE_MODE"] == "background (default)"
    assert set(shown) == {s.name for s in settings.SETTINGS if not s.pattern} | {
        f.env_var for f in families.all_families()
    }
    res = CliRunner().invoke(cli, ["doctor", "--json"], env=env)
    assert json.loads(res.output)["settings"]["GEMMTUNE_BLASLT_SEARCH"] == "wide (environment)"
