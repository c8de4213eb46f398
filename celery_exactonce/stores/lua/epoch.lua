-- The store's epoch, created if absent: the caller's fresh token, '@', and
-- the birth time on the store clock.    KEYS: 1 epoch    ARGV: 1 fresh token
local current = redis.call('GET', KEYS[1])
if current then return current end
local epoch = ARGV[1] .. '@' .. us(clock())
redis.call('SET', KEYS[1], epoch)
return epoch
