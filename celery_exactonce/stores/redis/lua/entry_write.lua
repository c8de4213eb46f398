-- Write a stored beat entry, and move the entries' revision.
-- KEYS: 1 the entries hash
-- ARGV: 1 name, 2 definition ('' with ARGV[3] 'del': delete),
--       3 'put' or 'del', 4 '1' to compare first, 5 the expected definition,
--       6 '1' when the entry is expected absent
-- Returns the new revision, or false when the entry is not as expected (nothing written).
if ARGV[4] == '1' then
  local current = redis.call('HGET', KEYS[1], ARGV[1])
  if ARGV[6] == '1' then
    if current then return false end
  elseif current ~= ARGV[5] then
    return false
  end
end
if ARGV[3] == 'del' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('HINCRBY', KEYS[1], '', 1)
