-- The store's epoch, created if absent.    KEYS: 1 epoch    ARGV: 1 fresh token
local current = redis.call('GET', KEYS[1])
if current then return current end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
