-- The store's epoch, created if absent, or replaced if it is still the one the
-- caller names: the caller's fresh token, '@', and the birth time on the store
-- clock.    KEYS: 1 epoch    ARGV: 1 fresh token, 2 epoch to replace (opt)
local current = redis.call('GET', KEYS[1])
local replace = opt(ARGV[2])
if current and current ~= replace then return current end
local epoch = ARGV[1] .. '@' .. clock_text()
redis.call('SET', KEYS[1], epoch)
return epoch
