-- A producer acks and deletes records it applied from its reply stream, and takes out the
-- finished marks they leave in its ownership hash (finish_many.lua), in one call.
-- KEYS[1] the reply stream, KEYS[2] the producer's ownership hash (the reply stream again: none)
-- ARGV[1] the group, then per record 2 values: its entry id, its request_id ('' = unknown)
-- A field is deleted only when it is the mark of that very record ('done <entry id> ...'): a
-- request_id submitted again since keeps its new field.
-- Returns the number of entries acked.
-- All or nothing: the reads come first; XACK, XDEL and HDEL free memory and cannot fail on keys of
-- the types read.
local ids, rids, asked = {}, {}, {}
local hashed = KEYS[2] ~= KEYS[1] and redis.call('TYPE', KEYS[2])['ok'] == 'hash'
for j = 2, #ARGV, 2 do
  ids[#ids + 1] = ARGV[j]
  if hashed and ARGV[j + 1] ~= '' then
    rids[#rids + 1] = ARGV[j + 1]
    asked[#asked + 1] = ARGV[j]
  end
end
local marks = {}
for j = 1, #rids, 4000 do
  local got = redis.call('HMGET', KEYS[2], unpack(rids, j, math.min(j + 3999, #rids)))
  for k, mark in ipairs(got) do
    local entry = asked[j + k - 1]
    if mark and string.sub(mark, 1, 6 + #entry) == 'done ' .. entry .. ' ' then marks[#marks + 1] = rids[j + k - 1] end
  end
end
local acked = 0
for j = 1, #ids, 4000 do
  local chunk = {unpack(ids, j, math.min(j + 3999, #ids))}
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(chunk))
  redis.call('XDEL', KEYS[1], unpack(chunk))
end
for j = 1, #marks, 4000 do
  redis.call('HDEL', KEYS[2], unpack(marks, j, math.min(j + 3999, #marks)))
end
return acked
