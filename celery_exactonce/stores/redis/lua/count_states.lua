-- How many records each state's index holds (one snapshot).
-- KEYS: the state indexes, in STATES order    ARGV: none
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('ZCARD', KEYS[i])
end
return out
