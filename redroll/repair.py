"""``redroll repair``: give a stream whose ids are exhausted its ids back.

Anyone allowed to XADD with an explicit id can write the largest possible id
(``XADD key 18446744073709551615-18446744073709551615 …``); from then on the stream refuses every
new entry ("The stream has exhausted the last possible ID"). Workers hold their records while
``{ns}:results`` or ``{ns}:dead`` is in that state, and a producer whose reply stream is has its
requests dead-lettered. The repair, in one atomic script: delete the entries from the future
(ids later than now plus a margin), ack them in every consumer group, set the stream's last id
back to its newest real entry (XSETID), and move every group that had read into the future back
to that id (XGROUP SETID), so that the group sees what is added next.

It fixes request, result, reply, dead-letter and control streams alike. It does not fix a key of
another type (someone wrote a hash or a string where a stream belongs): that key must be removed
or renamed by hand, and redroll recreates the stream. Run it as an administrator (XSETID and
XGROUP SETID are not in any role's grants).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from redroll.shared.keys import Keys
from redroll.shared.streams import text

FUTURE_MARGIN_S = 3600.0
"""Entries more than this far in the future count as traps (clocks of one fleet agree far better)."""

REPAIR_LUA = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return {'none'} end
if kind ~= 'stream' then return {'wrongtype', kind} end
local function field(list, name)
  for i = 1, #list, 2 do if list[i] == name then return list[i + 1] end end
end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function later(a, b)  -- id a after id b
  local ams, aseq = parse(a)
  local bms, bseq = parse(b)
  return ams > bms or (ams == bms and aseq > bseq)
end
local cutoff = ARGV[1]
local last = field(redis.call('XINFO', 'STREAM', KEYS[1]), 'last-generated-id')
if not later(last, cutoff .. '-0') then return {'ok', last} end
if ARGV[2] == '1' then return {'broken', last} end
local future = redis.call('XRANGE', KEYS[1], '(' .. cutoff .. '-0', '+')
local removed = {}
for _, e in ipairs(future) do removed[#removed + 1] = e[1] end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
local newlast = '0-1'
local top = redis.call('XREVRANGE', KEYS[1], '(' .. cutoff .. '-0', '-', 'COUNT', 1)
if top[1] then newlast = top[1][1] end
for _, g in ipairs(groups) do
  local delivered = field(g, 'last-delivered-id')
  if not later(delivered, cutoff .. '-0') and later(delivered, newlast) then newlast = delivered end
end
for _, g in ipairs(groups) do
  if #removed > 0 then redis.call('XACK', KEYS[1], field(g, 'name'), unpack(removed)) end
end
if #removed > 0 then redis.call('XDEL', KEYS[1], unpack(removed)) end
redis.call('XSETID', KEYS[1], newlast)
local reset = {}
for _, g in ipairs(groups) do
  if later(field(g, 'last-delivered-id'), newlast) then
    redis.call('XGROUP', 'SETID', KEYS[1], field(g, 'name'), newlast)
    reset[#reset + 1] = field(g, 'name')
  end
end
return {'repaired', last, newlast, removed, reset}
"""


@dataclass
class RepairReport:
    key: str
    state: str
    """``ok`` (nothing to do), ``repaired``, ``broken`` (a dry run found it exhausted), ``none``
    (no such key) or ``wrongtype`` (a key of another type: not fixable here)."""
    last_id: str | None = None
    new_last_id: str | None = None
    removed: list[str] = field(default_factory=list)
    groups_reset: list[str] = field(default_factory=list)
    kind: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in (None, [])}


async def repair_stream(r: Redis, key: str, *, dry_run: bool = False,
                        margin_s: float = FUTURE_MARGIN_S) -> RepairReport:
    cutoff_ms = int((time.time() + margin_s) * 1000)
    reply = await r.eval(REPAIR_LUA, 1, key, cutoff_ms, "1" if dry_run else "0")
    state = text(reply[0])
    if state == "wrongtype":
        return RepairReport(key, state, kind=text(reply[1]))
    if state in ("ok", "broken"):
        return RepairReport(key, state, last_id=text(reply[1]))
    if state == "repaired":
        return RepairReport(key, state, last_id=text(reply[1]), new_last_id=text(reply[2]),
                            removed=[text(x) for x in reply[3]], groups_reset=[text(x) for x in reply[4]])
    return RepairReport(key, state)


async def pipeline_streams(r: Redis, keys: Keys, parts: list[Keys]) -> list[str]:
    """Every stream of a pipeline: control, and per partition requests, results, dead, reply streams."""
    streams = [keys.control]
    for part in parts:
        streams += [part.requests, part.requests_high, part.results, part.dead]
        streams += sorted([text(k) async for k in r.scan_iter(match=part.reply_prefix + "*", count=500)])
    return list(dict.fromkeys(streams))
