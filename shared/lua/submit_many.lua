-- De-duplicated submit of many requests to one stream in one call, atomically with each XADD.
-- KEYS[1] request stream, then KEYS[1 + i] the rid key of item i
-- ARGV[1] rid key TTL in seconds, then per item 5 values: token, request_id, reply_to ('' = none),
-- affinity key ('' = none: the plain field ak), data
-- Returns per item {code, value}: {1, entry_id} added, {2, entry_id} a retry of this token (it was
-- added before), {0, holder_token} refused (another submit holds the request_id), {3, error} the
-- request stream or the rid key refused it (out of memory, a read-only replica, a key of another
-- type): nothing of that item was written.
-- All or nothing per item: its reads come first, its first write (the XADD) goes through pcall,
-- and the SET that follows a successful XADD cannot fail. One item never changes another's fate.
local out = {}
local ttl = ARGV[1]
local stream = KEYS[1]
for i = 1, #KEYS - 1 do
  local a = 1 + (i - 1) * 5
  local token, rid, reply, ak, data = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local ridkey = KEYS[1 + i]
  local held = redis.pcall('GET', ridkey)
  if held then
    if type(held) == 'table' and held.err then
      out[i] = {3, ridkey .. ': ' .. held.err}
    else
      local sep = string.find(held, ' ', 1, true)  -- '<token> <entry id>'; anything else is someone else's
      if sep and string.sub(held, 1, sep - 1) == token then
        out[i] = {2, string.sub(held, sep + 1)}
      else
        out[i] = {0, sep and string.sub(held, 1, sep - 1) or held}
      end
    end
  else
    local id
    -- The usual shapes (a reply stream or none, no affinity key) build no table.
    if ak == '' and reply ~= '' then
      id = redis.pcall('XADD', stream, '*', 'rid', rid, 'reply_to', reply, 'data', data)
    elseif ak == '' then
      id = redis.pcall('XADD', stream, '*', 'rid', rid, 'data', data)
    else
      local entry = {'XADD', stream, '*', 'rid', rid}
      if reply ~= '' then
        entry[#entry + 1] = 'reply_to'
        entry[#entry + 1] = reply
      end
      if ak ~= '' then
        entry[#entry + 1] = 'ak'
        entry[#entry + 1] = ak
      end
      entry[#entry + 1] = 'data'
      entry[#entry + 1] = data
      id = redis.pcall(unpack(entry))
    end
    if type(id) == 'table' and id.err then
      out[i] = {3, stream .. ': ' .. id.err}
    else
      redis.call('SET', ridkey, token .. ' ' .. id, 'EX', ttl)
      out[i] = {1, id}
    end
  end
end
return out
