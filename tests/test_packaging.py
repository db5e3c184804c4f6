"""The installed layout: one ``redroll`` namespace, every module under it, no import cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

SUBPACKAGES = {"shared": "redroll.shared", "producer": "redroll.producer",
               "engine_worker": "redroll.engine_worker", "consumer": "redroll.consumer", "redroll": "redroll"}
"""Repository folder → installed package name."""

OUTSIDE = ("tests", "benchmarks", "examples", "scripts")


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [*SUBPACKAGES[rel.parts[0]].split("."), *rel.parts[1:]]
    parts[-1] = parts[-1][:-3]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports (module level, in functions, under TYPE_CHECKING), resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def test_nothing_imports_the_folders_under_their_repository_names():
    """Installed, the folders are redroll.*: an import of ``shared`` would load the same file a
    second time under another name (two ValidationError classes)."""
    offenders = []
    for path in _python_files(*SUBPACKAGES, *OUTSIDE):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in ("shared", "producer", "engine_worker", "consumer")]
    assert not offenders, offenders


def test_no_import_cycles_between_modules():
    modules = {_module_name(p): p for p in _python_files(*SUBPACKAGES)}
    graph = {m: {t for t in _imports(p, m) if t in modules and t != m} for m, p in modules.items()}
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = out.glob("redroll-*.whl")
    return found


def test_wheel_holds_only_the_redroll_namespace(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"redroll"}
    # Every module and Lua script of the repository's folders is in it, under redroll/.
    expected = {f"{_module_name(p).replace('.', '/')}{'/__init__' if p.name == '__init__.py' else ''}.py"
                for p in _python_files(*SUBPACKAGES)}
    expected |= {f"redroll/shared/lua/{p.name}" for p in (ROOT / "shared" / "lua").glob("*.lua")}
    assert expected <= set(names), sorted(expected - set(names))


def test_lua_scripts_load_from_the_package():
    from redroll.shared import functions

    assert "XADD" in functions.LIBRARY_SOURCE and "XPENDING" in functions.LIBRARY_SOURCE
