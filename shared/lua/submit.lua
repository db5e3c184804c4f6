-- Submit one request with de-duplication by request_id, atomically with the XADD.
-- KEYS[1] request stream   KEYS[2] rid key
-- ARGV[1] submit token  ARGV[2] request_id  ARGV[3] reply_to ('' = none)  ARGV[4] data (msgpack)
-- ARGV[5] rid key TTL in seconds
-- Returns {1, entry_id} when added, {2, entry_id} when this token already added it (a retry),
-- {0, holder_token} when another submit holds this request_id.
local held = redis.call('GET', KEYS[2])
if held then
  local sep = string.find(held, ' ', 1, true)
  local token = string.sub(held, 1, sep - 1)
  local entry = string.sub(held, sep + 1)
  if token == ARGV[1] then
    return {2, entry}
  end
  return {0, token}
end
local id
if ARGV[3] ~= '' then
  id = redis.call('XADD', KEYS[1], '*', 'rid', ARGV[2], 'reply_to', ARGV[3], 'data', ARGV[4])
else
  id = redis.call('XADD', KEYS[1], '*', 'rid', ARGV[2], 'data', ARGV[4])
end
redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. id, 'EX', tonumber(ARGV[5]))
return {1, id}
