-- De-duplicated submit of many requests to one stream in one call, atomically with each XADD.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, SUBMIT_MANY):
-- stream: the request stream; ttl: the ownership hashes' TTL in seconds; n items, item i's:
-- item.rid_key[i] its rid key, item.own_key[i] the ownership hash of the producer whose reply
-- stream reply_to is ({tag}:own:<producer>; the rid key again when reply_to is none or a results
-- stream: then nothing is written there), item.reply_key[i] that reply stream (the rid key again
-- likewise), item.token[i], item.rid[i] its request_id, item.reply_to[i] ('' = none), item.ak[i]
-- its affinity key ('' = none: the plain field ak), item.data[i]
-- The rid key holds '<token> <stream> <entry id>' and the ownership field '<stream> <entry id>'
-- (<stream>: the request stream's name after its hash tag, e.g. requests:high): entry ids are per
-- stream, so an entry forged on another request stream with the same id is not the one submitted.
-- The rid key is created with SETNX and no TTL: a producer may create rid keys but never overwrite,
-- expire or delete one (another producer's live request_id cannot be freed and taken over); the
-- finish, a dead letter or housekeeping (release_rids) deletes it.
-- An added request with an ownership hash gets its field request_id = entry id there (the hash's
-- TTL renewed once per call): the worker publishes to a producer's reply stream only what that hash names.
-- A request that finished leaves 'done <record id> <what its rid key held>' in its ownership field
-- until its producer acks the record (finish_many.lua, ack_replies.lua): a submit of the same token
-- meanwhile, its record still on the reply stream, is that submit's retry (a restarted producer
-- with tokens made from its request_ids; a retry after a lost reply) and is not queued again.
-- Returns per item {code, value}: {1, entry_id} added, {2, entry_id} a retry of this token (it was
-- added before; it may have finished since), {0, holder_token} refused (another submit holds the request_id), {3, error} the
-- request stream or the rid key refused it (out of memory, a read-only replica, a key of another
-- type): nothing of that item was written.
-- All or nothing per item: its reads come first, its first write (the XADD) goes through pcall,
-- and the SETNX (the key was read absent just before) and HSET (its key's type was checked) that
-- follow a successful XADD cannot fail. One item never changes another's fate.
local out = {}
local sname = string.match(stream, '^{[^}]*}:(.*)$') or stream
local owners = {}  -- ownership hash -> its type, looked up once per call; 'written' once a field went in
-- The entry a finished mark in ``ownkey`` names when it is this token's and its record is still on
-- ``replykey`` (not acked yet); else nil.
local function finished_retry(ownkey, replykey, rid, token)
  local mark = redis.call('HGET', ownkey, rid)
  local rec, prior, entry = string.match(mark or '', '^done (%S+) (%S+) %S+ (%S+)$')
  if not rec or prior ~= token then return nil end
  local there = redis.pcall('XRANGE', replykey, rec, rec)
  if type(there) == 'table' and not there.err and #there > 0 then return entry end
  return nil
end

for i = 1, n do
  local token, rid, reply, ak, data = item.token[i], item.rid[i], item.reply_to[i], item.ak[i], item.data[i]
  local ridkey, ownkey, replykey = item.rid_key[i], item.own_key[i], item.reply_key[i]
  local held = redis.pcall('GET', ridkey)
  local owntype = 'none'
  if ownkey ~= ridkey then
    owntype = owners[ownkey] or redis.call('TYPE', ownkey)['ok']
    owners[ownkey] = owntype
  end
  local retried = nil
  if not held and (owntype == 'hash' or owntype == 'written') and replykey ~= ridkey then
    retried = finished_retry(ownkey, replykey, rid, token)
  end
  if owntype ~= 'none' and owntype ~= 'hash' and owntype ~= 'written' then
    out[i] = {3, ownkey .. ': WRONGTYPE Operation against a key holding the wrong kind of value'}
  elseif retried then
    out[i] = {2, retried}
  elseif held then
    if type(held) == 'table' and held.err then
      out[i] = {3, ridkey .. ': ' .. held.err}
    else
      local sep = string.find(held, ' ', 1, true)  -- '<token> <stream> <entry id>'; else someone else's
      if sep and string.sub(held, 1, sep - 1) == token then
        out[i] = {2, string.match(held, '(%S+)$')}
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
      redis.call('SETNX', ridkey, token .. ' ' .. sname .. ' ' .. id)
      if ownkey ~= ridkey then
        redis.call('HSET', ownkey, rid, sname .. ' ' .. id)
        owners[ownkey] = 'written'
      end
      out[i] = {1, id}
    end
  end
end
for ownkey, state in pairs(owners) do
  if state == 'written' then redis.call('EXPIRE', ownkey, ttl) end
end
return out
