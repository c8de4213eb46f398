-- Move due PENDING jobs to SCHEDULED, in run_at order, each with a new rev.
-- KEYS: 1 due, 2 PENDING index, 3 SCHEDULED index, 4 job key prefix
-- ARGV: 1 limit, 2 rev prefix (unique per call), 3 node, 4 reason
local now = clock_text()
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', '0', ARGV[1])
local out = {}
for i, member in ipairs(members) do
  local key = KEYS[4] .. member
  redis.call('ZREM', KEYS[1], member)
  local cur = redis.call('HMGET', key, 'state', 'history')
  if cur[1] == 'PENDING' then
    local rev = ARGV[2] .. '.' .. i
    redis.call('HSET', key, 'state', 'SCHEDULED', 'rev', rev, 'touched_at', now,
               'node', ARGV[3], 'reason', ARGV[4],
               'history', history_append(cur[2], history_entry('PENDING', 'SCHEDULED', now, ARGV[3],
                                                               ARGV[4], rev)))
    redis.call('ZREM', KEYS[2], member)
    redis.call('ZADD', KEYS[3], now, member)
    out[#out + 1] = redis.call('HGETALL', key)
  end
end
return out
