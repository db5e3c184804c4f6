-- Delete a consumer of a group only if it has no pending entries (worker housekeeping), atomically:
-- a consumer that gained pending entries since it was found idle is kept.
-- KEYS[1] stream  ARGV[1] group  ARGV[2] consumer
-- Returns -1 when the consumer still has pending entries (kept), else what XGROUP DELCONSUMER answers.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
