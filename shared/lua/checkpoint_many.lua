-- Append the next part of many requests' partial output to their checkpoints, fenced, in one call:
-- a worker's saves of one tick (the streamed chunks and the checkpoints of every request it runs
-- in one hash tag). All or nothing per item; one item's refusal never changes another item's fate.
-- KEYS[1..S] the request streams the items' entries are in, then per item i (1-based) four keys:
-- KEYS[S+4i-3] its checkpoint ({tag}:partial:<request_id>), KEYS[S+4i-2] its event log,
-- KEYS[S+4i-1] a streamed request's chunk stream ({tag}:chunks:<producer>}<request_id>; the
-- checkpoint key again when not streamed), KEYS[S+4i] the ownership hash of the producer whose
-- reply stream the request names (the checkpoint key again when not streamed).
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] S  ARGV[4] the checkpoints' TTL (s)  ARGV[5] the chunk
-- streams' TTL (s)  ARGV[6] the event log's cap in bytes ('0' = off)  ARGV[7] its TTL, then per item
-- 8 values: the index of its request stream in KEYS (1..S), its entry id, the tokens its writer has
-- saved so far, the tokens in this part, the part (8 hex digits of length + one MessagePack map),
-- its request_id, the entry as its submit noted it ('<stream> <entry id>'), flags ('c': streamed,
-- 'o': check the producer's ownership hash, 't': the chunk stream's TTL is set again, 'l': logged in
-- the event log).
-- Returns two values per item: {1, tokens saved} | {0, 'fenced'} (this consumer no longer owns the
-- entry) | {0, 'stale'} (the checkpoint holds another count: another writer) | {2, error}
-- (refused: nothing of that item written).
--
-- The checkpoint is a string: a 64-byte header '<entry id, space-padded to 44> <18-digit token
-- count>\n', then the parts in order. Appending costs one APPEND and one SETRANGE of the header,
-- however long the output already is; its TTL is set when it is created (APPEND keeps it). A
-- streamed request's part is also its next chunk: one XADD of 'rid <request_id> offset <tokens
-- before it> tokens <in it> data <the part>' in this same call, so what a reader was sent is
-- exactly what was saved; a checkpoint that starts over (another entry of this request_id) deletes
-- the chunks of the earlier one first. The chunk stream's TTL is set when it starts and again when
-- the writer asks ('t': it does every tenth of the TTL, so a stream expires between 0.9 and 1 TTL
-- after its last chunk). A chunk goes into a producer's chunk stream only for an
-- entry that producer submitted (its ownership hash names it; else {2, 'ownership check failed
-- ...'}): a writer asks for that check ('o') with its first save of an entry (which, refused, is
-- its last: the hash names an entry from its submit until its record) and any save that starts
-- over. Readers blocked on the chunk streams are woken once, after the call.
--
-- Fencing: which entries this consumer still owns is read once per request stream, one XPENDING
-- over the batch's id range filtered by consumer (its own pending entries there: at most what it
-- has in flight). Per item every check comes before its first write; a key of another type is
-- found by the read of it (through pcall) or by the first write (the XADD of a chunk, through
-- pcall: also a stream whose ids are exhausted), and a refused checkpoint write after that XADD
-- takes the chunk out again.
local group, consumer = ARGV[1], ARGV[2]
local S = tonumber(ARGV[3])
local part_ttl, chunk_ttl = ARGV[4], ARGV[5]
local ev_cap, ev_ttl = tonumber(ARGV[6]), ARGV[7]
local n = (#KEYS - S) / 4
local out = {}

local less = entry_id_less

local owned = {}
for s = 1, S do
  local lo, hi
  for i = 1, n do
    local a = 7 + (i - 1) * 8
    if tonumber(ARGV[a + 1]) == s then
      local entry = ARGV[a + 2]
      if not lo or less(entry, lo) then lo = entry end
      if not hi or less(hi, entry) then hi = entry end
    end
  end
  local mine = {}
  owned[s] = mine
  local start = lo
  while lo do
    local p = redis.call('XPENDING', KEYS[s], group, start, hi, '1000', consumer)
    for _, e in ipairs(p) do mine[e[1]] = true end
    if #p < 1000 then break end
    start = '(' .. p[#p][1]
  end
end

local function save(i)
  local a = 7 + (i - 1) * 8
  local s, entry = tonumber(ARGV[a + 1]), ARGV[a + 2]
  local saved, add, part = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5]
  local rid, submitted, flags = ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
  local k = S + 4 * (i - 1)
  local partial, evkey, chunks, ownkey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  if not owned[s][entry] then return {0, 'fenced'} end
  local chunked = string.find(flags, 'c', 1, true) ~= nil
  if chunked and string.find(flags, 'o', 1, true) and redis.pcall('HGET', ownkey, rid) ~= submitted then
    return {2, 'ownership check failed: ' .. ownkey .. ' does not name this entry'}
  end
  -- (a key of another type answers WRONGTYPE: nothing of the item is written)
  local head = redis.pcall('GETRANGE', partial, 0, 63)
  if type(head) == 'table' and head.err then return {2, head.err .. ' (' .. partial .. ')'} end
  local same = #head == 64 and string.match(string.sub(head, 1, 44), '^(%S+)') == entry
  if same then
    if tonumber(string.sub(head, 46, 63)) ~= saved then return {0, 'stale'} end
  elseif saved ~= 0 then
    return {0, 'stale'}  -- (no checkpoint of this entry, and the writer thinks it saved some)
  end
  -- The writes. A start over (no checkpoint, or one of an earlier entry of this request_id: a
  -- requeue, a resubmit) drops that entry's chunks first (a key of another type is left alone).
  local chunk_id
  if chunked then
    if not same then
      local ckind = redis.call('TYPE', chunks)['ok']
      if ckind ~= 'none' and ckind ~= 'stream' then return {2, 'WRONGTYPE ' .. chunks .. ' holds a ' .. ckind} end
      redis.call('DEL', chunks)
    end
    chunk_id = redis.pcall('XADD', chunks, '*', 'rid', rid, 'offset', saved, 'tokens', add, 'data', part)
    if type(chunk_id) == 'table' and chunk_id.err then return {2, chunk_id.err .. ' (' .. chunks .. ')'} end
  end
  local header = string.format('%-44s %018d\n', entry, saved + add)
  local written
  if same then
    written = redis.pcall('APPEND', partial, part)
  else
    written = redis.pcall('SET', partial, header .. part, 'EX', part_ttl)
  end
  if type(written) == 'table' and written.err then
    if chunk_id then redis.call('XDEL', chunks, chunk_id) end
    return {2, written.err}
  end
  if same then redis.call('SETRANGE', partial, 0, header) end
  if chunked and (not same or string.find(flags, 't', 1, true)) then redis.call('EXPIRE', chunks, chunk_ttl) end
  if ev_cap > 0 and string.find(flags, 'l', 1, true) then
    -- (log_event and now_ms: shared/lua/prelude.lua)
    -- One event per delivery's run of checkpoints: a save right after this worker's last one of
    -- this entry replaces that line, counting the saves, so long generations push no older event out.
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
    log_event(evkey, ev_cap, ev_ttl, now_ms() .. who .. (saved + add) .. '\tsaves=' .. saves)
  end
  return {1, saved + add}
end

for i = 1, n do
  local r = save(i)
  out[2 * i - 1], out[2 * i] = r[1], r[2]
end
return out
