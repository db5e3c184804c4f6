-- Dead-letter one pending entry, owner-checked, and tell its waiter.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, DEAD_LETTER):
-- source: the source stream; dead: the dead stream; reply_key: the reply stream (false = none);
-- own_key: the ownership hash of the producer whose reply stream takes the error record (false =
-- none): its field for this entry becomes a finished mark, as finish_many.lua leaves, when the
-- record went out and the rid key named this entry; else it goes; rid_key (false = none);
-- partial_key: the request's checkpoint key, deleted when it names this entry (false = none);
-- events_key: the request's event log ({tag}:events:<rid>);
-- group; consumer; entry: its entry id; reason; source_name; delete_entry: '1' = delete the entry
-- after the ack; rec_rid, rec_status, rec_worker, rec_data: the error record (used with a
-- reply_key); deliveries: the delivery count; reply_refused: why the waiter's reply stream cannot
-- be used ('' = it can); ev_cap: the event log's cap in bytes (0 = off), ev_ttl: its TTL;
-- nfields of the entry's original fields, field.name[i] and field.value[i]
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
local p = redis.call('XPENDING', source, group, entry, entry, 1)
if #p == 0 or p[1][2] ~= consumer then
  return {0, ''}
end
local held = false
if rid_key then
  held = redis.pcall('GET', rid_key)
end
local reply_err = reply_refused
local sent = false
if reply_key and reply_err == '' then
  sent = redis.pcall('XADD', reply_key, '*', 'rid', rec_rid, 'status', rec_status, 'worker', rec_worker,
                     'data', rec_data)
  if type(sent) == 'table' and sent.err then
    reply_err = reply_key .. ': ' .. sent.err
    sent = false
  end
end
local letter = {'reason', reason, 'source', source_name, 'entry', entry, 'deliveries', deliveries}
if reply_err ~= '' then
  table.insert(letter, 'reply_error')
  table.insert(letter, reply_err)
end
for i = 1, nfields do
  local k = field.name[i]
  if k ~= 'reason' and k ~= 'source' and k ~= 'entry' and k ~= 'deliveries' and k ~= 'reply_error' then
    table.insert(letter, k)
    table.insert(letter, field.value[i])
  end
end
local added = redis.pcall('XADD', dead, '*', unpack(letter))
if type(added) == 'table' and added.err then
  if sent then
    redis.call('XDEL', reply_key, sent)
  end
  return {-1, added.err}
end
redis.call('XACK', source, group, entry)
if delete_entry == '1' then
  redis.call('XDEL', source, entry)
end
local here = (string.match(source, '^{[^}]*}:(.*)$') or source) .. ' ' .. entry  -- (see submit_many.lua)
local ours = type(held) == 'string' and string.sub(held, -string.len(here) - 1) == ' ' .. here
if ours then
  redis.call('DEL', rid_key)
end
if own_key and redis.pcall('HGET', own_key, rec_rid) == here then
  settle_owner_field(own_key, rec_rid, sent, ours and held)  -- (shared/lua/prelude.lua)
end
if rid_key and partial_key then
  local head = redis.pcall('GETRANGE', partial_key, 0, 43)
  if type(head) == 'string' and string.match(head, '^(%S+)') == entry then redis.call('DEL', partial_key) end
end
if ev_cap > 0 then
  -- (log_event and now_ms: shared/lua/prelude.lua)
  log_event(events_key, ev_cap, ev_ttl,
            now_ms() .. '\tdead\tentry=' .. entry .. '\tstream=' .. (string.match(source, '^{[^}]*}:(.*)$') or source) ..
            '\tsource=' .. source_name .. '\tdeliveries=' .. deliveries ..
            '\tby=' .. consumer .. '\treason=' .. string.gsub(reason, '[\t\n]', ' '))
end
return {1, reply_err}
