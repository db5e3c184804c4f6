-- Append the next part of a resumable request's partial output to its checkpoint, fenced.
-- KEYS[1] request stream, KEYS[2] checkpoint key ({tag}:partial:<request_id>)
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] entry id  ARGV[4] tokens the writer has saved so far
-- ARGV[5] tokens in this part  ARGV[6] the part (one MessagePack map)  ARGV[7] TTL in seconds
-- KEYS[3] the request's event log, ARGV[8] its cap in bytes ('0' = off), ARGV[9] its TTL
-- KEYS[4] a streamed request's chunk stream ({tag}:chunks:<producer>}<request_id>), ARGV[10] its TTL in
-- seconds ('0': not streamed, KEYS[4] unused), ARGV[11] the request_id. A streamed request's part is also
-- its next chunk: one XADD of 'rid <request_id> offset <tokens before it> tokens <in it> data <the part>',
-- in this same call, so what a reader was sent is exactly what was saved. A checkpoint that starts over
-- (another entry of this request_id) deletes the chunks of the earlier one first. KEYS[5] the
-- ownership hash of the producer whose reply stream the request names, ARGV[12] the entry as its
-- submit noted it ('<stream> <entry id>'): a chunk goes into a producer's chunk stream only for an
-- entry that producer submitted (else {2, 'ownership check failed ...'}, nothing written).
-- The checkpoint is a string: a 64-byte header '<entry id, space-padded to 44> <18-digit token
-- count>\n', then the parts, each one MessagePack map, in order. Appending costs one APPEND and
-- one SETRANGE of the header, however long the output already is.
-- Returns {1, tokens saved} | {0, 'fenced'} (this consumer no longer owns the entry) |
-- {0, 'stale'} (the checkpoint holds another count: another writer) | {2, error} (refused: nothing
-- written). All or nothing: every check comes before the first write.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return {0, 'fenced'} end
local saved, add = tonumber(ARGV[4]), tonumber(ARGV[5])
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'none' and kind ~= 'string' then return {2, 'WRONGTYPE ' .. KEYS[2] .. ' holds a ' .. kind} end
local chunked = ARGV[10] ~= nil and ARGV[10] ~= '0'
if chunked then
  local ckind = redis.call('TYPE', KEYS[4])['ok']
  if ckind ~= 'none' and ckind ~= 'stream' then return {2, 'WRONGTYPE ' .. KEYS[4] .. ' holds a ' .. ckind} end
  if redis.pcall('HGET', KEYS[5], ARGV[11]) ~= ARGV[12] then
    return {2, 'ownership check failed: ' .. KEYS[5] .. ' does not name this entry'}
  end
end
local entry, count
if kind == 'string' then
  local head = redis.call('GETRANGE', KEYS[2], 0, 63)
  if #head == 64 then
    entry = string.match(string.sub(head, 1, 44), '^(%S+)')
    count = tonumber(string.sub(head, 46, 63))
  end
end
local header = string.format('%-44s %018d\n', ARGV[3], saved + add)
local written
if entry == ARGV[3] then
  if count ~= saved then return {0, 'stale'} end
  written = redis.pcall('APPEND', KEYS[2], ARGV[6])
  if type(written) == 'table' and written.err then return {2, written.err} end
  redis.call('SETRANGE', KEYS[2], 0, header)
else
  -- No checkpoint, or one of an earlier entry of this request_id (a requeue, a resubmit): start over.
  if saved ~= 0 then return {0, 'stale'} end
  written = redis.pcall('SET', KEYS[2], header .. ARGV[6])
  if type(written) == 'table' and written.err then return {2, written.err} end
  if chunked then redis.call('DEL', KEYS[4]) end
end
redis.call('EXPIRE', KEYS[2], ARGV[7])
if chunked then
  redis.call('XADD', KEYS[4], '*', 'rid', ARGV[11], 'offset', saved, 'tokens', add, 'data', ARGV[6])
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
if ARGV[8] ~= '0' then
  -- (log_event and now_ms: shared/lua/prelude.lua)
  -- One event per delivery's run of checkpoints: a save right after this worker's last one of
  -- this entry replaces that line, counting the saves, so long generations push no older event out.
  local stream = string.match(KEYS[1], '^{[^}]*}:(.*)$') or KEYS[1]
  local who = '\tcheckpoint\tworker=' .. ARGV[2] .. '\tentry=' .. ARGV[3] .. '\tstream=' .. stream .. '\ttokens='
  local log = redis.pcall('GET', KEYS[3])
  local saves = 1
  if type(log) == 'string' then
    local start = #log - 1
    while start > 0 and string.sub(log, start, start) ~= '\n' do start = start - 1 end
    local last = string.sub(log, start + 1)
    local at = string.find(last, who, 1, true)
    if at then
      saves = (tonumber(string.match(last, '\tsaves=(%d+)')) or 1) + 1
      log = string.sub(log, 1, start)  -- (that line goes: this one replaces it)
      redis.call('SET', KEYS[3], log, 'KEEPTTL')
    end
  end
  log_event(KEYS[3], tonumber(ARGV[8]), ARGV[9], now_ms() .. who .. (saved + add) .. '\tsaves=' .. saves)
end
return {1, saved + add}
