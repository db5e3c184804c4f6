-- Fenced finish of many requests of one stream in one call.
-- KEYS[1] request stream, then per item i (1-based): KEYS[3i-1] reply stream, KEYS[3i] rid key,
-- KEYS[3i+1] checkpoint key ({tag}:partial:<rid>)
-- ARGV[1] group  ARGV[2] consumer  ARGV[3] worker
-- then per item 6 values: entry id, rid, status, data (msgpack), reply MAXLEN cap ('0' = none),
-- '1' when the request is resumable (its checkpoint, if it names this entry, is deleted too)
-- Returns one value per item: 1 published, 0 fenced (this consumer no longer owns the entry, or the
-- entry came earlier in this call), or the error the reply stream answered (a string: nothing of
-- that item was written; it stays pending for the worker to dead-letter, hold or retry).
--
-- All or nothing per item: Redis keeps the writes a script made before a failing redis.call, so
-- an item's reads come first and its first write, the XADD, goes through pcall; its ack, delete
-- and rid release follow only once that XADD succeeded (and cannot fail: the request stream and
-- group were read above). One item's refusal never changes another item's fate.
local out = {}
local done = {}
local n = (#KEYS - 1) / 3

-- Which of the entries this consumer still owns: one XPENDING over the batch's id range, filtered
-- by consumer (its own pending entries there: at most what it has in flight), instead of one call
-- per item. Entry ids are canonical '<ms>-<seq>': the dash's place orders the ms parts' lengths,
-- and ids of the same shape order as text.
local function less(a, b)
  local da, db = string.find(a, '-', 1, true), string.find(b, '-', 1, true)
  if not da or not db then error('finish_many: not a stream entry id: ' .. (da and b or a)) end
  if da ~= db then return da < db end
  if #a == #b then return a < b end
  local ma, mb = string.sub(a, 1, da), string.sub(b, 1, db)
  if ma ~= mb then return ma < mb end
  return #a < #b
end
local lo, hi
for i = 1, n do
  local entry = ARGV[3 + (i - 1) * 6 + 1]
  if not lo or less(entry, lo) then lo = entry end
  if not hi or less(hi, entry) then hi = entry end
end
local owned = {}
local start = lo
while n > 0 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], start, hi, '1000', ARGV[2])
  for _, e in ipairs(p) do owned[e[1]] = true end
  if #p < 1000 then break end
  start = '(' .. p[#p][1]
end

for i = 1, n do
  local a = 3 + (i - 1) * 6
  local entry = ARGV[a + 1]
  if not owned[entry] then
    out[i] = 0
  else
    owned[entry] = nil  -- (an entry listed twice is published once)
    local reply, ridkey, partial = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
    local held = redis.pcall('GET', ridkey)  -- (a rid key of another type is not ours to delete)
    -- The cap goes to XADD as the string it came as: a Lua number would be formatted back with
    -- printf for every item.
    local cap = ARGV[a + 5]
    local added
    if cap ~= '0' then
      added = redis.pcall('XADD', reply, 'MAXLEN', '~', cap, '*', 'rid', ARGV[a + 2], 'status', ARGV[a + 3],
                          'worker', ARGV[3], 'data', ARGV[a + 4])
    else
      added = redis.pcall('XADD', reply, '*', 'rid', ARGV[a + 2], 'status', ARGV[a + 3], 'worker', ARGV[3],
                          'data', ARGV[a + 4])
    end
    if type(added) == 'table' and added.err then
      out[i] = added.err
    else
      done[#done + 1] = entry
      -- Release the submit de-duplication key only if it still names this entry.
      if type(held) == 'string' and string.sub(held, -string.len(entry) - 1) == ' ' .. entry then
        redis.call('DEL', ridkey)
      end
      if ARGV[a + 6] == '1' then
        local head = redis.pcall('GETRANGE', partial, 0, 43)
        if type(head) == 'string' and string.match(head, '^(%S+)') == entry then redis.call('DEL', partial) end
      end
      out[i] = 1
    end
  end
end
-- Ack and delete every published entry at once (still inside this one atomic script).
for j = 1, #done, 4000 do
  local chunk = {unpack(done, j, math.min(j + 3999, #done))}
  redis.call('XACK', KEYS[1], ARGV[1], unpack(chunk))
  redis.call('XDEL', KEYS[1], unpack(chunk))
end
return out
