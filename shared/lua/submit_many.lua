-- De-duplicated submit of many requests to one stream in one call (same rules as submit.lua).
-- KEYS[1] request stream, then KEYS[1 + i] the rid key of item i
-- ARGV[1] rid key TTL in seconds, then per item 4 values: token, request_id, reply_to ('' = none), data
-- Returns per item {code, value}: {1, entry_id} added, {2, entry_id} a retry of this token,
-- {0, holder_token} refused (another submit holds the request_id).
local out = {}
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS - 1 do
  local a = 1 + (i - 1) * 4
  local token, rid, reply, data = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local ridkey = KEYS[1 + i]
  local held = redis.call('GET', ridkey)
  if held then
    local sep = string.find(held, ' ', 1, true)
    local holder = string.sub(held, 1, sep - 1)
    if holder == token then
      out[i] = {2, string.sub(held, sep + 1)}
    else
      out[i] = {0, holder}
    end
  else
    local id
    if reply ~= '' then
      id = redis.call('XADD', KEYS[1], '*', 'rid', rid, 'reply_to', reply, 'data', data)
    else
      id = redis.call('XADD', KEYS[1], '*', 'rid', rid, 'data', data)
    end
    redis.call('SET', ridkey, token .. ' ' .. id, 'EX', ttl)
    out[i] = {1, id}
  end
end
return out
