-- Append the next part of many requests' partial output to their checkpoints, fenced, in one call:
-- a worker's saves of one tick (the streamed chunks and the checkpoints of every request it runs
-- in one hash tag). All or nothing per item; one item's refusal never changes another item's fate.
-- KEYS[1..S] the request streams the items' entries are in, then per item i (1-based) four keys:
-- KEYS[S+4i-3] its checkpoint ({tag}:partial:<request_id>), KEYS[S+4i-2] its event log,
-- KEYS[S+4i-1] a streamed request's chunk stream ({tag}:chunks:<producer>, one per producer: the
-- checkpoint key again when not streamed), KEYS[S+4i] the ownership hash of the producer whose
-- reply stream the request names (the checkpoint key again when not streamed).
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] S  ARGV[4] the checkpoints' TTL (s)  ARGV[5] the chunk
-- streams' TTL (s)  ARGV[6] the event log's cap in bytes ('0' = off)  ARGV[7] its TTL, then per
-- request stream two values: the first and the last entry id of the items in it, then per item 9
-- values: the index of its request stream in KEYS (1..S), its entry id, the tokens its writer has
-- saved so far, the tokens in this part, the part (8 hex digits of length + one MessagePack map),
-- its chunk's field ('<request_id> <tokens saved so far> <tokens in this part>': the request_id
-- first), the entry as its submit noted it ('<stream> <entry id>'), flags ('c': streamed,
-- 'o': check the producer's ownership hash, 't': the chunk stream's TTL is set again, 'l': logged in
-- the event log, 'f': the writer's next append to a checkpoint it wrote), and with 'f' the bytes
-- that checkpoint held after the writer's last save.
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
local group, consumer = ARGV[1], ARGV[2]
local S = tonumber(ARGV[3])
local part_ttl, chunk_ttl = ARGV[4], ARGV[5]
local ev_cap, ev_ttl = tonumber(ARGV[6]), ARGV[7]
local B = 7 + 2 * S  -- (the items' values start after this)
local n = (#KEYS - S) / 4
local out = {}

local owned = {}
for s = 1, S do
  local mine = {}
  owned[s] = mine
  local start, hi = ARGV[6 + 2 * s], ARGV[7 + 2 * s]
  while true do
    local p = redis.call('XPENDING', KEYS[s], group, start, hi, '1000', consumer)
    for _, e in ipairs(p) do mine[e[1]] = true end
    if #p < 1000 then break end
    start = '(' .. p[#p][1]
  end
end

-- Each chunk stream's state: its type checked once ('stream' or 'none', else the refusal of its
-- items), the fields of the one entry this call adds to it, and the items whose chunks they are.
local streams, order = {}, {}
local function chunk_stream(key)
  local st = streams[key]
  if st then return st end
  local kind = redis.call('TYPE', key)['ok']
  st = {fields = {}, items = {}, ttl = kind == 'none'}
  if kind ~= 'none' and kind ~= 'stream' then st.refused = 'WRONGTYPE ' .. key .. ' holds a ' .. kind end
  streams[key] = st
  return st
end
-- A streamed item's checkpoint as it was before its write (its length after the write, or the value
-- and TTL it replaced), should its chunk not go in after all.
local grown, replaced = {}, {}

-- The save's event ('l'). One event per delivery's run of checkpoints: a save right after this
-- worker's last one of this entry replaces that line, counting the saves, so long generations push
-- no older event out. (log_event and now_ms: shared/lua/prelude.lua)
local function log_save(s, evkey, entry, total)
  local stream = string.match(KEYS[s], '^{[^}]*}:(.*)$') or KEYS[s]
  local who = '\tcheckpoint\tworker=' .. consumer .. '\tentry=' .. entry .. '\tstream=' .. stream .. '\ttokens='
  local log = redis.pcall('GET', evkey)
  local saves = 1
  if type(log) == 'string' then
    local at = #log - 1
    while at > 0 and string.sub(log, at, at) ~= '\n' do at = at - 1 end
    local last = string.sub(log, at + 1)
    if string.find(last, who, 1, true) then
      saves = (tonumber(string.match(last, '\tsaves=(%d+)')) or 1) + 1
      redis.call('SET', evkey, string.sub(log, 1, at), 'KEEPTTL')  -- (that line goes: this one replaces it)
    end
  end
  log_event(evkey, ev_cap, ev_ttl, now_ms() .. who .. total .. '\tsaves=' .. saves)
end

-- One item: its outcome's two values.
local function save(i)
  local a = B + (i - 1) * 9
  local s, entry = tonumber(ARGV[a + 1]), ARGV[a + 2]
  if not owned[s][entry] then return 0, 'fenced' end
  local saved, add, part = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5]
  local flags = ARGV[a + 8]
  local k = S + 4 * (i - 1)
  local partial = KEYS[k + 1]
  local st
  if string.find(flags, 'c', 1, true) then
    st = chunk_stream(KEYS[k + 3])
    if st.refused then return 2, st.refused end
    if string.find(flags, 'o', 1, true)
        and redis.pcall('HGET', KEYS[k + 4], string.match(ARGV[a + 6], '^%S+')) ~= ARGV[a + 7] then
      return 2, 'ownership check failed: ' .. KEYS[k + 4] .. ' does not name this entry'
    end
  end
  local header = string.format('%-44s %018d\n', entry, saved + add)
  local length
  if string.find(flags, 'f', 1, true) then
    -- The writer's next save of a checkpoint it wrote: it knows the bytes that checkpoint holds, so
    -- the append itself is the check (another writer's parts, another entry's checkpoint, a deleted
    -- one: another length), undone when it fails.
    local was = tonumber(ARGV[a + 9])
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
    redis.call('SETRANGE', partial, 0, header)
  else
    -- (a key of another type answers WRONGTYPE: nothing of the item is written)
    local head = redis.pcall('GETRANGE', partial, 0, 63)
    if type(head) == 'table' then return 2, head.err .. ' (' .. partial .. ')' end
    local same = #head == 64 and string.sub(head, 1, #entry + 1) == entry .. ' '
    if same then
      if tonumber(string.sub(head, 46, 63)) ~= saved then return 0, 'stale' end
      length = redis.call('APPEND', partial, part)
      redis.call('SETRANGE', partial, 0, header)
    elseif saved ~= 0 then
      return 0, 'stale'  -- (no checkpoint of this entry, and the writer thinks it saved some)
    else
      if #head > 0 and st then replaced[i] = {redis.call('GET', partial), redis.call('PTTL', partial)} end
      redis.call('SET', partial, header .. part, 'EX', part_ttl)
    end
  end
  if st then
    local f = st.fields
    if #f == 0 then order[#order + 1] = KEYS[k + 3] end
    f[#f + 1] = ARGV[a + 6]
    f[#f + 1] = part
    if string.find(flags, 't', 1, true) then st.ttl = true end
    st.items[#st.items + 1] = i
    grown[i] = length
  elseif ev_cap > 0 and string.find(flags, 'l', 1, true) then
    log_save(s, KEYS[k + 2], entry, saved + add)
  end
  return 1, saved + add
end

for i = 1, n do
  out[2 * i - 1], out[2 * i] = save(i)
end
if #order > 0 then
  local t = redis.call('TIME')
  local oldest = (tonumber(t[1]) - tonumber(chunk_ttl)) * 1000
  for _, key in ipairs(order) do
    local st = streams[key]
    local added = redis.pcall('XADD', key, 'MINID', '~', string.format('%d', oldest > 0 and oldest or 0), '*',
                              unpack(st.fields))
    for _, i in ipairs(st.items) do
      local a, k = B + (i - 1) * 9, S + 4 * (i - 1)
      if type(added) == 'table' then
        -- (a stream whose ids are exhausted: each of its items' checkpoints goes back to what it was)
        local partial, length, was = KEYS[k + 1], grown[i], replaced[i]
        if length then
          local rest = redis.call('GETRANGE', partial, 64, length - #ARGV[a + 5] - 1)
          redis.call('SET', partial, string.format('%-44s %018d\n', ARGV[a + 2], ARGV[a + 3]) .. rest, 'KEEPTTL')
        elseif was and was[2] > 0 then
          redis.call('SET', partial, was[1], 'PX', was[2])
        elseif was then
          redis.call('SET', partial, was[1])
        else
          redis.call('DEL', partial)
        end
        out[2 * i - 1], out[2 * i] = 2, added.err .. ' (' .. key .. ')'
      elseif ev_cap > 0 and string.find(ARGV[a + 8], 'l', 1, true) then
        log_save(tonumber(ARGV[a + 1]), KEYS[k + 2], ARGV[a + 2], out[2 * i])
      end
    end
    if type(added) ~= 'table' and st.ttl then redis.call('EXPIRE', key, chunk_ttl) end
  end
end
return out
