-- A reclaim pass's look at one partition's request streams: per stream, what
-- XPENDING key group IDLE min_idle - <end> count gives, where <end> is the newest entry that can have
-- been idle that long: one created before now - min_idle (an entry is delivered after it is made),
-- or newer where a worker handed entries back (their idle time set to min_idle: the hand-back
-- marks say how new). XPENDING ... IDLE walks the pending list up to <end> whatever it finds, so a
-- fleet whose pending lists hold many fresh entries (a big fleet at its ceiling) no longer walks
-- them all in every worker's every pass.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, RECLAIM_SCAN):
-- streams: the request streams; marks: the hand-back marks (zset: stream -> ms);
-- group; min_idle_ms: the least idle time (ms); count: the most entries per stream
-- Returns one reply per stream: XPENDING's entries ({id, consumer, idle ms, deliveries}, ...), or
-- the error's message (a string) when the stream refused (NOGROUP: a lane whose owner has not
-- made its group yet).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #streams do
  local last = now - tonumber(min_idle_ms)
  local mark = tonumber(redis.call('ZSCORE', marks, streams[i]) or '-1')
  if mark > last then last = mark end
  local r = redis.pcall('XPENDING', streams[i], group, 'IDLE', min_idle_ms, '-', tostring(last), count)
  if type(r) == 'table' and r.err then out[i] = r.err else out[i] = r end
end
return out
