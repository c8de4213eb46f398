-- Delete terminal records past their expiry; return how many.
-- A terminal record expires `retention` after max(fire_time, terminal_at). One whose
-- fire_time is later than its terminal_at is in the expiry index, scored by its expiry;
-- every other is found through its state's index, scored by terminal_at (its touched_at:
-- nothing touches a terminal record again), so it costs no expiry index member. (The
-- expiry index also holds the terminal records of earlier versions, which put every
-- terminal record there.)
-- KEYS: 1 expire, 2 due, 3 job key prefix, 4..12 state indexes (in STATES order)
-- ARGV: 1 limit, 2 retention in microseconds
local now, limit = clock(), tonumber(ARGV[1])
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', us(now), 'LIMIT', '0', limit)
local n = 0
for _, member in ipairs(members) do
  local key = KEYS[3] .. member
  local state = redis.call('HGET', key, 'state')
  if state then
    redis.call('ZREM', state_key(4, state), member)
    redis.call('DEL', key)
    n = n + 1
  end
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', KEYS[2], member)
end
local cutoff = us(now - tonumber(ARGV[2]))
for _, state in ipairs(STATES) do
  local index, skipped = state_key(4, state), 0
  while TERMINAL[state] and n < limit do
    local page = redis.call('ZRANGEBYSCORE', index, '-inf', cutoff,
                            'LIMIT', skipped, limit - n)
    if #page == 0 then break end
    for _, member in ipairs(page) do
      local key = KEYS[3] .. member
      local cur = redis.call('HMGET', key, 'fire_time', 'touched_at')
      if cur[1] and cur[2] and tonumber(cur[1]) > tonumber(cur[2]) then
        skipped = skipped + 1  -- kept until its slot + retention: the expiry index has it
      else
        if cur[2] then n = n + 1 end
        redis.call('DEL', key)
        redis.call('ZREM', index, member)
        redis.call('ZREM', KEYS[1], member)
      end
    end
  end
end
return n
