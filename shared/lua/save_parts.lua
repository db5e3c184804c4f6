-- Add many streamed requests' next parts of partial output to their producers' chunk streams and
-- to this worker's parts stream, fenced, in one call: a worker's streamed saves of one tick between
-- two consolidations of each checkpoint (see engine_worker/checkpoint_writes.py; the parts of
-- requests that are not streamed, which no reader sees before they are consolidated, go to the
-- parts stream with a plain XADD). A save here costs no command of its own: its part is one field
-- of the call's one XADD to its producer's chunk stream ('<request_id> <tokens before it> <tokens
-- in it>') and one of the call's XADD to the parts stream (the same field after '<entry id> ').
-- All or nothing per item; one item's refusal never changes another's fate.
-- Keys and args by name (their places: shared/function_layouts.py, SAVE_PARTS):
--   streams  the request streams the parts' entries are in; lease_from, lease_to: per stream, the
--            first and last entry id of its parts (the lease range read there)
--   parts    this worker's parts stream of this hash tag ({tag}:parts:<worker>)
--   chunks   the streamed parts' producers' chunk streams; refresh[c]: '1' when chunk stream c's
--            TTL is set again (a new stream always gets it)
--   group, consumer  the workers' group and this worker; keep_ms how long the parts stream keeps a
--            part (the XADD trims it: MINID ~ now - keep_ms); parts_ttl its TTL (s), set each call;
--            chunk_ttl the chunk streams' TTL (s), which trims them as checkpoint_many.lua does
--   per part i (1..n): part.stream_at[i] its stream's place in streams, part.entry[i] its entry
--            id, part.chunk_at[i] its chunk stream's place in chunks (0: a part with no chunk,
--            fenced all the same), part.field[i] '<request_id>
--            <tokens before it> <tokens in it>', part.data[i] the part (8 hex digits of length + one
--            MessagePack map)
-- Returns two values per part: {1, 0} (added) | {0, 'fenced'} (this consumer no longer owns the
-- entry) | {2, error} (refused: nothing of that part written).
--
-- Fencing: as in checkpoint_many.lua, one XPENDING per request stream over the batch's id range,
-- filtered by consumer. A chunk stream of another type refuses its parts before any write (one
-- TYPE per chunk stream). The chunk entries go first; should the parts stream's XADD then fail (a
-- key of another type, its ids exhausted), the call's chunk entries are deleted again and every
-- part is refused.
local out = {}

local owned = owned_entries(streams, lease_from, lease_to, group, consumer)

-- A key's refusal ('WRONGTYPE ...', or false: a stream or no key yet) and whether it is new.
local function refusal(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= 'stream' then return 'WRONGTYPE ' .. key .. ' holds a ' .. kind, false end
  return false, kind == 'none'
end
local chunk_refused, chunk_fields, chunk_new = {}, {}, {}
for c = 1, #chunks do
  chunk_refused[c], chunk_new[c] = refusal(chunks[c])
  chunk_fields[c] = {}
end

local fields, added = {}, {}
for i = 1, n do
  local c = part.chunk_at[i]
  if not owned[part.stream_at[i]][part.entry[i]] then
    out[2 * i - 1], out[2 * i] = 0, 'fenced'
  elseif c > 0 and chunk_refused[c] then
    out[2 * i - 1], out[2 * i] = 2, chunk_refused[c]
  else
    local field, data = part.field[i], part.data[i]
    fields[#fields + 1] = part.entry[i] .. ' ' .. field  -- (in the parts stream, the entry first)
    fields[#fields + 1] = data
    if c > 0 then
      local cf = chunk_fields[c]
      cf[#cf + 1] = field
      cf[#cf + 1] = data
    end
    added[#added + 1] = i
    out[2 * i - 1], out[2 * i] = 1, 0
  end
end
if #fields == 0 then return out end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local chunk_ids = {}
local function undo_chunks()
  for c, id in pairs(chunk_ids) do redis.call('XDEL', chunks[c], id) end
end
local function refuse_added(message)
  for _, i in ipairs(added) do out[2 * i - 1], out[2 * i] = 2, message end
end
for c = 1, #chunks do
  if #chunk_fields[c] > 0 then
    local oldest = now - chunk_ttl * 1000
    local id = redis.pcall('XADD', chunks[c], 'MINID', '~', string.format('%d', oldest > 0 and oldest or 0), '*',
                           unpack(chunk_fields[c]))
    if type(id) == 'table' then
      undo_chunks()
      refuse_added(id.err .. ' (' .. chunks[c] .. ')')
      return out
    end
    chunk_ids[c] = id
    if chunk_new[c] or refresh[c] == '1' then redis.call('EXPIRE', chunks[c], chunk_ttl) end
  end
end
local oldest = now - keep_ms
local id = redis.pcall('XADD', parts, 'MINID', '~', string.format('%d', oldest > 0 and oldest or 0), '*',
                       unpack(fields))
if type(id) == 'table' then
  undo_chunks()
  refuse_added(id.err .. ' (' .. parts .. ')')
  return out
end
redis.call('EXPIRE', parts, parts_ttl)
return out
