-- Housekeeping: release the rid keys (submit de-duplication) whose entry is gone from every
-- request stream: a request cancelled while queued (a producer may not delete rid keys), an entry
-- deleted by other means, or a value that names no entry at all.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, RELEASE_RIDS):
-- streams: the request streams of the rid keys' partition; rid_keys;
-- dry_run: '1' = report, delete nothing
-- Returns one value per rid key: 1 released (or would be, in a dry run), 0 kept (its entry is still
-- in a stream, or the key is gone or not a string).
-- A rid key names its stream before the entry id ('<token> <stream> <entry id>', see
-- submit_many.lua: ids are per stream): only that stream is looked in (a value without one: all).
-- One atomic call: the check and the delete see the same key, so a rid key re-created for a new
-- submit between a scan and this call is judged by its own entry. DEL is its only write.
local names = {}
for s = 1, #streams do names[s] = string.match(streams[s], '^{[^}]*}:(.*)$') or streams[s] end
local out = {}
for i = 1, #rid_keys do
  local held = redis.pcall('GET', rid_keys[i])
  local release = 0
  if type(held) == 'string' then
    local entry = string.match(held, '(%d+%-%d+)$')
    local sname = string.match(held, '^%S+ (%S+) %d+%-%d+$')
    release = 1
    if entry then
      for s = 1, #streams do
        local found = nil
        if sname == nil or sname == names[s] then
          found = redis.pcall('XRANGE', streams[s], entry, entry, 'COUNT', 1)
        end
        if type(found) == 'table' and not found.err and #found > 0 then
          release = 0
          break
        end
      end
    end
    if release == 1 and dry_run ~= '1' then redis.call('DEL', rid_keys[i]) end
  end
  out[#out + 1] = release
end
return out
