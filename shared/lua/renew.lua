-- Owner-checked lease renewal (or hand-back) of pending entries.
-- A bare XCLAIM takes an entry from whoever holds it; this one only touches entries that
-- XPENDING shows as owned by ARGV[2], and uses JUSTID so the delivery count is not raised.
-- KEYS[1] stream   ARGV[1] group  ARGV[2] consumer  ARGV[3] idle ms to set (0 = renew now)
-- ARGV[4..] entry ids
-- KEYS[2] (a worker's hand-back) the hand-back marks: stream -> ms part of the newest entry id
-- handed back there (raised only), so that reclaim_scan.lua looks at entries that new.
-- Returns the ids this consumer no longer owns.
-- (Numbers are passed to redis.call as strings: a Lua number is formatted back with printf.)
local lost = {}
local newest = -1
for i = 4, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, '1')
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, id)
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], '0', id, 'IDLE', ARGV[3], 'JUSTID')
    local ms = tonumber(string.match(id, '^(%d+)'))
    if ms and ms > newest then newest = ms end
  end
end
if KEYS[2] and newest >= 0 then
  redis.call('ZADD', KEYS[2], 'GT', tostring(newest), KEYS[1])
end
return lost
