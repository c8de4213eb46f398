-- Create one job unless a live job holds its unique key (ExactOnceTask.exactonce_unique).
-- KEYS: as create's for one job (1 epoch, 2 watermarks, 3 due, 4..12 state indexes,
--       13 the job record), then 14 the unique keys' index (key -> the member of the
--       last job created with it), 15 the record of the holder the caller read (the
--       job's own record when it read none)
-- ARGV: as create's for one job, then the unique key, then the holder's member the
--       caller read ('' for none)
-- Answer: {'moved', member} when the index names another holder than the caller read
--         (nothing written: read it again, call again); {'unique_held', epoch, the
--         holder's record} when that holder is live; else create's answer for the job,
--         and a created job becomes the key's holder.
local current, stale_epoch, brief = create_context()
local key, seen = ARGV[#ARGV - 1], ARGV[#ARGV]
local holder = redis.call('HGET', KEYS[14], key) or ''
if holder ~= seen then
  return {'moved', holder}
end
local member = ARGV[5]
-- A record with the job's own ref answers EXISTS (a repeat, or a resubmitted task id),
-- whoever holds the key now.
if holder ~= '' and holder ~= member and not stale_epoch
    and redis.call('EXISTS', KEYS[13]) == 0 then
  local state = redis.call('HGET', KEYS[15], 'state')
  if state and not TERMINAL[state] then
    return {'unique_held', current, record_of(KEYS[15], holder)}
  end
end
local out = create_job(KEYS[13], 3, current, stale_epoch, brief)
if out[1] == 'created' then
  redis.call('HSET', KEYS[14], key, member)
end
return out
