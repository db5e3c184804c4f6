-- A worker's heartbeat with affinity lanes on: its beat, and the fleet's lane table, in one call.
-- The lane table is what lets every worker agree on the lanes' owners without reading every other
-- worker's beat: the claiming workers with the server time of their last beat (a sorted set),
-- those whose last beat said they had no free slot (a set), and the published member list with
-- its epoch. A join or a leave marks the table changed; the next beat at least ARGV[8] ms after
-- the last publication publishes the list again (a burst of joins, a fleet starting, makes one
-- new list, not one per worker) and bumps the epoch: the change notice. A worker gets the list
-- back only when the epoch it knows is not the current one.
-- KEYS: workers (hash: name -> beat JSON), members (zset: claiming name -> ms of its last beat),
--       full (set), config (hash: lane_epoch, lane_changed, lane_published_at), plan (string: the
--       published member list, one name a line)
-- ARGV[1] name  ARGV[2] beat JSON ('' = the worker leaves: its beat is deleted)
-- ARGV[3] 1 = it claims now  ARGV[4] 1 = it has a free slot  ARGV[5] late after (ms)
-- ARGV[6] stale after (ms): such members are dropped  ARGV[7] the epoch the caller knows
-- ARGV[8] publish at most this often (ms)
-- Returns {epoch, late members, full members (to a caller with a free slot), published list or
-- false (when the caller's epoch is current)}.
local name = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = false
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], name)
else
  redis.call('HSET', KEYS[1], name, ARGV[2])
end
if ARGV[3] == '1' then
  if redis.call('ZADD', KEYS[2], now, name) == 1 then changed = true end
  if ARGV[4] == '1' then redis.call('SREM', KEYS[3], name) else redis.call('SADD', KEYS[3], name) end
else
  if redis.call('ZREM', KEYS[2], name) == 1 then changed = true end
  redis.call('SREM', KEYS[3], name)
end
local stale_before = now - tonumber(ARGV[6])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. stale_before)) do
  redis.call('ZREM', KEYS[2], gone)
  redis.call('SREM', KEYS[3], gone)
  changed = true
end
local state = redis.call('HMGET', KEYS[4], 'lane_epoch', 'lane_changed', 'lane_published_at')
local epoch = tonumber(state[1] or '0')
if changed or state[2] == '1' then
  if now - tonumber(state[3] or '0') >= tonumber(ARGV[8]) then
    redis.call('SET', KEYS[5], table.concat(redis.call('ZRANGE', KEYS[2], 0, -1), '\n'))
    epoch = redis.call('HINCRBY', KEYS[4], 'lane_epoch', 1)
    redis.call('HSET', KEYS[4], 'lane_changed', '0', 'lane_published_at', tostring(now))
  elseif state[2] ~= '1' then
    redis.call('HSET', KEYS[4], 'lane_changed', '1')
  end
end
local late = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - tonumber(ARGV[5])))
local full = {}
if ARGV[4] == '1' then full = redis.call('SMEMBERS', KEYS[3]) end
local plan = false
if tostring(epoch) ~= ARGV[7] then plan = redis.call('GET', KEYS[5]) or '' end
return {epoch, late, full, plan}
