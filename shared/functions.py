"""The project's Lua code as one Redis function library, called with FCALL.

The roles (producer, worker, consumer) may not run Lua of their own (no EVAL, EVALSHA, SCRIPT):
they call the functions of this library, which an administrator loads (``redroll functions
load``; :func:`load_library`). A function runs with the caller's ACL user, so each command inside
is still checked against the role's grants. Unlike a script in the script cache, a loaded library
is replicated and persisted: a replica promoted after a failover has it.

The library is built in code from the script bodies in ``shared/lua/*.lua``: each body becomes the
callback of one ``redis.register_function``, after a prologue that binds the names of its KEYS and
ARGV (generated from its layout in ``shared/function_layouts.py``, which the packers of
``shared/scripts.py`` pack by too). Library and function names carry a digest of the
library's source (:data:`LIBRARY`), because libraries and functions are server-wide: two redroll
versions with different Lua code load two libraries side by side on one server.

A client with the rights to load it (the default user of a single-user deployment, the tests, the
demo) loads the library itself when a call finds it missing; a role user meets
:class:`FunctionsNotLoadedError`, one line naming the command an administrator runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping

import redis
from redis.asyncio.cluster import RedisCluster

from redroll.shared.errors import RedrollError
from redroll.shared.function_layouts import LAYOUTS, FunctionLayout

SCRIPTS: dict[str, tuple[str, ...]] = {
    "submit_many": (),
    "finish_many": (),
    "dead_letter": (),
    "cancel_queued": (),
    "checkpoint_many": (),
    "save_parts": (),
    "renew": ("allow-oom",),
    "claim": ("allow-oom",),
    "claim_lanes": ("allow-oom",),
    "delete_consumer_if_empty": ("allow-oom",),
    "release_rids": ("allow-oom",),
    "ack_replies": ("allow-oom",),
    "lanes_beat": (),
    "reclaim_scan": ("no-writes", "allow-oom"),
}
"""Each script of ``shared/lua`` (its file is ``<name>.lua``) and its function flags.

Without flags a function that may write is refused as a whole while Redis is out of memory or a
read-only replica (the per-item scripts then report that refusal for every item:
:func:`whole_call_refusal`). Claiming, renewing and dropping an empty consumer call no command
that out of memory refuses (XREADGROUP, XCLAIM, XGROUP DELCONSUMER free or keep memory), so they
run then too (``allow-oom``), and workers keep draining the backlog; releasing stale rid keys and
a producer's acks only delete (``allow-oom`` too)."""


