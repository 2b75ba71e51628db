"""The docs site: every page in mkdocs.yml's nav, links that stay inside docs/, and an API page that names
every public name of gemmtune with the object that carries its docstring."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import gemmtune

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
API = DOCS / "api.md"
# On the API page each public name is a heading, the mkdocstrings entry of its defining module below it.
API_ENTRY = re.compile(r"^### gemmtune\.(\w+)\n\n::: ([\w.]+)$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages() -> list[str]:
    """The .md files mkdocs.yml's nav lists (no YAML parser needed: `- Title: page.md` lines)."""
    return re.findall(r"^\s*- [^:\n]+: ([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"), re.M)


def _resolve(path: str):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_mkdocs_builds_docs_folder():
    assert re.search(r"^docs_dir: docs$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"), re.M)


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    nav = _nav_pages()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert len(nav) == len(set(nav)), nav
    assert sorted(nav) == pages, (sorted(set(pages) - set(nav)), sorted(set(nav) - set(pages)))


def test_relative_links_in_docs_stay_inside_docs():
    # mkdocs cannot follow a link out of docs/ (benchmarks/results/..., src/...): such paths are code spans.
    bad = []
    for page in DOCS.rglob("*.md"):
        text = re.sub(r"```.*?```|`[^`]*`", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is no link
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not (path.is_relative_to(DOCS.resolve()) and path.is_file()):
                bad.append(f"{page.relative_to(REPO)}: {target}")
    assert bad == []


def test_api_page_names_every_public_name():
    names = [name for name, _ in API_ENTRY.findall(API.read_text(encoding="utf-8"))]
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(gemmtune.__all__), (
        sorted(set(gemmtune.__all__) - set(names)),
        sorted(set(names) - set(gemmtune.__all__)),
    )


def test_api_entries_document_the_public_objects():
    # Each entry's path reaches the object gemmtune exports (an op: the function its module's prototype
    # became), so the page shows that object's docstring.
    wrong = []
    for name, path in API_ENTRY.findall(API.read_text(encoding="utf-8")):
        public, documented = getattr(gemmtune, name), _resolve(path)
        if documented is not public and documented.__doc__ != public.__doc__:
            wrong.append(f"{name}: {path}")
    assert wrong == []


def test_readme_python_snippets_run_after_the_quick_start(tmp_path, monkeypatch):
    # A snippet pasted after the quick start runs: the quick start wrote tuned.csv in the current folder.
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from gemmtune.cli.main import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "shapes.csv").write_text("M,N,K\n8,128,64\n")
    res = CliRunner().invoke(cli, ["tune", "shapes.csv", "-o", "tuned.csv", "--no-progress"])
    assert res.exit_code == 0, res.output
    snippets = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S)
    assert snippets
    try:
        for code in snippets:
            exec(compile(code, "README.md", "exec"), {})
    finally:
        gemmtune.set_config(None)
