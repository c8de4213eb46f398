-- PENDING jobs whose run_at has come: how many, the earliest run_at, and the store time.
-- KEYS: 1 due    ARGV: none
local now = clock()
local count = redis.call('ZCOUNT', KEYS[1], '-inf', us(now))
local oldest = ''
if count > 0 then
  oldest = us(tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]))
end
return {count, oldest, us(now)}
