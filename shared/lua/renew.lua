-- Owner-checked lease renewal (or hand-back) of pending entries.
-- A bare XCLAIM takes an entry from whoever holds it; this one only touches entries that
-- XPENDING shows as owned by `consumer`, and uses JUSTID so the delivery count is not raised.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, RENEW):
-- stream; group; consumer; idle_ms: the idle time to set (0 = renew now); entry_ids;
-- marks (a worker's hand-back; false otherwise) the hand-back marks: stream -> ms part of the
-- newest entry id handed back there (raised only), so that reclaim_scan.lua looks at entries that new.
-- Returns the ids this consumer no longer owns.
-- (Numbers are passed to redis.call as strings: a Lua number is formatted back with printf.)
local lost = {}
local newest = -1
for i = 1, #entry_ids do
  local id = entry_ids[i]
  local p = redis.call('XPENDING', stream, group, id, id, '1')
  if #p == 0 or p[1][2] ~= consumer then
    table.insert(lost, id)
  else
    redis.call('XCLAIM', stream, group, consumer, '0', id, 'IDLE', idle_ms, 'JUSTID')
    local ms = tonumber(string.match(id, '^(%d+)'))
    if ms and ms > newest then newest = ms end
  end
end
if marks and newest >= 0 then
  redis.call('ZADD', marks, 'GT', tostring(newest), stream)
end
return lost
