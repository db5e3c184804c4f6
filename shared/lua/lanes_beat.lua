-- A worker's heartbeat with affinity lanes on: its beat, and the fleet's lane table, in one call.
-- The lane table is what lets every worker agree on the lanes' owners without reading every other
-- worker's beat: the claiming workers with the server time of their last beat (a sorted set),
-- those whose last beat said they had no free slot (a set), and the published member list with
-- its epoch. A join or a leave marks the table changed; the next beat at least settle_ms after
-- the last publication publishes the list again (a burst of joins, a fleet starting, makes one
-- new list, not one per worker) and bumps the epoch: the change notice. A worker gets the list
-- back only when the epoch it knows is not the current one.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, LANES_BEAT):
-- workers_key (hash: name -> beat JSON), members_key (zset: claiming name -> ms of its last beat),
-- full_key (set), config_key (hash: lane_epoch, lane_changed, lane_published_at), plan_key (string:
-- the published member list, one name a line);
-- name; beat: its JSON ('' = the worker leaves: its beat is deleted); claiming: '1' = it claims now;
-- room: '1' = it has a free slot; late_ms: late after (ms); stale_ms: stale after (ms): such members
-- are dropped; known_epoch: the epoch the caller knows; settle_ms: publish at most this often (ms)
-- Returns {epoch, late members, full members (to a caller with a free slot), published list or
-- false (when the caller's epoch is current)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = false
if beat == '' then
  redis.call('HDEL', workers_key, name)
else
  redis.call('HSET', workers_key, name, beat)
end
if claiming == '1' then
  if redis.call('ZADD', members_key, now, name) == 1 then changed = true end
  if room == '1' then redis.call('SREM', full_key, name) else redis.call('SADD', full_key, name) end
else
  if redis.call('ZREM', members_key, name) == 1 then changed = true end
  redis.call('SREM', full_key, name)
end
local stale_before = now - stale_ms
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', members_key, '-inf', '(' .. stale_before)) do
  redis.call('ZREM', members_key, gone)
  redis.call('SREM', full_key, gone)
  changed = true
end
local state = redis.call('HMGET', config_key, 'lane_epoch', 'lane_changed', 'lane_published_at')
local epoch = tonumber(state[1] or '0')
if changed or state[2] == '1' then
  if now - tonumber(state[3] or '0') >= settle_ms then
    redis.call('SET', plan_key, table.concat(redis.call('ZRANGE', members_key, 0, -1), '\n'))
    epoch = redis.call('HINCRBY', config_key, 'lane_epoch', 1)
    redis.call('HSET', config_key, 'lane_changed', '0', 'lane_published_at', tostring(now))
  elseif state[2] ~= '1' then
    redis.call('HSET', config_key, 'lane_changed', '1')
  end
end
local late = redis.call('ZRANGEBYSCORE', members_key, '-inf', '(' .. (now - late_ms))
local full = {}
if room == '1' then full = redis.call('SMEMBERS', full_key) end
local plan = false
if tostring(epoch) ~= known_epoch then plan = redis.call('GET', plan_key) or '' end
return {epoch, late, full, plan}
