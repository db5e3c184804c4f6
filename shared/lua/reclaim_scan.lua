-- A reclaim pass's look at one partition's request streams: per stream, what
-- XPENDING key group IDLE min_idle - <end> count gives, where <end> is the newest entry that can have
-- been idle that long: one created before now - min_idle (an entry is delivered after it is made),
-- or newer where a worker handed entries back (their idle time set to min_idle: the hand-back
-- marks say how new). XPENDING ... IDLE walks the pending list up to <end> whatever it finds, so a
-- fleet whose pending lists hold many fresh entries (a big fleet at its ceiling) no longer walks
-- them all in every worker's every pass.
-- KEYS: the request streams, then the hand-back marks (zset: stream -> ms)
-- ARGV[1] group  ARGV[2] min idle (ms)  ARGV[3] count
-- Returns one reply per stream: XPENDING's entries ({id, consumer, idle ms, deliveries}, ...), or
-- the error's message (a string) when the stream refused (NOGROUP: a lane whose owner has not
-- made its group yet).
local marks = KEYS[#KEYS]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS - 1 do
  local last = now - tonumber(ARGV[2])
  local mark = tonumber(redis.call('ZSCORE', marks, KEYS[i]) or '-1')
  if mark > last then last = mark end
  local r = redis.pcall('XPENDING', KEYS[i], ARGV[1], 'IDLE', ARGV[2], '-', tostring(last), ARGV[3])
  if type(r) == 'table' and r.err then out[i] = r.err else out[i] = r end
end
return out
