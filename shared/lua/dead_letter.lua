-- Dead-letter one pending entry, owner-checked, and tell its waiter.
-- KEYS[1] source stream  KEYS[2] dead stream  KEYS[3..] optional: reply stream, rid key, and after
-- the rid key the request's checkpoint key (deleted when it names this entry); the last key: the
-- request's event log ({tag}:events:<rid>)
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] entry id  ARGV[4] reason  ARGV[5] source name
-- ARGV[6] delete the entry after ack (1/0)   ARGV[7] index of the reply key in KEYS (0 = none)
-- ARGV[8] index of the rid key in KEYS (0 = none)
-- ARGV[9..12] error record: rid, status, worker, data (used when a reply key is given)
-- ARGV[13] delivery count   ARGV[14] why the waiter's reply stream cannot be used ('' = it can)
-- ARGV[15] number of original field pairs, then the pairs, then the event log's cap in bytes
-- ('0' = off) and TTL, then the index in KEYS of the ownership hash of the producer whose reply
-- stream takes the error record (0 = none): its field for this entry becomes a finished mark, as
-- finish_many.lua leaves, when the record went out and the rid key named this entry; else it goes
-- Returns {code, message}: {1, ''} dead-lettered (and the error record sent, when asked);
-- {1, error} dead-lettered, but the reply stream refused the error record: the dead letter then
-- carries a field reply_error (a waiting producer learns of its request from it);
-- {0, ''} this consumer no longer owns the entry; {-1, error} the dead stream refused the letter:
-- nothing was written, the entry stays pending.
--
-- All or nothing (Redis keeps the writes a script made before a failing redis.call): the reads
-- come first; the two XADDs go through pcall; when the dead letter is refused, the error record
-- just added is deleted again before returning. Out of memory and a read-only replica refuse the
-- first write, so then nothing is written at all. (A reply stream that the deleted record had
-- created stays, empty and without a TTL: gc deletes it, like one re-created after it expired.)
-- A call dead-letters an entry at most once.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  return {0, ''}
end
local rid_idx = tonumber(ARGV[8])
local held = false
if rid_idx > 0 then
  held = redis.pcall('GET', KEYS[rid_idx])
end
local reply_err = ARGV[14]
local sent = false
local reply_idx = tonumber(ARGV[7])
if reply_idx > 0 and reply_err == '' then
  sent = redis.pcall('XADD', KEYS[reply_idx], '*', 'rid', ARGV[9], 'status', ARGV[10], 'worker', ARGV[11],
                     'data', ARGV[12])
  if type(sent) == 'table' and sent.err then
    reply_err = KEYS[reply_idx] .. ': ' .. sent.err
    sent = false
  end
end
local entry = {'reason', ARGV[4], 'source', ARGV[5], 'entry', ARGV[3], 'deliveries', ARGV[13]}
if reply_err ~= '' then
  table.insert(entry, 'reply_error')
  table.insert(entry, reply_err)
end
local npairs = tonumber(ARGV[15])
for i = 0, npairs - 1 do
  local k = ARGV[16 + 2 * i]
  if k ~= 'reason' and k ~= 'source' and k ~= 'entry' and k ~= 'deliveries' and k ~= 'reply_error' then
    table.insert(entry, k)
    table.insert(entry, ARGV[17 + 2 * i])
  end
end
local added = redis.pcall('XADD', KEYS[2], '*', unpack(entry))
if type(added) == 'table' and added.err then
  if sent then
    redis.call('XDEL', KEYS[reply_idx], sent)
  end
  return {-1, added.err}
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[6] == '1' then
  redis.call('XDEL', KEYS[1], ARGV[3])
end
local here = (string.match(KEYS[1], '^{[^}]*}:(.*)$') or KEYS[1]) .. ' ' .. ARGV[3]  -- (see submit_many.lua)
local ours = type(held) == 'string' and string.sub(held, -string.len(here) - 1) == ' ' .. here
if ours then
  redis.call('DEL', KEYS[rid_idx])
end
local own_idx = tonumber(ARGV[18 + 2 * npairs])
if own_idx > 0 and redis.pcall('HGET', KEYS[own_idx], ARGV[9]) == here then
  settle_owner_field(KEYS[own_idx], ARGV[9], sent, ours and held)  -- (shared/lua/prelude.lua)
end
if rid_idx > 0 and #KEYS > rid_idx + 1 then
  local head = redis.pcall('GETRANGE', KEYS[rid_idx + 1], 0, 43)
  if type(head) == 'string' and string.match(head, '^(%S+)') == ARGV[3] then redis.call('DEL', KEYS[rid_idx + 1]) end
end
local ev_cap = tonumber(ARGV[16 + 2 * npairs])
if ev_cap > 0 then
  -- (log_event and now_ms: shared/lua/prelude.lua)
  log_event(KEYS[#KEYS], ev_cap, ARGV[17 + 2 * npairs],
            now_ms() .. '\tdead\tentry=' .. ARGV[3] .. '\tstream=' .. (string.match(KEYS[1], '^{[^}]*}:(.*)$') or KEYS[1]) ..
            '\tsource=' .. ARGV[5] .. '\tdeliveries=' .. ARGV[13] ..
            '\tby=' .. ARGV[2] .. '\treason=' .. string.gsub(ARGV[4], '[\t\n]', ' '))
end
return {1, reply_err}
