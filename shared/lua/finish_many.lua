-- Fenced finish of many requests of one stream in one call.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, FINISH_MANY):
-- stream: the request stream; marker: this consumer's finish marker ({tag}:finished:<consumer>, a
-- list); group; consumer; worker; marker_ttl (ms); marker_cap; ev_cap: the event log's cap in bytes
-- ('0' = off; negative: the finish only adds to a log that exists, one an incident began); ev_ttl:
-- its TTL; n items, item i's: item.reply_key[i] its reply stream, item.rid_key[i],
-- item.partial_key[i] its checkpoint key ({tag}:partial:<rid>), item.own_key[i] the ownership hash
-- of the producer whose reply stream it is ({tag}:own:<producer>; the rid key again for a results
-- stream), item.events_key[i] its event log ({tag}:events:<rid>), item.entry[i] its entry id,
-- item.rid[i], item.status[i], item.data[i] (msgpack), item.cap[i] the reply MAXLEN cap ('0' =
-- none), item.resumable[i] '1' when the request is resumable (its checkpoint, if it names this
-- entry, is deleted too), item.summary[i] the record's summary for the event log ('' with only
-- incidents logged: the worker knows of no incident of the request, so no log is looked for)
-- Returns one value per item: 1 published, 2 published by an earlier call of this consumer (a
-- retried finish whose first reply was lost: nothing is written again), 0 fenced (this consumer no
-- longer owns the entry and did not finish it, or the entry came earlier in this call), 3 refused:
-- the rid key names another entry (another submit holds this request_id), 4 refused: the producer's
-- ownership hash does not name this entry (it was not submitted by the producer whose reply
-- stream it names) — nothing of a refused item is written, it stays pending for the worker to
-- dead-letter — or the
-- error the reply stream answered (a string: nothing of that item was written; it stays pending for
-- the worker to dead-letter, hold or retry).
--
-- All or nothing per item: Redis keeps the writes a script made before a failing redis.call, so
-- an item's reads come first and its first write, the XADD, goes through pcall; its ack, delete
-- and rid release follow only once that XADD succeeded (and cannot fail: the request stream and
-- group were read above). One item's refusal never changes another item's fate.
--
-- The finish marker: every published entry is appended to `marker` as '<entry id> <stream>' (the
-- stream named after its hash tag), the list trimmed to its last marker_cap elements and its TTL set
-- to marker_ttl ms, after the acks (a key of another type found at the start is left alone: no marker
-- then). An entry this consumer no longer owns is looked up there, so a retry of a finish whose
-- reply was lost tells its own earlier success from a lost lease.
-- (log_event, now_ms and settle_owner_field: shared/lua/prelude.lua)
local out = {}
local done = {}
local ev_any = ev_cap > 0
if ev_cap < 0 then ev_cap = -ev_cap end
local sname = string.match(stream, '^{[^}]*}:(.*)$') or stream
local marked = nil  -- (this consumer's finished entries, read once, when an item is not owned)
local mtype = redis.call('TYPE', marker)['ok']
local use_marker = mtype == 'none' or mtype == 'list'

-- Which of the entries this consumer still owns: one XPENDING over the batch's id range, filtered
-- by consumer (its own pending entries there: at most what it has in flight), instead of one call
-- per item.
local less = entry_id_less
local lo, hi
for i = 1, n do
  local entry = item.entry[i]
  if not lo or less(entry, lo) then lo = entry end
  if not hi or less(hi, entry) then hi = entry end
end
local owned = {}
local start = lo
while n > 0 do
  local p = redis.call('XPENDING', stream, group, start, hi, '1000', consumer)
  for _, e in ipairs(p) do owned[e[1]] = true end
  if #p < 1000 then break end
  start = '(' .. p[#p][1]
end

for i = 1, n do
  local entry = item.entry[i]
  if not owned[entry] then
    if use_marker and marked == nil then
      marked = {}
      for _, e in ipairs(redis.call('LRANGE', marker, 0, -1)) do marked[e] = true end
    end
    if marked and marked[entry .. ' ' .. sname] then
      out[i] = 2
    else
      out[i] = 0
      if ev_cap > 0 then  -- (a lost lease is an incident: it begins a log)
        log_event(item.events_key[i], ev_cap, ev_ttl,
                  now_ms() .. '\tfenced\tworker=' .. worker .. '\tentry=' .. entry .. '\tstream=' .. sname)
      end
    end
  else
    owned[entry] = nil  -- (an entry listed twice is published once)
    local reply, ridkey, partial, ownkey = item.reply_key[i], item.rid_key[i], item.partial_key[i], item.own_key[i]
    local rid, status, data = item.rid[i], item.status[i], item.data[i]
    local held = redis.pcall('GET', ridkey)  -- (a rid key of another type is not ours to delete)
    -- The ownership checks: the request_id is this entry's, and so is the reply stream.
    local check = 0
    -- (entry ids are per stream: the stream is part of what the submit wrote, see submit_many.lua)
    local here = sname .. ' ' .. entry
    if type(held) == 'string' and string.sub(held, -string.len(here) - 1) ~= ' ' .. here then
      check = 3
    elseif ownkey ~= ridkey and redis.pcall('HGET', ownkey, rid) ~= here then
      check = 4
    end
    -- The cap goes to XADD as the string it came as: a Lua number would be formatted back with
    -- printf for every item.
    local cap = item.cap[i]
    local added
    if check ~= 0 then
      added = check
    elseif cap ~= '0' then
      added = redis.pcall('XADD', reply, 'MAXLEN', '~', cap, '*', 'rid', rid, 'status', status,
                          'worker', worker, 'data', data)
    else
      added = redis.pcall('XADD', reply, '*', 'rid', rid, 'status', status, 'worker', worker,
                          'data', data)
    end
    if type(added) == 'table' and added.err then
      out[i] = added.err
    elseif check ~= 0 then
      out[i] = check
    else
      -- Release the submit de-duplication key only if it still names this entry; its producer's
      -- ownership field becomes a finished mark, 'done <record id> <what the rid key held>', until
      -- the producer acks the record (ack_replies.lua): a retry of that submit's token meanwhile is
      -- told the request was taken, not queued again (submit_many.lua).
      local ours = type(held) == 'string' and string.sub(held, -string.len(entry) - 1) == ' ' .. entry
      if ownkey ~= ridkey then settle_owner_field(ownkey, rid, added, ours and held) end
      done[#done + 1] = entry
      if ours then redis.call('DEL', ridkey) end
      if item.resumable[i] == '1' then
        local head = redis.pcall('GETRANGE', partial, 0, 43)
        if type(head) == 'string' and string.match(head, '^(%S+)') == entry then redis.call('DEL', partial) end
      end
      -- (with only incidents logged: an item whose summary is empty had none the worker knows of, so
      -- it has no log to look for: a first delivery, never taken back or checkpointed)
      local summary = item.summary[i]
      if ev_cap > 0 and (ev_any or (summary ~= '' and redis.call('EXISTS', item.events_key[i]) == 1)) then
        log_event(item.events_key[i], ev_cap, ev_ttl,
                  string.match(added, '^%d+') .. '\tfinished\tworker=' .. worker .. '\tentry=' .. entry .. '\tstream=' .. sname ..
                  '\tstatus=' .. status .. '\treply=' .. reply .. '\trec=' .. added ..
                  '\tsummary=' .. summary)
      end
      out[i] = 1
    end
  end
end
-- Ack and delete every published entry at once (still inside this one atomic script).
for j = 1, #done, 4000 do
  local chunk = {unpack(done, j, math.min(j + 3999, #done))}
  redis.call('XACK', stream, group, unpack(chunk))
  redis.call('XDEL', stream, unpack(chunk))
end
-- Who finished what, for a retry of this call (after the first writes: it cannot be refused now).
if use_marker and #done > 0 then
  for j = 1, #done, 4000 do
    local chunk = {}
    for k = j, math.min(j + 3999, #done) do chunk[#chunk + 1] = done[k] .. ' ' .. sname end
    redis.call('RPUSH', marker, unpack(chunk))
  end
  redis.call('LTRIM', marker, -marker_cap, -1)
  redis.call('PEXPIRE', marker, marker_ttl)
end
return out
