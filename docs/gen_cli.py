"""Write the command-line reference (cli.md) from ``redroll.cli.main.build_parser()`` at build time.

Run by mkdocs-gen-files (see mkdocs.yml); ``python docs/gen_cli.py`` prints the page instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redroll.cli.main import build_parser  # noqa: E402


def _esc(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    try:
        return parser._get_formatter()._expand_help(action)
    except (KeyError, TypeError, ValueError):
        return action.help


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                yield name, sub, helps.get(name, "")


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, (argparse._StoreTrueAction,
                                                                             argparse._StoreFalseAction,
                                                                             argparse._HelpAction)):
        return ""
    if isinstance(action.default, (list, tuple)) and not action.default:
        return ""
    return f"`{action.default}`"


def _section(out: list[str], path: str, parser: argparse.ArgumentParser, summary: str, level: int) -> None:
    out.append(f"{'#' * level} `{path}`\n")
    if summary:
        out.append(f"{_esc(summary)}\n")
    if parser.description and parser.description != summary:
        out.append(f"{_esc(parser.description)}\n")
    usage = parser.format_usage().strip()
    out.append("```text\n" + usage + "\n```\n")
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0 and action.metavar is not None:
                name += f" `{action.metavar}`" if isinstance(action.metavar, str) else ""
        else:
            name = f"`{action.metavar or action.dest}`"
        if action.choices and not isinstance(action.choices, dict):
            choices = ", ".join(f"`{c}`" for c in action.choices)
            extra = f" (one of {choices})"
        else:
            extra = ""
        text = _help(parser, action)
        default = "" if "default" in text.lower() else _default(action)
        rows.append(f"| {name} | {_esc(text)}{extra} | {default} |")
    if rows:
        out.append("| option | what | default |\n| --- | --- | --- |")
        out.append("\n".join(rows) + "\n")
    for name, sub, help_ in _subparsers(parser):
        _section(out, f"{path} {name}", sub, help_, min(level + 1, 4))


def render() -> str:
    parser = build_parser()
    out = [
        "# Command line\n",
        "Generated from the `redroll` argument parser when the site is built: each command's usage, "
        "its options, their help and their defaults. Defaults shown as read from the environment "
        "(`REDROLL_*`) are those of the machine that built this page. Every command also takes "
        "`--help`.\n",
    ]
    out.append("```text\n" + parser.format_usage().strip() + "\n```\n")
    for name, sub, help_ in _subparsers(parser):
        _section(out, f"redroll {name}", sub, help_, 2)
    return "\n".join(out)


try:
    import mkdocs_gen_files
except ImportError:  # run by hand
    mkdocs_gen_files = None

if mkdocs_gen_files is not None and __name__ != "__main__":
    with mkdocs_gen_files.open("cli.md", "w") as f:
        f.write(render())
    mkdocs_gen_files.set_edit_path("cli.md", "gen_cli.py")
elif __name__ == "__main__":
    print(render())
