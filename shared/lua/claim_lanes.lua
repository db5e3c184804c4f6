-- Claim up to `budget` new entries for one worker of a pipeline with affinity lanes, in one atomic
-- pass: the high-priority stream first, then the lanes this worker owns, then the shared stream,
-- then entries that have waited longer than `steal_ms` ms (by server time) in the other lanes, or
-- are beyond the first `depth` undelivered entries of a lane (0: no depth rule).
-- XREADGROUP COUNT applies per stream, so the budget is carried from one read to the next: no
-- entry is read that the worker has no slot for (an over-read entry stays leased and cannot be
-- taken by another worker).
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, CLAIM_LANES):
-- high: the high-priority stream; own: the lanes this worker owns; shared: the shared stream;
-- others: the other lanes (all of one hash tag); group; consumer; budget; steal_ms: steal after
-- (ms); depth: steal depth (entries)
-- Returns a flat list: stream, kind ('high' | 'own' | 'shared' | 'stolen'), entries (as XREADGROUP
-- gives them), ...
-- Only reads and XREADGROUP (which writes the group's pending list); a stream or group that does
-- not exist is skipped (pcall), so one lane's trouble never blocks the others.
local out = {}

local function take(key, n, kind)
  if n <= 0 then return 0 end
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
  if type(r) ~= 'table' or r.err or not r[1] then return 0 end
  local entries = r[1][2]
  if #entries > 0 then
    out[#out + 1] = key
    out[#out + 1] = kind
    out[#out + 1] = entries
  end
  return #entries
end

local function field(list, name)
  for i = 1, #list, 2 do if list[i] == name then return list[i + 1] end end
end

-- How many entries at the head of another worker's lane (past the group's last-delivered id) this
-- worker may take, at most n: those older than the cutoff (they waited longer than the steal
-- wait), or, when the lane holds more than `depth` undelivered entries, the excess (its owner
-- cannot start them soon). The count is cut back to the end of a run of one affinity key, so a
-- steal takes whole groups and sessions; only a run longer than the scanned window (a hot key)
-- is split. With
-- `aligned_only`, a lane whose head continues the key its owner took last (a group it is part way
-- through) yields nothing: such lanes are stolen from only after the others.
-- Returns the count, and true when only `aligned_only` held it back (the lane is worth a second
-- look). `length` is the lane's XLEN (more than 0: the caller skips empty lanes).
local function stealable(key, length, cutoff_ms, n, depth, aligned_only)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return 0 end
  local last, pending
  for _, g in ipairs(groups) do
    if field(g, 'name') == group then
      last, pending = field(g, 'last-delivered-id'), field(g, 'pending')
    end
  end
  if not last then return 0 end
  local undelivered = length - pending
  if undelivered <= 0 then return 0 end
  local window = math.max(n, math.min(depth, 64))
  local head = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', window + 1)
  if not head[1] then return 0 end
  -- Waited longer than twice the steal wait: taken even if that splits a group (the bound holds).
  local late = tonumber(string.match(head[1][1], '^(%d+)-')) <= cutoff_ms - steal_ms
  if aligned_only and not late then
    local prev = redis.call('XRANGE', key, last, last)
    local ak = field(head[1][2], 'ak')
    if prev[1] and ak ~= nil and field(prev[1][2], 'ak') == ak then return 0, true end
  end
  local count = 0
  for _, e in ipairs(head) do
    if count >= n then break end
    local ms = tonumber(string.match(e[1], '^(%d+)-'))
    if ms > cutoff_ms then break end
    count = count + 1
  end
  if depth > 0 and undelivered - depth > count then count = math.min(n, undelivered - depth) end
  count = math.min(count, #head)
  if count > 0 and count < #head then
    local function same(i, j)
      local a = field(head[i][2], 'ak')
      return a ~= nil and a == field(head[j][2], 'ak')
    end
    local cut = count
    while cut > 0 and same(cut, cut + 1) do cut = cut - 1 end
    if cut == 0 then
      -- The head is one key's run longer than this worker's budget: take part of it only when the
      -- run is longer than the window too (a hot key its owner cannot finish soon).
      local run = 1
      while run < #head and same(run, run + 1) do run = run + 1 end
      if run <= window and not late then return 0 end
    else
      count = cut
    end
  end
  return count
end

budget = budget - take(high, budget, 'high')
for i = 1, #own do
  budget = budget - take(own[i], budget, 'own')
end
budget = budget - take(shared, budget, 'shared')
if budget > 0 and #others > 0 then
  local t = redis.call('TIME')
  local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - steal_ms
  local held_back = {}  -- lanes whose head continues their owner's key: looked at again after the others
  for i = 1, #others do
    if budget <= 0 then break end
    -- An empty lane costs one XLEN and nothing more (not even a Lua function call: about a quarter of
    -- an idle fleet's scan was those calls), so an idle fleet's scans stay cheap.
    local key = others[i]
    local length = redis.pcall('XLEN', key)
    if type(length) == 'number' and length > 0 then
      local count, aligned = stealable(key, length, cutoff, budget, depth, true)
      if aligned then held_back[#held_back + 1] = {key, length} end
      budget = budget - take(key, count, 'stolen')
    end
  end
  for _, lane in ipairs(held_back) do
    if budget <= 0 then break end
    local key, length = lane[1], lane[2]
    budget = budget - take(key, stealable(key, length, cutoff, budget, depth, false), 'stolen')
  end
end
return out
