"""Each function's KEYS/ARGV layout is written once (shared/function_layouts.py): the Lua bodies use
the names its generated prologue binds, never positions, and what a packer sends is what the
prologue reads back, on a real redis-server."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import pytest
import redis

from redroll.shared.function_layouts import (
    LAYOUTS,
    Arg,
    ArgList,
    FunctionLayout,
    Key,
    KeyList,
    LayoutError,
)
from redroll.shared.functions import LIBRARY, LIBRARY_SOURCE, SCRIPTS, build_library, function_name


def body(name: str) -> str:
    return resources.files("redroll.shared").joinpath("lua", f"{name}.lua").read_text()


def code(lua: str) -> str:
    """``lua`` without its comments (the header says what each name means)."""
    return "\n".join(line.split("--", 1)[0] for line in lua.splitlines())


def test_every_function_has_its_layout():
    assert set(LAYOUTS) == set(SCRIPTS)
    assert all(layout.name == name for name, layout in LAYOUTS.items())


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_body_uses_names_only_and_every_name_its_layout_declares(name):
    lua = body(name)
    assert not re.search(r"\b(KEYS|ARGV)\s*\[|#\s*(KEYS|ARGV)\b", lua), f"{name}.lua reads KEYS or ARGV by position"
    assert f"shared/function_layouts.py, {name.upper()}" in lua  # (the header says where the places are)
    unused = [n for n in LAYOUTS[name].names() if not re.search(rf"(?<![\w.]){re.escape(n)}\b", code(lua))]
    assert not unused, f"{name}.lua never uses {unused}"
    # (a local of the same name would hide the layout's: its body would read something else)
    top = [n for n in LAYOUTS[name].names() if "." not in n]
    hidden = [n for n in top if re.search(rf"\blocal\s+(function\s+)?([\w\s,]*,\s*)?{n}\b", code(lua))]
    assert not hidden, f"{name}.lua declares a local named like its layout's {hidden}"


def test_the_library_has_each_prologue():
    for name, layout in LAYOUTS.items():
        assert f"local function {name}(KEYS, ARGV)\n{layout.prologue()}" in LIBRARY_SOURCE


def sample(layout: FunctionLayout, n_items: int, present: bool) -> tuple[dict, dict, list, dict]:
    """Keys, args and items to pack for ``layout`` (optional keys given when ``present``), and what
    the prologue should bind from them."""
    keys: dict[str, Any] = {}
    args: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    for i, kp in enumerate(layout.keys):
        if isinstance(kp, KeyList):
            keys[kp.name] = [f"{{t}}:{kp.name}:{j}" for j in range(i % 3 + (2 if present else 0))]
            expected[kp.name] = keys[kp.name]
        else:
            keys[kp.name] = f"{{t}}:{kp.name}" if present or not kp.optional else None
            expected[kp.name] = keys[kp.name] if keys[kp.name] is not None else False
    for i, ap in enumerate(layout.args):
        if isinstance(ap, ArgList):
            args[ap.name] = [str(10 * i + j) for j in range(i % 2 + 2)]
            expected[ap.name] = [int(v) if ap.number else v for v in args[ap.name]]
        else:
            args[ap.name] = str(i)
            expected[ap.name] = i if ap.number else str(i)
    items: list[dict[str, Any]] = []
    if layout.items is not None:
        numbers = {a.name for a in layout.items.args if a.number}
        fields = [*layout.items.keys, *(a.name for a in layout.items.args)]
        items = [{f: f"{{t}}:{f}:{i}" if f in layout.items.keys else str(100 * i + j) for j, f in enumerate(fields)}
                 for i in range(n_items)]
        expected[layout.items.count] = n_items
        expected[layout.items.name] = {f: [int(it[f]) if f in numbers else it[f] for it in items] for f in fields}
    return keys, args, items, expected


def echo_body(layout: FunctionLayout) -> str:
    """A body that returns, as JSON, every name the prologue bound."""
    names = [n for n in layout.names() if "." not in n]
    return "return cjson.encode({" + ", ".join(f"{n} = {n}" for n in names) + "})"


def normal(value: Any) -> Any:
    """cjson writes an empty Lua table as {}: read as an empty list."""
    if value == {}:
        return []
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items()}
    return value


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


SHAPES = [LAYOUTS["release_rids"], LAYOUTS["claim_lanes"], LAYOUTS["renew"], LAYOUTS["dead_letter"],
          LAYOUTS["finish_many"], LAYOUTS["submit_many"], LAYOUTS["ack_replies"], LAYOUTS["checkpoint_many"]]


@pytest.mark.parametrize("n_items,present", [(0, False), (1, True), (3, False), (4, True)])
def test_what_a_packer_sends_the_prologue_reads_back_by_name(client, n_items, present):
    """Variadic key and arg lists, optional keys, per-item groups (none, one, several items): the
    lists ``pack`` builds, read by the generated prologue in a real redis-server, give back each name."""
    library, source = build_library({layout.name: echo_body(layout) for layout in SHAPES},
                                    {}, layouts={layout.name: layout for layout in SHAPES})
    client.function_load(source, replace=True)
    try:
        for layout in SHAPES:
            keys, args, items, expected = sample(layout, n_items, present)
            packed_keys, packed_args = layout.pack(keys, args, items)
            reply = client.fcall(f"{library}_{layout.name}", len(packed_keys), *packed_keys, *packed_args)
            assert normal(json.loads(reply)) == normal(expected), layout.name
    finally:
        client.function_delete(library)


def test_pack_refuses_names_its_layout_does_not_declare():
    renew = LAYOUTS["renew"]
    ok = {"group": "g", "consumer": "c", "idle_ms": 0, "entry_ids": ["1-0"]}
    assert renew.pack({"stream": "s", "marks": None}, ok) == (["s"], [0, 1, "g", "c", 0, "1-0"])
    with pytest.raises(LayoutError, match=r"renew: keys missing \['marks'\]"):
        renew.pack({"stream": "s"}, ok)
    with pytest.raises(LayoutError, match=r"unknown \['budget'\]"):
        renew.pack({"stream": "s", "marks": None}, {**ok, "budget": 1})
    with pytest.raises(LayoutError, match="may not be None"):
        renew.pack({"stream": None, "marks": None}, ok)
    with pytest.raises(LayoutError, match="an item's fields"):
        LAYOUTS["ack_replies"].pack({"stream": "s", "own_key": "o"}, {"group": "g"}, [{"entry": "1-0"}])
    with pytest.raises(LayoutError, match="declared twice"):
        FunctionLayout("twice", keys=(Key("a"),), args=(Arg("a"),))
    with pytest.raises(LayoutError, match="not a usable Lua name"):
        FunctionLayout("reserved", args=(ArgList("end"),))


def test_the_library_loads_on_a_real_server(client):
    client.function_load(LIBRARY_SOURCE, replace=True)
    assert client.fcall(function_name("version"), 0) == LIBRARY.encode()
