-- Release a lease held with the token.    KEYS: 1 lease    ARGV: 1 token
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
