"""Rewrite docs/engines.md's engine tables from the registry: ``python scripts/engine_tables.py``
(tests/test_docs_pages.py fails, saying to run this, when they differ)."""

from __future__ import annotations

import re
from pathlib import Path

from redroll.cli.engine_flags import engine_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "engines.md"
BLOCK = re.compile(r"(<!-- engine-table: [^\n]*-->\n).*?(\n<!-- end engine-table -->)", re.S)


def main() -> None:
    text = PAGE.read_text()
    new, n = BLOCK.subn(lambda m: m.group(1) + engine_table() + m.group(2), text)
    if n != 1:
        raise SystemExit(f"{PAGE}: no engine-table markers")
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
