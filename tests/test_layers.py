"""The package layout docs/design.md draws: each package imports only from its own layer or below,
the three roles never import one another, and no module grows past the size one reader holds."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FOLDERS = {"shared": "redroll.shared", "producer": "redroll.producer", "engine_worker": "redroll.engine_worker",
           "consumer": "redroll.consumer", "redroll": "redroll"}
"""Repository folder → the installed package it is (pyproject.toml's package-dir)."""

LAYERS = [
    ["redroll.shared"],
    ["redroll.security", "redroll.ops"],
    ["redroll.observability"],
    ["redroll.producer", "redroll.engine_worker", "redroll.consumer"],
    ["redroll", "redroll.integrations", "redroll.testing"],
    ["redroll.web"],
    ["redroll.cli"],
]
"""Lowest first, as docs/design.md ("The layout") writes them. ``redroll`` alone is the public API
(``redroll/__init__.py``, ``redroll.handlers``)."""

SIBLINGS_MAY_IMPORT = {("redroll.testing", "redroll"), ("redroll.integrations", "redroll")}
"""Same-layer imports that are allowed: test support and integrations build on the public API."""

MAX_LINES = 550


def package_of(module: str) -> str:
    groups = [g for layer in LAYERS for g in layer if g != "redroll"]
    for group in sorted(groups, key=len, reverse=True):
        if module == group or module.startswith(group + "."):
            return group
    return "redroll"


def rank(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def production_modules() -> list[tuple[str, Path]]:
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join([package, *parts]), path))
    return out


def imports_of(path: Path) -> set[str]:
    """Every redroll module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in names if n.split(".")[0] == "redroll")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "redroll")
    return found


def test_every_package_has_a_layer() -> None:
    for module, _path in production_modules():
        assert any(package_of(module) in layer for layer in LAYERS), module


def test_no_package_imports_from_a_layer_above_it_or_a_sibling() -> None:
    wrong = []
    for module, path in production_modules():
        here = package_of(module)
        for target in imports_of(path):
            there = package_of(target)
            if there == here or (here, there) in SIBLINGS_MAY_IMPORT:
                continue
            if rank(there) >= rank(here):
                wrong.append(f"{module} imports {target} ({there} is not below {here})")
    assert not wrong, "\n".join(sorted(wrong))


def test_relative_imports_stay_inside_their_package() -> None:
    """A relative import reaches a sibling module only (``from .x import``): what crosses packages is
    spelled out, so the test above sees it."""
    wrong = [f"{module}: from {'.' * node.level}{node.module or ''}" for module, path in production_modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom) and node.level > 1]
    assert not wrong, "\n".join(wrong)


def test_no_module_is_longer_than_one_reader_holds() -> None:
    long = [f"{path.relative_to(ROOT)}: {n} lines" for _m, path in production_modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)
