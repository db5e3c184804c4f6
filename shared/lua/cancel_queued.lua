-- Cancel a request that no worker has taken yet: publish its (prebuilt) aborted record at once
-- instead of when a worker finally reaches it in the backlog.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, CANCEL_QUEUED):
-- stream: the request stream; reply_key: the reply stream;
-- group; entry: the request's entry id; rid, status, data (msgpack): the aborted record's fields
-- The request_id's rid key stays (a producer may not delete rid keys): housekeeping releases it
-- once the entry is gone (release_rids).
-- Returns 1 when cancelled, 0 when the entry is gone or already delivered to a worker (the worker
-- then aborts it, as for any in-flight request), or the error the reply stream answered (nothing
-- was written: the entry stays queued, and the worker that takes it deals with the stream).
-- All or nothing: every read comes before the first write, the XADD (through pcall).
if #redis.call('XRANGE', stream, entry, entry) == 0 then
  return 0
end
local ok, p = pcall(redis.call, 'XPENDING', stream, group, entry, entry, 1)
if ok and #p > 0 then
  return 0
end
if ok then
  -- Delivered entries are either pending or deleted; an undelivered one lies past the group's
  -- last-delivered id. XINFO GROUPS tells it, for the group named `group`.
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == group and last then
      local lms, lseq = string.match(last, '(%d+)-(%d+)')
      local ems, eseq = string.match(entry, '(%d+)-(%d+)')
      lms, lseq, ems, eseq = tonumber(lms), tonumber(lseq), tonumber(ems), tonumber(eseq)
      if ems < lms or (ems == lms and eseq <= lseq) then
        return 0
      end
    end
  end
end
local added = redis.pcall('XADD', reply_key, '*', 'rid', rid, 'status', status, 'worker', '', 'data', data)
if type(added) == 'table' and added.err then
  return added.err
end
redis.call('XDEL', stream, entry)
return 1
