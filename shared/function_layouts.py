"""Each function's KEYS and ARGV layout, written once: the Python packers (``shared/scripts.py``)
build an FCALL's lists from it by name, and ``build_library`` (``shared/functions.py``) binds the
same names as Lua locals before the function's body (``shared/lua/<name>.lua``), which then uses
names only: no position is written by hand on either side.

A layout lists, in order:

- ``keys``: :class:`Key` (one key; ``optional=True``: the packer may give None, then the Lua name
  is ``false``) and :class:`KeyList` (any number of keys: a Lua table);
- ``args``: :class:`Arg` (one value; ``number=True``: bound with ``tonumber``) and :class:`ArgList`
  (any number of values: a Lua table);
- ``items``: :class:`Items`, a batch's per-item keys and args, repeated once per item. In Lua each
  per-item name is a column of the group's table, read ``<group>.<name>[i]`` for item ``i`` (1 to
  the group's ``count``), so the body still names every value and no item builds a table of its own.

What goes over the wire (:meth:`FunctionLayout.pack`): KEYS are the keys in order (a list's keys in
its place, an absent optional key left out), then each item's keys; ARGV is first a header of
counts, one per variadic part in order (each KeyList, each optional Key as 0 or 1, each ArgList,
then the number of items), then the args in order, then each item's args. The header is packed by
the layout, never by hand, and read by the generated prologue (:meth:`FunctionLayout.prologue`).

"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import Any, Callable, Mapping, Sequence, Union

from redroll.shared.errors import RedrollError

LUA_RESERVED = frozenset(
    "and break do else elseif end false for function if in local nil not or repeat return then true until while".split()
)
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class LayoutError(RedrollError, ValueError):
    """A layout declared wrongly, or packed with names it does not declare (a programming error)."""


@dataclass(frozen=True)
class Key:
    """One key; ``optional``: the packer may give None, then the key is left out and the Lua name is ``false``."""

    name: str
    optional: bool = False


@dataclass(frozen=True)
class KeyList:
    """Any number of keys: a Lua table (their count goes in ARGV's header)."""

    name: str


@dataclass(frozen=True)
class Arg:
    """One value; ``number``: bound in Lua as ``tonumber`` of it (else the string as it came)."""

    name: str
    number: bool = False


class ArgList(Arg):
    """Any number of values: a Lua table (their count goes in ARGV's header), each bound as :class:`Arg` binds one."""


@dataclass(frozen=True)
class Items:
    """A batch's per-item keys and args. In Lua: ``count`` (a number) and the table ``name`` whose
    field per key or arg is a column: ``<name>.<field>[i]`` for item i."""

    keys: tuple[str, ...] = ()
    args: tuple[Arg, ...] = ()
    name: str = "item"
    count: str = "n"


KeyPart = Union[Key, KeyList]
ArgPart = Union[Arg, ArgList]


class _Offset:
    """A position in KEYS or ARGV as Lua reads it: a constant plus the counts of the variadic parts
    before it (their Lua names)."""

    def __init__(self, const: int = 0):
        self.const = const
        self.terms: list[str] = []

    def plus(self, extra: str) -> str:
        """Lua for this offset + ``extra`` (a number or a name)."""
        const = self.const + (int(extra) if extra.isdigit() else 0)
        parts = [str(const)] if const else []
        parts += self.terms
        if not extra.isdigit():
            parts.append(extra)
        return " + ".join(parts) or "0"


@dataclass(frozen=True)
class FunctionLayout:
    name: str
    keys: tuple[KeyPart, ...] = ()
    args: tuple[ArgPart, ...] = ()
    items: Items | None = None

    def __post_init__(self) -> None:
        top = [p.name for p in (*self.keys, *self.args)]
        fields: list[str] = []
        if self.items is not None:
            top += [self.items.count, self.items.name]
            fields = [*self.items.keys, *(a.name for a in self.items.args)]
            if not fields or any(isinstance(a, ArgList) for a in self.items.args):
                raise LayoutError(f"{self.name}: an item has one value per key and arg, and at least one")
        for n in (*top, *fields):
            if not _NAME.match(n) or n in LUA_RESERVED:
                raise LayoutError(f"{self.name}: {n!r} is not a usable Lua name")
        if len(set(top)) != len(top) or len(set(fields)) != len(fields):
            raise LayoutError(f"{self.name}: a name is declared twice")

    def names(self) -> list[str]:
        """Every Lua name this layout binds: keys, args, the items' count and table, and each item
        field (as ``<table>.<field>``)."""
        out = [p.name for p in self.keys] + [p.name for p in self.args]
        if self.items is not None:
            out += [self.items.count, self.items.name]
            out += [f"{self.items.name}.{f}" for f in (*self.items.keys, *(a.name for a in self.items.args))]
        return out

    def _counted(self) -> list[KeyPart | ArgPart]:
        """The variadic parts whose count leads ARGV, in order (the items' count comes after them)."""
        return [p for p in (*self.keys, *self.args)
                if isinstance(p, (KeyList, ArgList)) or (isinstance(p, Key) and p.optional)]

    # -- Python: the lists an FCALL sends
    def pack(self, keys: Mapping[str, Any] | None = None, args: Mapping[str, Any] | None = None,
             items: Sequence[Mapping[str, Any]] = ()) -> tuple[list[Any], list[Any]]:
        """(KEYS, ARGV) for a call: ``keys`` and ``args`` give each declared key and arg by name (a
        list for a KeyList or ArgList, None for an absent optional key), ``items`` one mapping per
        item with each of its keys and args. Counts are added by the layout."""
        keys, args = keys or {}, args or {}
        self._check("key", keys, self.keys)
        self._check("arg", args, self.args)
        out_keys: list[Any] = []
        out_args: list[Any] = []
        header: list[Any] = []
        for part in (*self.keys, *self.args):
            is_key = isinstance(part, (Key, KeyList))
            out, value = (out_keys, keys[part.name]) if is_key else (out_args, args[part.name])
            if isinstance(part, (KeyList, ArgList)):
                header.append(len(value))
                out.extend(value)
            elif isinstance(part, Key) and part.optional:
                header.append(0 if value is None else 1)
                if value is not None:
                    out.append(value)
            elif value is None:
                raise LayoutError(f"{self.name}: {part.name!r} may not be None")
            else:
                out.append(value)
        if self.items is not None:
            header.append(len(items))
            key_fields, arg_fields, width, item_keys, item_args = self._item_getters
            try:
                for item in items:
                    if len(item) != width:
                        raise KeyError(sorted(set(item) ^ {*key_fields, *arg_fields}))
                    out_keys.extend(item_keys(item))
                    out_args.extend(item_args(item))
            except KeyError as exc:
                raise LayoutError(f"{self.name}: an item's fields are not its layout's: {exc.args[0]}") from None
        elif items:
            raise LayoutError(f"{self.name}: has no items")
        return out_keys, header + out_args

    @cached_property
    def _item_getters(self) -> tuple[tuple[str, ...], tuple[str, ...], int, Callable[[Any], tuple],
                                     Callable[[Any], tuple]]:
        """The items' key and arg fields, their number, and what reads each part's values off an item."""
        assert self.items is not None
        key_fields, arg_fields = self.items.keys, tuple(a.name for a in self.items.args)
        return key_fields, arg_fields, len(key_fields) + len(arg_fields), _getter(key_fields), _getter(arg_fields)

    def _check(self, what: str, given: Mapping[str, Any], parts: Sequence[KeyPart | ArgPart]) -> None:
        declared = {p.name for p in parts}
        if set(given) != declared:
            missing, unknown = sorted(declared - set(given)), sorted(set(given) - declared)
            raise LayoutError(f"{self.name}: {what}s missing {missing}, unknown {unknown}")

    # -- Lua: the locals a body uses
    def prologue(self) -> str:
        """Lua that binds each declared name from KEYS and ARGV (placed before the body)."""
        lines = [f"-- ({self.name}'s KEYS and ARGV by name: generated from redroll.shared.function_layouts)"]
        counted = self._counted()
        count_of: dict[str, str] = {}
        for at, part in enumerate(counted, 1):
            count_of[part.name] = f"_{part.name}_n"
            lines.append(f"local _{part.name}_n = tonumber(ARGV[{at}])")
        if self.items is not None:
            lines.append(f"local {self.items.count} = tonumber(ARGV[{len(counted) + 1}])")
        k = _Offset()
        for kp in self.keys:
            if isinstance(kp, KeyList):
                lines.append(f"local {kp.name} = {{}}")
                lines.append(f"for j = 1, {count_of[kp.name]} do {kp.name}[j] = KEYS[{k.plus('j')}] end")
                k.terms.append(count_of[kp.name])
            elif kp.optional:
                lines.append(f"local {kp.name} = {count_of[kp.name]} == 1 and KEYS[{k.plus('1')}]")
                k.terms.append(count_of[kp.name])
            else:
                lines.append(f"local {kp.name} = KEYS[{k.plus('1')}]")
                k.const += 1
        a = _Offset(len(counted) + (self.items is not None))
        for ap in self.args:
            if isinstance(ap, ArgList):
                value = _number(f"ARGV[{a.plus('j')}]", ap.number)
                lines.append(f"local {ap.name} = {{}}")
                lines.append(f"for j = 1, {count_of[ap.name]} do {ap.name}[j] = {value} end")
                a.terms.append(count_of[ap.name])
            else:
                lines.append(f"local {ap.name} = {_number(f'ARGV[{a.plus(str(1))}]', ap.number)}")
                a.const += 1
        if self.items is not None:
            lines += self._item_lines(k, a)
        return "\n".join(lines) + "\n"

    def _item_lines(self, k: _Offset, a: _Offset) -> list[str]:
        items = self.items
        assert items is not None
        fields = [*items.keys, *(f.name for f in items.args)]
        columns = [f"_{f}" for f in fields]
        # (each column is made at its full size at once, filled with placeholders that the loop
        # replaces: a column grown one item at a time is rebuilt at each power of two, which cost
        # checkpoint_many about a microsecond an item; unpack's limit bounds the placeholders)
        source = "ARGV" if items.args else "KEYS"
        lines = [f"local function _column() if {items.count} > 0 and {items.count} <= 4000 then "
                 f"return {{unpack({source}, 1, {items.count})}} end return {{}} end",
                 f"local {items.name} = {{{', '.join(f'{f} = _column()' for f in fields)}}}",
                 "do",
                 f"  local {', '.join(columns)} = {', '.join(f'{items.name}.{f}' for f in fields)}",
                 f"  for i = 1, {items.count} do"]
        nk, na = len(items.keys), len(items.args)
        if nk:
            lines.append(f"    local k = {k.plus(f'(i - 1) * {nk}')}")
        if na:
            lines.append(f"    local a = {a.plus(f'(i - 1) * {na}')}")
        for j, f in enumerate(items.keys, 1):
            lines.append(f"    _{f}[i] = KEYS[k + {j}]")
        for j, arg in enumerate(items.args, 1):
            lines.append(f"    _{arg.name}[i] = {_number(f'ARGV[a + {j}]', arg.number)}")
        lines.append("  end")
        lines.append("end")
        return lines


def _getter(fields: tuple[str, ...]) -> Callable[[Any], tuple]:
    """What reads ``fields`` off a mapping, as a tuple (one C call a mapping: packing is on the hot path)."""
    if len(fields) > 1:
        return itemgetter(*fields)
    return lambda item: tuple(item[f] for f in fields)


def _number(expr: str, number: bool) -> str:
    return f"tonumber({expr})" if number else expr


# -- the functions' layouts (what each name means: the header of shared/lua/<name>.lua)
SUBMIT_MANY = FunctionLayout(
    "submit_many", keys=(Key("stream"),), args=(Arg("ttl"),),
    items=Items(keys=("rid_key", "own_key", "reply_key"),
                args=(Arg("token"), Arg("rid"), Arg("reply_to"), Arg("ak"), Arg("data"))))
FINISH_MANY = FunctionLayout(
    "finish_many", keys=(Key("stream"), Key("marker")),
    args=(Arg("group"), Arg("consumer"), Arg("worker"), Arg("marker_ttl"), Arg("marker_cap", number=True),
          Arg("ev_cap", number=True), Arg("ev_ttl")),
    items=Items(keys=("reply_key", "rid_key", "partial_key", "own_key", "events_key"),
                args=(Arg("entry"), Arg("rid"), Arg("status"), Arg("data"), Arg("cap"), Arg("resumable"),
                      Arg("summary"))))
DEAD_LETTER = FunctionLayout(
    "dead_letter",
    keys=(Key("source"), Key("dead"), Key("reply_key", optional=True), Key("own_key", optional=True),
          Key("rid_key", optional=True), Key("partial_key", optional=True), Key("events_key")),
    args=(Arg("group"), Arg("consumer"), Arg("entry"), Arg("reason"), Arg("source_name"), Arg("delete_entry"),
          Arg("rec_rid"), Arg("rec_status"), Arg("rec_worker"), Arg("rec_data"), Arg("deliveries"),
          Arg("reply_refused"), Arg("ev_cap", number=True), Arg("ev_ttl")),
    items=Items(name="field", count="nfields", args=(Arg("name"), Arg("value"))))
CANCEL_QUEUED = FunctionLayout(
    "cancel_queued", keys=(Key("stream"), Key("reply_key")),
    args=(Arg("group"), Arg("entry"), Arg("rid"), Arg("status"), Arg("data")))
RENEW = FunctionLayout(
    "renew", keys=(Key("stream"), Key("marks", optional=True)),
    args=(Arg("group"), Arg("consumer"), Arg("idle_ms"), ArgList("entry_ids")))
CLAIM = FunctionLayout(
    "claim", keys=(KeyList("streams"),), args=(Arg("group"), Arg("consumer"), Arg("budget", number=True)))
CLAIM_LANES = FunctionLayout(
    "claim_lanes", keys=(Key("high"), KeyList("own"), Key("shared"), KeyList("others")),
    args=(Arg("group"), Arg("consumer"), Arg("budget", number=True), Arg("steal_ms", number=True),
          Arg("depth", number=True)))
DELETE_CONSUMER_IF_EMPTY = FunctionLayout(
    "delete_consumer_if_empty", keys=(Key("stream"),), args=(Arg("group"), Arg("consumer")))
RELEASE_RIDS = FunctionLayout(
    "release_rids", keys=(KeyList("streams"), KeyList("rid_keys")), args=(Arg("dry_run"),))
ACK_REPLIES = FunctionLayout(
    "ack_replies", keys=(Key("stream"), Key("own_key")), args=(Arg("group"),),
    items=Items(name="record", args=(Arg("entry"), Arg("rid"))))
LANES_BEAT = FunctionLayout(
    "lanes_beat", keys=(Key("workers_key"), Key("members_key"), Key("full_key"), Key("config_key"), Key("plan_key")),
    args=(Arg("name"), Arg("beat"), Arg("claiming"), Arg("room"), Arg("late_ms", number=True),
          Arg("stale_ms", number=True), Arg("known_epoch"), Arg("settle_ms", number=True)))
CHECKPOINT_MANY = FunctionLayout(
    "checkpoint_many", keys=(KeyList("streams"),),
    args=(Arg("group"), Arg("consumer"), Arg("part_ttl"), Arg("chunk_ttl", number=True), Arg("ev_cap", number=True),
          Arg("ev_ttl"), ArgList("lease_from"), ArgList("lease_to")),
    items=Items(name="save", keys=("partial", "evkey", "chunks", "ownkey"),
                args=(Arg("stream_at", number=True), Arg("entry"), Arg("saved", number=True), Arg("count"),
                      Arg("part"), Arg("field"), Arg("submitted"), Arg("flags"), Arg("length", number=True),
                      Arg("event"), Arg("prior"))))
SAVE_PARTS = FunctionLayout(
    "save_parts", keys=(KeyList("streams"), Key("parts"), KeyList("chunks")),
    args=(Arg("group"), Arg("consumer"), Arg("keep_ms", number=True), Arg("parts_ttl"), Arg("chunk_ttl", number=True),
          ArgList("lease_from"), ArgList("lease_to"), ArgList("refresh")),
    items=Items(name="part", args=(Arg("stream_at", number=True), Arg("entry"), Arg("chunk_at", number=True),
                                   Arg("field"), Arg("data"))))
RECLAIM_SCAN = FunctionLayout(
    "reclaim_scan", keys=(KeyList("streams"), Key("marks")), args=(Arg("group"), Arg("min_idle_ms"), Arg("count")))

LAYOUTS: dict[str, FunctionLayout] = {layout.name: layout for layout in (
    SUBMIT_MANY, FINISH_MANY, DEAD_LETTER, CANCEL_QUEUED, RENEW, CLAIM, CLAIM_LANES, DELETE_CONSUMER_IF_EMPTY,
    RELEASE_RIDS, ACK_REPLIES, LANES_BEAT, RECLAIM_SCAN, CHECKPOINT_MANY, SAVE_PARTS)}
"""Every function's layout by its name."""
