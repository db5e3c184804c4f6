-- Shared by the functions that write a request's event log (checkpoint_many, dead_letter,
-- finish_many), end a request (dead_letter, finish_many) or fence a batch (checkpoint_many,
-- save_parts, finish_many): placed once at the top of the library by
-- redroll.shared.functions.build_library.

-- The request's event log (a string of lines, one event each: '<ms>\t<kind>\t<k>=<v>...', see
-- shared/events.py): append a line and set the TTL (a new log: one SET). Past the cap (bytes) the
-- oldest lines give way to one '0\ttrimmed\tn=<how many>' line at the head. Called after the
-- step's own writes (which Redis then never refuses for memory), through pcall: a key of another
-- type costs the log its event, never the step its fate.
local function log_event(ev, cap, ttl, line)
  line = line .. '\n'
  if redis.pcall('SET', ev, line, 'EX', ttl, 'NX') then return end
  local n = redis.pcall('APPEND', ev, line)
  if type(n) ~= 'number' then return end
  if n > cap then
    local s, dropped = redis.call('GET', ev), 0
    local head = string.match(s, '^0\ttrimmed\tn=(%d+)\n')
    if head then
      dropped = tonumber(head)
      s = string.sub(s, string.find(s, '\n', 1, true) + 1)
    end
    while #s + 32 > cap do
      local nl = string.find(s, '\n', 1, true)
      if nl == #s then break end  -- (the newest event stays, however long)
      s, dropped = string.sub(s, nl + 1), dropped + 1
    end
    redis.call('SET', ev, '0\ttrimmed\tn=' .. dropped .. '\n' .. s, 'KEEPTTL')
  end
  redis.call('EXPIRE', ev, ttl)
end
-- Whether stream entry id a orders before b. Ids are canonical '<ms>-<seq>': the dash's place
-- orders the ms parts' lengths, and ids of the same shape order as text.
local function entry_id_less(a, b)
  local da, db = string.find(a, '-', 1, true), string.find(b, '-', 1, true)
  if not da or not db then error('not a stream entry id: ' .. (da and b or a)) end
  if da ~= db then return da < db end
  if #a == #b then return a < b end
  local ma, mb = string.sub(a, 1, da), string.sub(b, 1, db)
  if ma ~= mb then return ma < mb end
  return #a < #b
end
-- The entries this consumer still owns among a batch's, per request stream (owned[s][entry id]):
-- one XPENDING per stream over the batch's id range (lease_from[s] to lease_to[s]) filtered by
-- consumer, a page of 1000 at a time: at most what the consumer has in flight there.
local function owned_entries(streams, lease_from, lease_to, group, consumer)
  local owned = {}
  for s = 1, #streams do
    local mine = {}
    owned[s] = mine
    local start, hi = lease_from[s], lease_to[s]
    while true do
      local p = redis.call('XPENDING', streams[s], group, start, hi, '1000', consumer)
      for _, e in ipairs(p) do mine[e[1]] = true end
      if #p < 1000 then break end
      start = '(' .. p[#p][1]
    end
  end
  return owned
end
local function now_ms()
  local t = redis.call('TIME')
  return tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end

-- A request ended, its record (``record_id``, or false: none) sent to its producer's reply stream:
-- the request's field in that producer's ownership hash becomes the finished mark 'done <record
-- id> <what the rid key held>' (``held``, or false when the rid key did not name this entry),
-- which submit_many.lua reads and ack_replies.lua takes out; without both, the field goes.
local function settle_owner_field(ownkey, rid, record_id, held)
  if record_id and held then
    redis.call('HSET', ownkey, rid, 'done ' .. record_id .. ' ' .. held)
  else
    redis.call('HDEL', ownkey, rid)
  end
end
