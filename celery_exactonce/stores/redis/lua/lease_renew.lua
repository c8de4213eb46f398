-- Extend a lease still held with the token.
-- KEYS: 1 lease    ARGV: 1 token, 2 ttl in milliseconds
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