def _body(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def build_library(bodies: dict[str, str], flags: dict[str, tuple[str, ...]], prelude: str = "",
                  layouts: Mapping[str, FunctionLayout] | None = None) -> tuple[str, str]:
    """(library name, source) for the script ``bodies``: each wrapped in a function of
    ``KEYS`` and ``ARGV``, after the prologue its layout generates (``layouts[name]``: the locals
    that name its keys and args; a body without a layout reads KEYS and ARGV itself), and
    registered as ``<library>_<name>`` with its ``flags``; ``prelude`` (helpers several bodies
    call: ``shared/lua/prelude.lua``) comes once, before them."""
    layouts = layouts or {}
    blocks = []
    for name, body in bodies.items():
        flag_list = ", ".join(f"'{f}'" for f in flags.get(name, ()))
        prologue = layouts[name].prologue() if name in layouts else ""
        blocks.append((name, f"local function {name}(KEYS, ARGV)\n{prologue}{body.rstrip()}\nend\n", flag_list))
    digest = hashlib.sha1("\0".join([prelude, *(b + "\1" + f for _, b, f in blocks)]).encode()).hexdigest()[:12]
    library = f"redroll_{digest}"
    lines = [f"#!lua name={library}",
             "-- redroll's Lua code (built from shared/lua/*.lua by redroll.shared.functions: edit those)"]
    if prelude:
        lines.append(prelude.rstrip() + "\n")
    for name, block, flag_list in blocks:
        lines.append(block)
        lines.append(f"redis.register_function{{function_name='{library}_{name}', callback={name}, "
                     f"flags={{{flag_list}}}}}")
    # (the probe a role user calls to learn whether the library is there: it may not FUNCTION LIST)
    lines.append(f"redis.register_function{{function_name='{library}_version', "
                 f"callback=function() return '{library}' end, flags={{'no-writes', 'allow-oom', 'allow-stale'}}}}")
    return library, "\n".join(lines) + "\n"


LIBRARY, LIBRARY_SOURCE = build_library({name: _body(name) for name in SCRIPTS}, SCRIPTS, _body("prelude"), LAYOUTS)
"""This version's library name (``redroll_<digest>``) and its source."""


def function_name(script: str) -> str:
    """The FCALL name of ``script`` (a key of :data:`SCRIPTS`, or ``version``) in this version's library."""
    if script not in SCRIPTS and script != "version":
        raise KeyError(f"no redroll function {script!r}")
    return f"{LIBRARY}_{script}"


class FunctionsMissingError(RedrollError, redis.exceptions.NoScriptError):
    """The server does not have this version's function library (a fresh or flushed server): the
    function-library counterpart of NOSCRIPT, so callers that reload after NOSCRIPT reload it."""


class FunctionsNotLoadedError(RedrollError, redis.exceptions.NoPermissionError):
    """The library is missing and this client may not load it (FUNCTION LOAD): a missing permission,
    reported like the others (``describe_error``), on one line naming the command to run."""

    def __init__(self, detail: str = ""):
        super().__init__(
            f"redis has no redroll function library {LIBRARY} and this user may not load it: "
            f"an administrator runs 'redroll functions load'{f' ({detail})' if detail else ''}"
        )


def is_missing(error: BaseException | str) -> bool:
    """True when ``error`` is the server's answer to an FCALL of a function it does not have."""
    return "Function not found" in str(error)


def whole_call_refusal(error: BaseException) -> str | None:
    """The message of a refusal of a whole function call that each item would have met alone (out
    of memory, a read-only replica: a writing function is refused before it starts), else None."""
    message = str(error)
    # (redis-py raises these two as their own classes, the error code cut off the message)
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return message if message.startswith("OOM") else f"OOM {message}"
    if isinstance(error, redis.exceptions.ReadOnlyError):
        return message if message.startswith("READONLY") else f"READONLY {message}"
    if isinstance(error, redis.ResponseError) and message.split(" ", 1)[0] in ("OOM", "READONLY"):
        return message
    return None


@dataclass(frozen=True)
class LoadReport:
    library: str
    loaded: list[str]
    """Nodes (``host:port``) where this call loaded it."""
    present: list[str]
    """Nodes that already had it."""


def _node_names(client: Any) -> list[Any]:
    if isinstance(client, RedisCluster):
        return list(client.get_primaries())
    return [None]


async def load_library(client: Any) -> LoadReport:
    """Load this version's library on the server (every primary of a cluster); a node that has it
    already keeps it. Raises :class:`FunctionsNotLoadedError` when the user may not load it."""
    loaded: list[str] = []
    present: list[str] = []
    for node in _node_names(client):
        where = f"{node.host}:{node.port}" if node is not None else "server"
        kwargs = {"target_nodes": node} if node is not None else {}
        try:
            await client.execute_command("FUNCTION", "LOAD", LIBRARY_SOURCE, **kwargs)
            loaded.append(where)
        except redis.exceptions.NoPermissionError as exc:
            raise FunctionsNotLoadedError(str(exc)) from exc
        except redis.ResponseError as exc:
            if "already exists" not in str(exc):
                raise
            present.append(where)
    return LoadReport(LIBRARY, loaded, present)


async def ensure_library(client: Any) -> None:
    """Make sure every node has this version's library: each is asked with FCALL of the library's
    ``version`` function (what a role may run); where it is missing it is loaded
    (:func:`load_library`: raises :class:`FunctionsNotLoadedError` when this user may not)."""
    for node in _node_names(client):
        kwargs = {"target_nodes": node} if node is not None else {}
        try:
            await client.execute_command("FCALL", function_name("version"), 0, **kwargs)
        except redis.ResponseError as exc:
            if not is_missing(exc):
                raise
            await load_library(client)
            return


async def library_loaded(client: Any) -> bool:
    """Whether every node has this version's library (FUNCTION LIST: an administrator's check)."""
    for node in _node_names(client):
        kwargs = {"target_nodes": node} if node is not None else {}
        found = await client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY, **kwargs)
        if not any(_library_name(lib) == LIBRARY for lib in found or []):
            return False
    return True


def _library_name(entry: Any) -> str | None:
    if isinstance(entry, dict):
        value = entry.get(b"library_name", entry.get("library_name"))
    else:
        items = list(entry)
        pairs = dict(zip(items[::2], items[1::2]))
        value = pairs.get(b"library_name", pairs.get("library_name"))
    return value.decode() if isinstance(value, bytes) else value
