-- Append the next part of many requests' partial output to their checkpoints, fenced, in one call:
-- a worker's saves of one tick (the streamed chunks and the checkpoints of every request it runs
-- in one hash tag). All or nothing per item; one item's refusal never changes another item's fate.
-- Keys and args by name (their places: shared/function_layouts.py, CHECKPOINT_MANY):
--   streams  the request streams the saves' entries are in; lease_from, lease_to: per stream, the
--            first and last entry id of its saves (the lease range read there)
--   group, consumer  the workers' group and this worker; part_ttl the checkpoints' TTL (s);
--            chunk_ttl the chunk streams' TTL (s); ev_cap the event log's cap in bytes (0 = off),
--            ev_ttl its TTL
--   per save i (1..n): save.partial[i] its checkpoint ({tag}:partial:<request_id>), save.evkey[i]
--            its event log, save.chunks[i] a streamed request's producer's chunk stream
--            ({tag}:chunks:<producer>; the checkpoint key again when not streamed), save.ownkey[i]
--            the ownership hash of that producer (likewise), save.stream_at[i] its stream's place
--            in streams, save.entry[i] its entry id, save.saved[i] the tokens its writer has saved
--            so far, save.count[i] the tokens saved with this part (18 digits, as the header holds
--            it), save.part[i] the part (8 hex digits of
--            length + one MessagePack map), save.field[i] its chunk's field ('<request_id> <tokens
--            saved so far> <tokens in this part>': the request_id first), save.submitted[i] the
--            entry as its submit noted it ('<stream> <entry id>'), save.flags[i] ('c': streamed,
--            'o': check the producer's ownership hash, 't': the chunk stream's TTL is set again,
--            'l': logged in the event log, 'f': the writer's next append to a checkpoint it wrote),
--            save.length[i] with 'f': the bytes that checkpoint held after the writer's last save,
--            save.event[i] with 'l': its event line after the time (see log_save below),
--            save.prior[i] the parts of its request saved since the checkpoint's last consolidation
--            (save_parts.lua), appended before this save's part ('' when none; 'count' counts them too;
--            a streamed request's chunk is only save.part[i], its readers have the prior parts).
-- Returns two values per item: {1, tokens saved} | {0, 'fenced'} (this consumer no longer owns the
-- entry) | {0, 'stale'} (the checkpoint holds another count: another writer) | {2, error}
-- (refused: nothing of that item written).
--
-- The checkpoint is a string: a 64-byte header '<entry id, space-padded to 44> <18-digit token
-- count>\n', then the parts in order. Appending costs one APPEND and one SETRANGE of the header,
-- however long the output already is; its TTL is set when it is created (APPEND keeps it). A
-- writer's first save of an entry reads the header first (GETRANGE: the entry and count it must
-- find); its next ones ('f') send the checkpoint's length instead, which the APPEND's answer must
-- match (else the append is undone: 'stale'), so a streamed request's chunk costs two commands.
--
-- A streamed request's part is also its next chunk, sent in this same call, so what a reader was
-- sent is exactly what was saved. The chunks of one call go to each producer's chunk stream as ONE
-- entry: a field '<request_id> <tokens before it> <tokens in it>' and the part as its value, per
-- streamed item saved (one XADD per producer per call, whatever the number of its requests; a
-- reader is woken once per call). The entry trims the stream to the chunk TTL (MINID ~ now - TTL)
-- and the stream's TTL is set when it starts and again when a writer asks ('t': each streamed
-- request's writer does every tenth of the TTL). A chunk goes into a producer's chunk stream only
-- for an entry that producer submitted (its ownership hash names it; else {2, 'ownership check
-- failed ...'}): a writer asks for that check ('o') with its first save of an entry (which,
-- refused, is its last: the hash names an entry from its submit until its record) and any save
-- that starts over. A chunk stream key of another type refuses its items before any write.
--
-- Fencing: which entries this consumer still owns is read once per request stream, one XPENDING
-- over the batch's id range filtered by consumer (its own pending entries there: at most what it
-- has in flight). Per item every check comes before its first write; a checkpoint key of another
-- type is found by the read of it (through pcall), a chunk stream of another type by one TYPE per
-- stream. The chunk entries are added after the items' writes; one that Redis refuses even so (a
-- stream whose ids are exhausted) puts each of its items' checkpoints back as they were and
-- refuses them, and an item's event is logged only once its chunk is in.
local out = {}

local owned = owned_entries(streams, lease_from, lease_to, group, consumer)

-- Each chunk stream's state: its type checked once ('stream' or 'none', else the refusal of its
-- items), the fields of the one entry this call adds to it, and the items whose chunks they are.
local chunk_streams, order = {}, {}
local function chunk_stream(key)
  local st = chunk_streams[key]
  if st then return st end
  local kind = redis.call('TYPE', key)['ok']
  st = {fields = {}, items = {}, ttl = kind == 'none'}
  if kind ~= 'none' and kind ~= 'stream' then st.refused = 'WRONGTYPE ' .. key .. ' holds a ' .. kind end
  chunk_streams[key] = st
  return st
end
-- A streamed item's checkpoint as it was before its write (its length after the write, or the value
-- and TTL it replaced), should its chunk not go in after all.
local grown, replaced = {}, {}

