-- Records in one state touched at least ARGV[1] microseconds ago, oldest first.
-- KEYS: 1 the state's index, 2 job key prefix    ARGV: 1 age, 2 limit
local cutoff = clock() - tonumber(ARGV[1])
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', us(cutoff), 'LIMIT', '0', ARGV[2])
local out = {}
for _, member in ipairs(members) do
  local record = redis.call('HGETALL', KEYS[2] .. member)
  if #record > 0 then out[#out + 1] = record end
end
return out
