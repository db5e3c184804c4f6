-- Dead-letter one pending entry, owner-checked, and tell its waiter.
-- KEYS[1] source stream  KEYS[2] dead stream  KEYS[3..] optional: reply stream, rid key
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] entry id  ARGV[4] reason  ARGV[5] source name
-- ARGV[6] delete the entry after ack (1/0)   ARGV[7] index of the reply key in KEYS (0 = none)
-- ARGV[8] index of the rid key in KEYS (0 = none)
-- ARGV[9..12] error record: rid, status, worker, data (used when a reply key is given)
-- ARGV[13] delivery count   ARGV[14] number of original field pairs, then the pairs
-- Returns 1 when dead-lettered, 0 when this consumer no longer owns the entry.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  return 0
end
local entry = {'reason', ARGV[4], 'source', ARGV[5], 'entry', ARGV[3], 'deliveries', ARGV[13]}
local npairs = tonumber(ARGV[14])
for i = 0, npairs - 1 do
  local k = ARGV[15 + 2 * i]
  if k ~= 'reason' and k ~= 'source' and k ~= 'entry' and k ~= 'deliveries' then
    table.insert(entry, k)
    table.insert(entry, ARGV[16 + 2 * i])
  end
end
redis.call('XADD', KEYS[2], '*', unpack(entry))
local reply_idx = tonumber(ARGV[7])
if reply_idx > 0 then
  redis.call('XADD', KEYS[reply_idx], '*', 'rid', ARGV[9], 'status', ARGV[10], 'worker', ARGV[11], 'data', ARGV[12])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[6] == '1' then
  redis.call('XDEL', KEYS[1], ARGV[3])
end
local rid_idx = tonumber(ARGV[8])
if rid_idx > 0 then
  local held = redis.call('GET', KEYS[rid_idx])
  if held and string.sub(held, -string.len(ARGV[3]) - 1) == ' ' .. ARGV[3] then
    redis.call('DEL', KEYS[rid_idx])
  end
end
return 1
