-- Cancel a request that no worker has taken yet: publish its (prebuilt) aborted record at once
-- instead of when a worker finally reaches it in the backlog.
-- KEYS[1] request stream  KEYS[2] reply stream
-- The request_id's rid key stays (a producer may not delete rid keys): housekeeping releases it
-- once the entry is gone (release_rids).
-- ARGV[1] group  ARGV[2] request entry id  ARGV[3] rid  ARGV[4] status  ARGV[5] data (msgpack record)
-- Returns 1 when cancelled, 0 when the entry is gone or already delivered to a worker (the worker
-- then aborts it, as for any in-flight request), or the error the reply stream answered (nothing
-- was written: the entry stays queued, and the worker that takes it deals with the stream).
-- All or nothing: every read comes before the first write, the XADD (through pcall).
if #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) == 0 then
  return 0
end
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and #p > 0 then
  return 0
end
if ok then
  -- Delivered entries are either pending or deleted; an undelivered one lies past the group's
  -- last-delivered id. XINFO GROUPS tells it, for the group named in ARGV[1].
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, last
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == ARGV[1] and last then
      local lms, lseq = string.match(last, '(%d+)-(%d+)')
      local ems, eseq = string.match(ARGV[2], '(%d+)-(%d+)')
      lms, lseq, ems, eseq = tonumber(lms), tonumber(lseq), tonumber(ems), tonumber(eseq)
      if ems < lms or (ems == lms and eseq <= lseq) then
        return 0
      end
    end
  end
end
local added = redis.pcall('XADD', KEYS[2], '*', 'rid', ARGV[3], 'status', ARGV[4], 'worker', '', 'data', ARGV[5])
if type(added) == 'table' and added.err then
  return added.err
end
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
