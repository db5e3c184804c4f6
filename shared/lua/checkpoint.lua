-- Append the next part of a resumable request's partial output to its checkpoint, fenced.
-- KEYS[1] request stream, KEYS[2] checkpoint key ({tag}:partial:<request_id>)
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] entry id  ARGV[4] tokens the writer has saved so far
-- ARGV[5] tokens in this part  ARGV[6] the part (one MessagePack map)  ARGV[7] TTL in seconds
-- KEYS[3] the request's event log, ARGV[8] its cap ('0' = off), ARGV[9] its TTL
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
end
redis.call('EXPIRE', KEYS[2], ARGV[7])
if ARGV[8] ~= '0' then  -- (after the first write; through pcall: the log never fails the checkpoint)
  -- One event per delivery's run of checkpoints: a save right after this worker's last one of this
  -- entry replaces it, counting the saves, so long generations do not push older events out.
  local saves = 1
  local last = redis.pcall('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  if type(last) == 'table' and last[1] then
    local f = last[1][2]
    if f[2] == 'checkpoint' and f[4] == ARGV[2] and f[6] == ARGV[3] then
      saves = (tonumber(f[10]) or 1) + 1
      redis.pcall('XDEL', KEYS[3], last[1][1])
    end
  end
  local logged = redis.pcall('XADD', KEYS[3], 'MAXLEN', ARGV[8], '*', 'ev', 'checkpoint', 'worker', ARGV[2],
                             'entry', ARGV[3], 'tokens', saved + add, 'saves', saves)
  if type(logged) == 'string' then redis.pcall('EXPIRE', KEYS[3], ARGV[9]) end
end
return {1, saved + add}
