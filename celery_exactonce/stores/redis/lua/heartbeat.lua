-- Touch a RUNNING job owned by a run id; its rev is unchanged.
-- KEYS: 1 job, 2 RUNNING index    ARGV: 1 run_id, 2 member
local cur = redis.call('HMGET', KEYS[1], 'state', 'run_id')
if cur[1] ~= 'RUNNING' or cur[2] ~= ARGV[1] then
  return 0
end
local now = clock_text()
redis.call('HSET', KEYS[1], 'touched_at', now, 'heartbeat_at', now)
redis.call('ZADD', KEYS[2], now, ARGV[2])
return 1
