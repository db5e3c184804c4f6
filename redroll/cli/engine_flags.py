"""``redroll worker``'s engine flags, derived from the engine registry (:mod:`redroll.engine_worker.engines.registry`).

Each flag is added once, whichever engines honour it, and its help says which do. After parsing,
:func:`engine_options` turns the flags (then their ``REDROLL_*`` variables, then each engine's own
defaults) into the chosen engine's constructor keywords, and :func:`flag_refusal` refuses a flag
given on the command line to an engine that does not honour it (a variable set for another engine
of the fleet is left alone).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from redroll.engine_worker.engines.base import EngineOption, EngineSpec
from redroll.engine_worker.engines.registry import ENGINES
from redroll.shared.settings import Settings
from redroll.shared.values import key_values

_TRUE = {"1", "true", "yes", "on"}


def _by_flag() -> dict[str, list[tuple[EngineSpec, EngineOption]]]:
    flags: dict[str, list[tuple[EngineSpec, EngineOption]]] = {}
    for spec in ENGINES.values():
        for option in spec.options:
            flags.setdefault(option.flag, []).append((spec, option))
    return flags


def _honoured_by(pairs: list[tuple[EngineSpec, EngineOption]]) -> str:
    parts = []
    for spec, option in pairs:
        default = "" if option.default in (None, False) else f", default {option.default}"
        parts.append(f"{spec.name}: {option.kwarg}{default}")
    return "; ".join(parts)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One argument per engine flag (aliases included), default None (so a given flag is told
    from an absent one), in one group with the engines that honour each."""
    g = p.add_argument_group("engine options (each for the engines named in its help; given to another, refused)")
    for flag, pairs in _by_flag().items():
        option = pairs[0][1]
        aliases = sorted({a for _s, o in pairs for a in o.aliases})
        help_text = argparse.SUPPRESS if option.hidden else (
            f"{option.help} [{_honoured_by(pairs)}] (env {option.env_name})")
        kwargs: dict[str, Any] = {"dest": option.dest, "default": None, "help": help_text}
        if option.type is None:
            kwargs["action"] = "store_true"
        elif option.repeatable:
            kwargs.update(action="append", metavar="KEY=VALUE")
        else:
            kwargs["type"] = option.type
            if option.type is int or "int" in getattr(option.type, "__name__", ""):
                kwargs["metavar"] = "N"  # (a duration gets its unit from the parser: see cli.options.unit_metavar)
            if option.choices:
                kwargs["choices"] = option.choices
        g.add_argument(flag, *aliases, **kwargs)
    g.add_argument("--engine-arg", dest="engine_arg", action="append", default=None, metavar="KEY=VALUE",
                   help="a constructor keyword of an engine given as package.module:Class (repeatable; VALUE "
                        "is parsed as JSON when it can be)")


def given_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on the command line (their canonical spelling)."""
    found = [flag for flag, pairs in _by_flag().items() if getattr(args, pairs[0][1].dest, None) not in (None, False)]
    if getattr(args, "engine_arg", None):
        found.append("--engine-arg")
    return found


def flag_refusal(args: argparse.Namespace, spec: EngineSpec) -> str | None:
    """Why these engine flags cannot go with ``spec``'s engine, or None."""
    honoured = {o.flag for o in spec.options}
    if spec.name not in ENGINES:
        honoured.add("--engine-arg")
    wrong = [flag for flag in given_flags(args) if flag not in honoured]
    if not wrong:
        return None
    owners = _by_flag()
    said = []
    for flag in wrong:
        engines = [s.name for s, _o in owners.get(flag, [])]
        said.append(f"{flag} ({', '.join(engines) if engines else 'engines given as package.module:Class'} only)")
    return f"the {spec.name} engine does not take {', '.join(said)}"


def parse_key_values(pairs: Sequence[str], flag: str) -> dict[str, Any]:
    """``["a=1", "b-c=true"]`` → ``{"a": 1, "b_c": True}`` (JSON when it parses)."""
    return key_values(pairs, flag, key=lambda k: k.replace("-", "_"))


def _from_env(option: EngineOption) -> Any:
    raw = os.environ.get(option.env_name)
    if raw is None or raw == "":
        return None
    if option.type is None:
        return raw.strip().lower() in _TRUE
    if option.repeatable:
        return [pair for pair in raw.split(",") if pair]
    try:
        value = option.type(raw)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(f"{option.env_name}={raw!r}: {exc}") from None
    if option.choices and value not in option.choices:
        raise ValueError(f"{option.env_name}={raw!r} is not one of {', '.join(option.choices)}")
    return value


def engine_options(args: argparse.Namespace, spec: EngineSpec, settings: Settings) -> dict[str, Any]:
    """The constructor keywords of ``spec``'s engine: each of its flags as given, else its
    variable, else the engine's default; ``--model-path`` for an engine that loads a model."""
    kwargs: dict[str, Any] = {}
    if spec.loads_model:
        kwargs["model_path"] = args.model_path
    for option in spec.options:
        value = getattr(args, option.dest, None)
        if value in (None, False):
            value = _from_env(option)
        if value in (None, False):
            value = option.default
            if value is None:
                continue
        elif option.type is None:
            value = not option.negates
        if option.repeatable:
            value = parse_key_values(value, option.flag)
        kwargs[option.kwarg] = value
    for kwarg, field in spec.from_settings:
        kwargs[kwarg] = getattr(settings, field)
    if getattr(args, "engine_arg", None):
        kwargs.update(parse_key_values(args.engine_arg, "--engine-arg"))
    return kwargs


def engine_table() -> str:
    """The engines, then their flags, as two Markdown tables (docs/engines.md holds them;
    tests/test_docs_pages.py keeps the page and the registry equal)."""
    rows = ["| engine | what it runs | `--model-path` | its flags |", "| --- | --- | --- | --- |"]
    for spec in ENGINES.values():
        model = "required" if spec.loads_model else "not used"
        if spec.builtin_models:
            model += " (or " + ", ".join(f"`{m}`" for m in spec.builtin_models) + ")"
        if spec.accepts_hub_ids:
            model += " (a directory or a Hub id)"
        flags = ", ".join(f"`{o.flag}`" for o in spec.options if not o.hidden)
        rows.append(f"| `{spec.name}` | {spec.summary} | {model} | {flags} |")
    rows += ["", "| flag (also spelled) | variable | engine: the constructor keyword it sets (default) | what |",
             "| --- | --- | --- | --- |"]
    for flag, pairs in _by_flag().items():
        option = pairs[0][1]
        if option.hidden:
            continue
        aliases = sorted({a for _s, o in pairs for a in o.aliases})
        spelled = f"`{flag}`" + "".join(f" (`{a}`)" for a in aliases)
        honoured = "; ".join(f"{s.name}: `{o.kwarg}`" + ("" if o.default in (None, False) else f" ({o.default})")
                             for s, o in pairs)
        rows.append(f"| {spelled} | `{option.env_name}` | {honoured} | {option.help.replace('|', '/')} |")
    return "\n".join(rows)
