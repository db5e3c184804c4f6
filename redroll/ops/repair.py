"""``redroll repair``: give a stream whose ids are exhausted its ids back.

Anyone allowed to XADD with an explicit id can write the largest possible id
(``XADD key 18446744073709551615-18446744073709551615 …``); from then on the stream refuses every
new entry ("The stream has exhausted the last possible ID"). Workers hold their records while
``{ns}:results`` or ``{ns}:dead`` is in that state, and a producer whose reply stream is has its
requests dead-lettered. The repair, in one atomic script: delete the entries from the future
(ids later than now plus a margin), ack them in every consumer group, set the stream's last id
back to its newest real entry (XSETID), and move every group that had read into the future back
to that id (XGROUP SETID), so that the group sees what is added next. Valkey 8 refuses an
XSETID below the largest id ever deleted (Redis 7.0 allows it), so on such a server the same
script rebuilds the stream instead: the entries up to the cutoff with their ids, every group at
its (possibly moved back) last id, its consumers, and its pending entries with owner, idle time
and delivery count (XCLAIM … FORCE). Which rule applies is asked of the server on a scratch key
before the stream is touched.

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

MAX_REBUILD_ENTRIES = 200_000
"""The most entries a rebuild copies in one script (it blocks the server meanwhile: about a second
per 100k small entries); a longer stream is reported ``toolarge`` and left as it was."""

PROBE_SUFFIX = ":repair-probe"

REPAIR_LUA = """
-- KEYS[1] the stream, KEYS[2] a scratch key of the same hash tag (absent before and after).
-- ARGV: cutoff ms, dry run '1'/'0', the most entries a rebuild may copy.
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
local cutoff = ARGV[1] .. '-0'
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local last = field(info, 'last-generated-id')
if not later(last, cutoff) then return {'ok', last} end
if ARGV[2] == '1' then return {'broken', last} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'probe-exists', KEYS[2]} end
local future = redis.call('XRANGE', KEYS[1], '(' .. cutoff, '+')
local removed = {}
for _, e in ipairs(future) do removed[#removed + 1] = e[1] end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
local newlast = '0-1'
local top = redis.call('XREVRANGE', KEYS[1], cutoff, '-', 'COUNT', 1)
if top[1] then newlast = top[1][1] end
for _, g in ipairs(groups) do
  local delivered = field(g, 'last-delivered-id')
  if not later(delivered, cutoff) and later(delivered, newlast) then newlast = delivered end
end
local reset = {}
for _, g in ipairs(groups) do
  if later(field(g, 'last-delivered-id'), newlast) then reset[#reset + 1] = field(g, 'name') end
end
-- Servers differ: Redis 7.0 lets XSETID go below the largest deleted id, Valkey 8 refuses it.
-- Ask the server on a scratch stream (made and removed here) before touching the real one.
redis.call('XADD', KEYS[2], '18446744073709551615-18446744073709551615', 'probe', '1')
redis.call('XDEL', KEYS[2], '18446744073709551615-18446744073709551615')
local lowered = redis.pcall('XSETID', KEYS[2], '0-1', 'MAXDELETEDID', '0-1')
redis.call('DEL', KEYS[2])
if type(lowered) == 'table' and lowered['ok'] then
  for _, g in ipairs(groups) do
    if #removed > 0 then redis.call('XACK', KEYS[1], field(g, 'name'), unpack(removed)) end
  end
  if #removed > 0 then redis.call('XDEL', KEYS[1], unpack(removed)) end
  local maxdel = field(info, 'max-deleted-entry-id')
  if maxdel == nil or later(maxdel, newlast) then maxdel = newlast end
  redis.call('XSETID', KEYS[1], newlast, 'MAXDELETEDID', maxdel)
  for _, name in ipairs(reset) do redis.call('XGROUP', 'SETID', KEYS[1], name, newlast) end
  return {'repaired', last, newlast, removed, reset, 'xsetid'}
end
-- Rebuild: the same entries, ids, groups, consumers and pending entries (owner, idle time,
-- delivery count) on a fresh stream, without the entries from the future.
local length = field(info, 'length') - #removed
if length > tonumber(ARGV[3]) then return {'toolarge', last, length} end
local keep = redis.call('XRANGE', KEYS[1], '-', cutoff)
local kept = {}
for _, e in ipairs(keep) do kept[e[1]] = true end
local state = {}
for _, g in ipairs(groups) do
  local name = field(g, 'name')
  local pel = {}
  if field(g, 'pending') > 0 then
    pel = redis.call('XPENDING', KEYS[1], name, '-', '+', field(g, 'pending'))
  end
  local consumers = {}
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], name)) do
    consumers[#consumers + 1] = field(c, 'name')
  end
  local delivered = field(g, 'last-delivered-id')
  if later(delivered, newlast) then delivered = newlast end
  state[#state + 1] = {name = name, delivered = delivered, pel = pel, consumers = consumers}
end
redis.call('DEL', KEYS[1])
for _, e in ipairs(keep) do redis.call('XADD', KEYS[1], e[1], unpack(e[2])) end
if #keep == 0 then
  redis.call('XADD', KEYS[1], '0-1', 'repair', '1')
  redis.call('XDEL', KEYS[1], '0-1')
end
redis.call('XSETID', KEYS[1], newlast)
for _, g in ipairs(state) do
  redis.call('XGROUP', 'CREATE', KEYS[1], g.name, g.delivered)
  for _, c in ipairs(g.consumers) do redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], g.name, c) end
  for _, p in ipairs(g.pel) do
    if kept[p[1]] then
      redis.call('XCLAIM', KEYS[1], g.name, p[2], 0, p[1], 'IDLE', p[3], 'RETRYCOUNT', p[4], 'FORCE', 'JUSTID')
    end
  end
