-- Delete terminal records past their expiry; return how many.
-- KEYS: 1 expire, 2 due, 3 job key prefix, 4..12 state indexes (in STATES order)
-- ARGV: 1 limit
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', us(clock()), 'LIMIT', '0', ARGV[1])
local n = 0
for _, member in ipairs(members) do
  local key = KEYS[3] .. member
  local state = redis.call('HGET', key, 'state')
  if state then
    redis.call('ZREM', state_key(4, state), member)
    redis.call('DEL', key)
    n = n + 1
  end
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', KEYS[2], member)
end
return n
