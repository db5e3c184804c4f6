-- Delete a consumer of a group only if it has no pending entries (worker housekeeping), atomically:
-- a consumer that gained pending entries since it was found idle is kept.
-- Names (their places in KEYS and ARGV: shared/function_layouts.py, DELETE_CONSUMER_IF_EMPTY):
-- stream, group, consumer
-- Returns -1 when the consumer still has pending entries (kept), else what XGROUP DELCONSUMER answers.
local p = redis.call('XPENDING', stream, group, '-', '+', 1, consumer)
if #p > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', stream, group, consumer)
