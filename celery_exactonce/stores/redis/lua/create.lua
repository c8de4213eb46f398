-- Create jobs if absent, checking the epoch and each occurrence's watermark.
-- One call creates a batch, each job as if by its own call: the epoch is
-- checked once, then every job in order.
-- KEYS: 1 epoch, 2 watermarks, 3 due, 4..12 state indexes (in STATES order),
--       then one job record per job
-- ARGV: 1 expected epoch (opt), 2 brief ('1': answer the status only),
--       then per job: entry ('' for none), fire_time, member, state,
--       run_at ('' for none), node, reason, rev, n, then n field/value items
-- Answer: per job {status, epoch[, HGETALL of the record]}
local current = redis.call('GET', KEYS[1])
local want = opt(ARGV[1])
local stale_epoch = want and current ~= want
local brief = ARGV[2] == '1'

local function create(key, a)
  if stale_epoch then
    return {'epoch_mismatch', current}
  end
  if redis.call('EXISTS', key) == 1 then
    if brief then return {'exists', current} end
    return {'exists', current, record_of(key, ARGV[a + 2])}
  end
  local entry, fire_time, member, state = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  if entry ~= '' then
    local mark = redis.call('HGET', KEYS[2], entry)
    if mark and tonumber(fire_time) <= tonumber(mark) then
      return {'below_watermark', current}
    end
    redis.call('HSET', KEYS[2], entry, fire_time)
  end
  local at = clock()
  local now = us(at)
  local fields = {'attempt', '0', 'dispatches', '0', 'created_at', now, 'touched_at', now,
                  'history', history_append(nil, nil, state, at, ARGV[a + 5], ARGV[a + 6],
                                            ARGV[a + 7])}
  for i = a + 9, a + 8 + tonumber(ARGV[a + 8]) do fields[#fields + 1] = ARGV[i] end
  if state == 'RUNNING' then
    fields[#fields + 1] = 'heartbeat_at'
    fields[#fields + 1] = now
  end
  redis.call('HSET', key, unpack(fields))
  redis.call('ZADD', state_key(4, state), now, member)
  if ARGV[a + 4] ~= '' then
    redis.call('ZADD', KEYS[3], ARGV[a + 4], member)
  end
  if brief then return {'created', current} end
  return {'created', current, redis.call('HGETALL', key)}
end

local out, a = {}, 3
for k = 13, #KEYS do
  out[#out + 1] = create(KEYS[k], a)
  a = a + 9 + tonumber(ARGV[a + 8])
end
return out
