"""benchmarks/results holds one artifact set per figure of the README or docs/: few files, every folder
cited on the results page (docs/results.md, which holds every figure) and holding the command that made
it, every headline figure of the README naming its folder, and every results path the repository names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULTS_PAGE = REPO / "docs" / "results.md"
MAX_FILES = 60
MAX_HEADLINES = 8
# A command line in a folder's README starts with one of these (after VAR=value assignments).
LAUNCHERS = ("gemmtune", "python", "python3", "pip")
RESULTS_PATH = re.compile(r"benchmarks/results(?:/[\w.*+-]+)*/?")


def _files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def _folders() -> list[Path]:
    return sorted({p.parent for p in _files()})


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _docs_pages() -> list[Path]:
    """Every page of the docs site, subfolders included."""
    return sorted((REPO / "docs").rglob("*.md"))


def _cited(text: str) -> list[str]:
    """The files under benchmarks/results that text names neither by name nor by folder."""
    return [_rel(p) for p in _files() if _rel(p) not in text and f"{_rel(p.parent)}/" not in text]


def _section(text: str, heading: str) -> str:
    start = text.find(f"\n## {heading}\n")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _command_lines(section: str) -> list[str]:
    """The lines of the section's fenced code blocks whose first word, after VAR=value assignments, launches."""
    lines = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            words = [w for w in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
            if words and (words[0] in LAUNCHERS or words[0].startswith("benchmarks/")):
                lines.append(line)
    return lines


def test_results_hold_at_most_60_files():
    files = _files()
    assert files, "benchmarks/results is empty"
    assert len(files) <= MAX_FILES, f"{len(files)} files under benchmarks/results (at most {MAX_FILES})"


def test_every_file_sits_in_a_folder_with_a_readme():
    loose = [_rel(p) for p in _files() if not (p.parent / "README.md").is_file()]
    assert loose == [], f"files outside a documented artifact folder: {loose}"


def test_every_results_folder_is_cited_on_the_results_page():
    uncited = _cited(RESULTS_PAGE.read_text(encoding="utf-8"))
    assert uncited == [], f"cited neither by name nor by folder on {_rel(RESULTS_PAGE)}: {uncited}"


def test_every_results_page_entry_names_its_artifact():
    # An entry is a ### heading with its bullets; each says where its figure lives.
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    entries = re.split(r"\n### ", text)
    bare = [e.splitlines()[0] for e in entries[1:] if not RESULTS_PATH.search(e)]
    assert len(entries) > 10 and bare == [], bare


def test_readme_headline_figures_each_name_their_artifact():
    section = _section((REPO / "README.md").read_text(encoding="utf-8"), "Headline figures")
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert 0 < len(rows) <= MAX_HEADLINES, rows
    prefix = re.search(r"artifact under `(benchmarks/results/)`", section)
    assert prefix, "the headline table's artifact column must say it is under benchmarks/results/"
    for row in rows:
        folders = re.findall(r"`([\w./-]+/)`", row.rsplit("|", 2)[1])
        assert folders, f"headline row names no artifact folder: {row}"
        for folder in folders:
            path = REPO / prefix.group(1) / folder
            assert path.is_dir() and f"{_rel(path)}/" in RESULTS_PAGE.read_text(encoding="utf-8"), (row, folder)


def test_every_results_folder_records_its_command_gpu_and_files():
    problems = []
    for folder in _folders():
        readme = folder / "README.md"
        if not readme.is_file():
            continue  # reported by test_every_file_sits_in_a_folder_with_a_readme
        text = readme.read_text(encoding="utf-8")
        if not _command_lines(_section(text, "Command")):
            problems.append(f"{_rel(readme)}: no command in a fenced block under '## Command'")
        if not re.search(r"^- GPU: \S", text, flags=re.M):
            problems.append(f"{_rel(readme)}: no '- GPU:' line")
        for p in folder.iterdir():
            if p.is_file() and p.name != "README.md" and f"`{p.name}`" not in text:
                problems.append(f"{_rel(readme)}: does not describe `{p.name}`")
    assert problems == []


def test_results_paths_named_anywhere_exist():
    sources = [REPO / "README.md", *_docs_pages(), *REPO.glob("src/**/*.py"), *REPO.glob("tests/*.py")]
    sources += [p for p in REPO.glob("benchmarks/**/*") if p.suffix in (".py", ".sh")]
    sources += list(RESULTS.rglob("README.md"))  # the artifacts themselves record where they were written
    missing = []
    for src in sources:
        for n, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
            for match in RESULTS_PATH.finditer(line):
                path = match.group(0).rstrip(".")
                if not (REPO / path).exists():
                    missing.append(f"{_rel(src)}:{n}: {path}")
    assert missing == []
