-- Claim up to `budget` new entries for one worker of the plain layout (no affinity lanes) in one
-- round trip: the high-priority streams first, then the request streams, in `streams` order.
-- XREADGROUP COUNT applies per stream, so the budget is carried from one read to the next: no
-- entry is read that the worker has no slot for (an over-read entry would stay leased where
-- nobody else can take it), and a request stream gets only what the high-priority ones left.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, CLAIM):
-- streams: the streams, high-priority ones first (one hash tag on a cluster: one partition);
-- group, consumer; budget: the most entries to read
-- Returns a flat list: stream, then its entries (as XREADGROUP gives them) or, when the stream
-- refused the read (no group: a server that restarted empty), the error (a string), ...
-- Only XREADGROUP (which writes the group's pending list), each through pcall: a stream that
-- refuses costs no other stream its entries, and every entry read is in the reply.
local out = {}
for i = 1, #streams do
  if budget <= 0 then break end
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', budget, 'STREAMS', streams[i], '>')
  if type(r) == 'table' and r.err then
    out[#out + 1] = streams[i]
    out[#out + 1] = r.err
  elseif type(r) == 'table' and r[1] then
    local entries = r[1][2]
    out[#out + 1] = streams[i]
    out[#out + 1] = entries
    budget = budget - #entries
  end
end
return out
