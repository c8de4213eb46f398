-- Append a note to a job's history; nothing else changes (jobs.annotate_job).
-- KEYS: 1 job    ARGV: 1 node, 2 reason, 3 op id
-- Answer: 1 if the record exists (the note is then in its history), else 0
local cur = redis.call('HMGET', KEYS[1], 'state', 'history')
if not cur[1] then
  return 0
end
if cur[2] and string.find(cur[2], '"rev":"' .. ARGV[3] .. '"', 1, true) then
  return 1
end
redis.call('HSET', KEYS[1], 'history',
           history_append(cur[2], history_entry(cur[1], cur[1], clock_text(), ARGV[1], ARGV[2],
                                                ARGV[3])))
return 1
