-- Take a lease if free, expired, or already ours.
-- KEYS: 1 lease    ARGV: 1 token, 2 ttl in milliseconds
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