-- The save's event ('l'): save.event[i], the line after its time, made by the writer
-- (shared/events.py checkpoint_event: worker, entry, stream, tokens, its saves of the entry so far,
-- the counts padded to one width). One line per delivery's run of checkpoints: a save whose
-- log ends with this worker's line of this entry writes over that line in place (the same width),
-- so long generations push no older event out and a save reads only the log's last line
-- (STRLEN, GETRANGE), however long the log is. (log_event and now_ms: shared/lua/prelude.lua)
local now
local function log_save(evkey, event)
  now = now or now_ms()
  local width = #now + #event + 1  -- (with its newline)
  local length = redis.pcall('STRLEN', evkey)
  if type(length) == 'number' and length >= width then
    local at, who = length - width, select(2, string.find(event, '\ttokens=', 1, true))  -- (the line up to its counts)
    local last = redis.call('GETRANGE', evkey, at > 0 and at - 1 or 0, at + #now + who - 1)
    if (at == 0 or string.byte(last, 1) == 10) and string.sub(last, -who) == string.sub(event, 1, who) then
      redis.call('SETRANGE', evkey, at, now .. event .. '\n')
      redis.call('EXPIRE', evkey, ev_ttl)
      return
    end
  end
  log_event(evkey, ev_cap, ev_ttl, now .. event)
end

-- Each flags string's flags as a set, read once per distinct string (a call has a few).
local flag_sets = {}
local function flags_of(flags)
  local set = flag_sets[flags]
  if not set then
    set = {}
    for c in string.gmatch(flags, '%a') do set[c] = true end
    flag_sets[flags] = set
  end
  return set
end

-- One item: its outcome's two values.
local function save_one(i)
  local s, entry = save.stream_at[i], save.entry[i]
  if not owned[s][entry] then return 0, 'fenced' end
  local saved, count, part, flags = save.saved[i], save.count[i], save.prior[i] .. save.part[i], flags_of(save.flags[i])
  local partial = save.partial[i]
  local st
  if flags.c then
    st = chunk_stream(save.chunks[i])
    if st.refused then return 2, st.refused end
    if flags.o and redis.pcall('HGET', save.ownkey[i], string.match(save.field[i], '^%S+')) ~= save.submitted[i] then
      return 2, 'ownership check failed: ' .. save.ownkey[i] .. ' does not name this entry'
    end
  end
  local length
  if flags.f then
    -- The writer's next save of a checkpoint it wrote: it knows the bytes that checkpoint holds, so
    -- the append itself is the check (another writer's parts, another entry's checkpoint, a deleted
    -- one: another length), undone when it fails. The header's count is rewritten in place.
    local was = save.length[i]
    length = redis.pcall('APPEND', partial, part)
    if type(length) == 'table' then return 2, length.err .. ' (' .. partial .. ')' end
    if length ~= was + #part then
      if length == #part then
        redis.call('DEL', partial)
      else
        redis.call('SET', partial, redis.call('GETRANGE', partial, 0, length - #part - 1), 'KEEPTTL')
      end
      return 0, 'stale'
    end
    redis.call('SETRANGE', partial, 45, count)
  else
    -- (a key of another type answers WRONGTYPE: nothing of the item is written)
    local head = redis.pcall('GETRANGE', partial, 0, 63)
    if type(head) == 'table' then return 2, head.err .. ' (' .. partial .. ')' end
    local same = #head == 64 and string.sub(head, 1, #entry + 1) == entry .. ' '
    if same then
      if tonumber(string.sub(head, 46, 63)) ~= saved then return 0, 'stale' end
      length = redis.call('APPEND', partial, part)
      redis.call('SETRANGE', partial, 45, count)
    elseif saved ~= 0 then
      return 0, 'stale'  -- (no checkpoint of this entry, and the writer thinks it saved some)
    else
      if #head > 0 and st then replaced[i] = {redis.call('GET', partial), redis.call('PTTL', partial)} end
      redis.call('SET', partial, string.format('%-44s ', entry) .. count .. '\n' .. part, 'EX', part_ttl)
    end
  end
  if st then
    local f = st.fields
    if #f == 0 then order[#order + 1] = save.chunks[i] end
    f[#f + 1] = save.field[i]
    f[#f + 1] = save.part[i]
    if flags.t then st.ttl = true end
    st.items[#st.items + 1] = i
    grown[i] = length
  elseif ev_cap > 0 and flags.l then
    log_save(save.evkey[i], save.event[i])
  end
  return 1, tonumber(count)
end

for i = 1, n do
  out[2 * i - 1], out[2 * i] = save_one(i)
end
if #order > 0 then
  local t = redis.call('TIME')
  local oldest = (tonumber(t[1]) - tonumber(chunk_ttl)) * 1000
  for _, key in ipairs(order) do
    local st = chunk_streams[key]
    local added = redis.pcall('XADD', key, 'MINID', '~', string.format('%d', oldest > 0 and oldest or 0), '*',
                              unpack(st.fields))
    for _, i in ipairs(st.items) do
      if type(added) == 'table' then
        -- (a stream whose ids are exhausted: each of its items' checkpoints goes back to what it was)
        local partial, length, was = save.partial[i], grown[i], replaced[i]
        if length then
          local rest = redis.call('GETRANGE', partial, 64, length - #save.prior[i] - #save.part[i] - 1)
          redis.call('SET', partial, string.format('%-44s %018d\n', save.entry[i], save.saved[i]) .. rest, 'KEEPTTL')
        elseif was and was[2] > 0 then
          redis.call('SET', partial, was[1], 'PX', was[2])
        elseif was then
          redis.call('SET', partial, was[1])
        else
          redis.call('DEL', partial)
        end
        out[2 * i - 1], out[2 * i] = 2, added.err .. ' (' .. key .. ')'
      elseif ev_cap > 0 and flags_of(save.flags[i]).l then
        log_save(save.evkey[i], save.event[i])
      end
    end
    if type(added) ~= 'table' and st.ttl then redis.call('EXPIRE', key, chunk_ttl) end
  end
end
return out
