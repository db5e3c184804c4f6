"""The user pages (README.md and docs/**/*.md) speak about the project, not its development log:
no round numbers ("R46"), no commit hashes, no talk of sessions or rounds, no file:line citations
(of other projects' source or our own: lines move, the pages would lie). And the engine tables of
docs/engines.md are the registry's, as ``engine_table()`` renders them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from redroll.cli.engine_flags import engine_table
from tests.conftest import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

PATTERNS = {
    "a round number": re.compile(r"(?<![\w/.-])R\d{1,3}(?![\w.])"),
    # 7 to 40 hex digits standing alone, at least one letter and one digit: a commit, not an entry
    # id (digits only), a word, or a function library's digest (redroll_<digest>: joined by "_").
    "a commit hash": re.compile(r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])"),
    "development-log talk": re.compile(r"\b(?:previous|earlier|last|this|next|prior) (?:session|round)s?\b", re.I),
    "a source file:line": re.compile(
        r"[\w/.-]+\.(?:py|pyi|lua|rs|go|c|cc|cpp|h|hpp|cu|ts|js|java|rb)(?::\d+(?:[-–]\d+)?\b|#L\d+)"),
}


def offences(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in PATTERNS.items():
            found += [f"{path.relative_to(ROOT)}:{number}: {what}: {m.group(0)}" for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_development_log(page):
    assert offences(page) == []


@pytest.mark.parametrize("line, what", [
    ("the runner of commit b3635ad (R46, R47)", {"a round number", "a commit hash"}),
    ("as the previous session measured", {"development-log talk"}),
    ("`sampling_params.py:177`, tokenizer_manager.py:2629-2663", {"a source file:line"}),
    ("worker.py#L40", {"a source file:line"}),
])
def test_the_patterns_catch_what_they_are_for(line, what):
    assert {m for m, pattern in PATTERNS.items() if pattern.search(line)} == what


@pytest.mark.parametrize("line", [
    "redroll_4ade095bb050: loaded on server",            # the function library's digest
    "entry 1796527380641-0 on requests",                   # a stream entry id
    "redroll_<digest>_submit_many, `…_finish_many`",
    "R, the language; ROLL's convention; RL rollouts",
    "a session id, the previous turn's worker, each agent session",
    "redroll.engine_worker.engines.example:ExampleEngine, http://127.0.0.1:8000/v1, 03:12:52.801",
    "sha: deadbeef (no digit) and 12345678 (no letter)",
])
def test_the_patterns_leave_real_values_alone(line):
    assert {m for m, pattern in PATTERNS.items() if pattern.search(line)} == set()


ENGINE_TABLE = re.compile(r"<!-- engine-table: [^>]*-->\n(.*?)\n<!-- end engine-table -->", re.S)


def test_the_engines_page_holds_the_registrys_tables():
    page = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    (table,) = ENGINE_TABLE.findall(page)
    assert table == engine_table(), (
        "docs/engines.md's engine tables differ from the registry: run python scripts/engine_tables.py")
