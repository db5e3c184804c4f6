-- Fenced finish: only the consumer that owns the pending request entry may publish its record.
-- KEYS[1] request stream   KEYS[2] reply stream   KEYS[3] rid key
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] request entry id
-- ARGV[4] rid  ARGV[5] status  ARGV[6] worker  ARGV[7] data (msgpack)  ARGV[8] reply MAXLEN cap (0 = none)
-- Returns 1 when published, 0 when this consumer no longer owns the entry (its output is dropped).
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  return 0
end
local cap = tonumber(ARGV[8])
if cap > 0 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', cap, '*', 'rid', ARGV[4], 'status', ARGV[5], 'worker', ARGV[6], 'data', ARGV[7])
else
  redis.call('XADD', KEYS[2], '*', 'rid', ARGV[4], 'status', ARGV[5], 'worker', ARGV[6], 'data', ARGV[7])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
-- Release the submit de-duplication key only if it still names this entry.
local held = redis.call('GET', KEYS[3])
if held and string.sub(held, -string.len(ARGV[3]) - 1) == ' ' .. ARGV[3] then
  redis.call('DEL', KEYS[3])
end
return 1
