"""Fail when a relative link in README.md points to a file that does not exist, or to an anchor
that no heading of the linked Markdown file makes. ``mkdocs build --strict`` checks the links
inside docs/; this checks the README's (standard library only).

    python3 scripts/check_readme_links.py [README.md]
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ATTR_ID = re.compile(r"\{[^}]*#([\w-]+)[^}]*\}\s*$")


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code, where links are not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs) gives a heading."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](link) -> text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        m = HEADING.match(line)
        if not m:
            continue
        title = m.group(2)
        attr = ATTR_ID.search(title)
        if attr:
            found.add(attr.group(1))
            continue
        base = slug(title)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}_{n}")
    return found


def check(readme: Path) -> list[str]:
    problems = []
    text = _strip_code(readme.read_text(encoding="utf-8"))
    for lineno, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http:, https:, mailto: ...: not a file of the project
            path_part, _, anchor = target.partition("#")
            path = (readme.parent / unquote(path_part)).resolve() if path_part else readme
            if not path.exists():
                problems.append(f"{readme.name}:{lineno}: {target}: no such file")
                continue
            try:
                path.relative_to(ROOT)
            except ValueError:
                problems.append(f"{readme.name}:{lineno}: {target}: outside the project")
                continue
            if anchor and path.suffix == ".md" and unquote(anchor) not in anchors(path):
                problems.append(f"{readme.name}:{lineno}: {target}: no heading with anchor #{anchor}")
    return problems


def main(argv: list[str]) -> int:
    readme = Path(argv[1]).resolve() if len(argv) > 1 else ROOT / "README.md"
    problems = check(readme)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} broken link(s) in {readme.name}", file=sys.stderr)
        return 1
    print(f"{readme.name}: every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