end
return {'repaired', last, newlast, removed, reset, 'rebuilt'}
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
    method: str | None = None
    """``xsetid`` (the server let the last id go back in place) or ``rebuilt`` (Valkey 8 and others
    refuse an id below the largest deleted one: the stream was rebuilt with the same entries,
    groups and pending entries)."""
    length: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in (None, [])}


async def repair_stream(r: Redis, key: str, *, dry_run: bool = False, margin_s: float = FUTURE_MARGIN_S,
                        max_rebuild: int = MAX_REBUILD_ENTRIES) -> RepairReport:
    """Repair one stream in one script: all of its writes or none (the scratch probe key it uses
    to learn the server's XSETID rule shares the stream's hash tag and is gone afterwards)."""
    cutoff_ms = int((time.time() + margin_s) * 1000)
    reply = await r.eval(REPAIR_LUA, 2, key, key + PROBE_SUFFIX, cutoff_ms, "1" if dry_run else "0", max_rebuild)
    state = text(reply[0])
    if state == "wrongtype":
        return RepairReport(key, state, kind=text(reply[1]))
    if state in ("ok", "broken"):
        return RepairReport(key, state, last_id=text(reply[1]))
    if state == "toolarge":
        return RepairReport(key, state, last_id=text(reply[1]), length=int(reply[2]))
    if state == "probe-exists":
        raise RuntimeError(f"redroll repair: {text(reply[1])} exists; it is the repair's scratch key: "
                           "remove it and run again")
    if state == "repaired":
        return RepairReport(key, state, last_id=text(reply[1]), new_last_id=text(reply[2]),
                            removed=[text(x) for x in reply[3]], groups_reset=[text(x) for x in reply[4]],
                            method=text(reply[5]))
    return RepairReport(key, state)


async def pipeline_streams(r: Redis, keys: Keys, parts: list[Keys]) -> list[str]:
    """Every stream of a pipeline: control, and per partition requests (with its affinity lanes),
    results, dead, reply streams."""
    from redroll.shared.lanes import pipeline_lanes

    lanes = await pipeline_lanes(r, keys) or 0
    streams = [keys.control]
    for part in parts:
        part = Keys(part.namespace, part.partition, lanes)
        streams += [part.requests, part.requests_high, *part.lane_streams, part.results, part.dead]
        streams += sorted([text(k) async for k in r.scan_iter(match=part.reply_prefix + "*", count=500)])
    return list(dict.fromkeys(streams))
