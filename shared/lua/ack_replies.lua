-- A producer acks and deletes records it applied from its reply stream, and takes out the
-- finished marks they leave in its ownership hash (finish_many.lua), in one call.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, ACK_REPLIES):
-- stream: the reply stream; own_key: the producer's ownership hash (the reply stream again: none);
-- group; n records, each record.entry[i] its entry id, record.rid[i] its request_id ('' = unknown)
-- A field is deleted only when it is the mark of that very record ('done <entry id> ...'): a
-- request_id submitted again since keeps its new field.
-- Returns the number of entries acked.
-- All or nothing: the reads come first; XACK, XDEL and HDEL free memory and cannot fail on keys of
-- the types read.
local ids, rids, asked = {}, {}, {}
local hashed = own_key ~= stream and redis.call('TYPE', own_key)['ok'] == 'hash'
for j = 1, n do
  ids[#ids + 1] = record.entry[j]
  if hashed and record.rid[j] ~= '' then
    rids[#rids + 1] = record.rid[j]
    asked[#asked + 1] = record.entry[j]
  end
end
local marks = {}
for j = 1, #rids, 4000 do
  local got = redis.call('HMGET', own_key, unpack(rids, j, math.min(j + 3999, #rids)))
  for k, mark in ipairs(got) do
    local entry = asked[j + k - 1]
    if mark and string.sub(mark, 1, 6 + #entry) == 'done ' .. entry .. ' ' then marks[#marks + 1] = rids[j + k - 1] end
  end
end
local acked = 0
for j = 1, #ids, 4000 do
  local chunk = {unpack(ids, j, math.min(j + 3999, #ids))}
  acked = acked + redis.call('XACK', stream, group, unpack(chunk))
  redis.call('XDEL', stream, unpack(chunk))
end
for j = 1, #marks, 4000 do
  redis.call('HDEL', own_key, unpack(marks, j, math.min(j + 3999, #marks)))
end
return acked
