-- Create a job if absent, checking the epoch and an occurrence's watermark.
-- KEYS: 1 job, 2 epoch, 3 watermarks, 4 index of the new state, 5 due
-- ARGV: 1 expected epoch (opt), 2 entry ('' for none), 3 fire_time, 4 member,
--       5 state, 6 run_at ('' for none), 7 node, 8 reason, 9 rev,
--       10 brief ('1': answer the status only), 11.. field/value pairs written as given
local current = redis.call('GET', KEYS[2])
local want = opt(ARGV[1])
if want and current ~= want then
  return {'epoch_mismatch', current}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[10] == '1' then return {'exists', current} end
  return {'exists', current, redis.call('HGETALL', KEYS[1])}
end
if ARGV[2] ~= '' then
  local mark = redis.call('HGET', KEYS[3], ARGV[2])
  if mark and tonumber(ARGV[3]) <= tonumber(mark) then
    return {'below_watermark', current}
  end
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
end
local at = clock()
local now = us(at)
local fields = {'attempt', '0', 'dispatches', '0', 'created_at', now, 'touched_at', now,
                'history', history_append(nil, nil, ARGV[5], at, ARGV[7], ARGV[8], ARGV[9])}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
if ARGV[5] == 'RUNNING' then
  fields[#fields + 1] = 'heartbeat_at'
  fields[#fields + 1] = now
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[4], now, ARGV[4])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[4])
end
if ARGV[10] == '1' then return {'created', current} end
return {'created', current, redis.call('HGETALL', KEYS[1])}
