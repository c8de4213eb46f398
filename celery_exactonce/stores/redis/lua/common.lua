-- Helpers shared by every RedisStore script. RedisStore prepends a header
-- generated from the Python constants (STATES, TERMINAL, HISTORY_LIMIT), then
-- this file, to each script: Lua has no includes.
--
-- Conventions: every time is integer microseconds since the UNIX epoch, on the
-- Redis clock (TIME); every key is a KEYS entry (job records are KEYS[i] ..
-- member, where KEYS[i] is the namespace's job key prefix); optional ARGV
-- values are '' when absent and '=' .. value when present.

-- An integer as a decimal string (tostring and cjson would print 1.7e+15).
local function us(n)
  return string.format('%.0f', n)
end

-- The store's clock, in microseconds (exact in a double until year 2255), and as text
-- (`clock_text`). Read once per call: every job of a batch is written at one store time.
local now_us, now_text
local function clock()
  if not now_us then
    local t = redis.call('TIME')
    now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return now_us
end

local function clock_text()
  if not now_text then now_text = us(clock()) end
  return now_text
end

-- An optional ARGV value: nil when absent.
local function opt(v)
  if v == '' then return nil end
  return string.sub(v, 2)
end

-- The state index key of `state`, given the KEYS position of PENDING's.
local function state_key(first, state)
  return KEYS[first + STATE_POS[state] - 1]
end

-- The history: a JSON array of entries, capped to HISTORY_LIMIT. An entry's `action` (the
-- reconciler's, or nil: then the entry has no such key) is what its caps count; its `at`
-- is the store time as a decimal string (us): cjson would round a 16-digit number.
-- Below the cap the entry is appended to the text as it is (no decode): every
-- entry has exactly one "rev" key, and a quote inside a string is escaped, so
-- counting '"rev":' counts the entries. They are counted by a plain find, up to
-- the cap (a gsub would copy the whole history on every write).
local function history_entries(raw)
  local count, from = 0, 1
  while count < HISTORY_LIMIT do
    local _, last = string.find(raw, '"rev":', from, true)
    if not last then break end
    count, from = count + 1, last + 1
  end
  return count
end

-- A history entry's JSON text (`src` nil for a create's).
local function history_entry(src, dst, at, node, reason, rev, action)
  return cjson.encode({['from'] = src or cjson.null, to = dst, at = at,
                       node = node, reason = reason, rev = rev, action = action})
end

-- The history JSON array `raw` (or none) with the entry text `entry` appended.
local function history_append(raw, entry)
  if not raw then return '[' .. entry .. ']' end
  local count = history_entries(raw)
  if count == 0 then return '[' .. entry .. ']' end
  if count < HISTORY_LIMIT then
    return string.sub(raw, 1, -2) .. ',' .. entry .. ']'
  end
  local h = cjson.decode(raw)
  h[#h + 1] = cjson.decode(entry)
  while #h > HISTORY_LIMIT do table.remove(h, 1) end
  return cjson.encode(h)
end

-- A record's HGETALL, with its 'ref' when the record has none (a compacted terminal
-- record keeps its ref in its key only: `member`, the index member, is that ref).
local function record_of(key, member)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return flat end
  for i = 1, #flat, 2 do
    if flat[i] == 'ref' then return flat end
  end
  flat[#flat + 1] = 'ref'
  flat[#flat + 1] = member
  return flat
end

-- The store's epoch (KEYS[1]), whether the caller's (ARGV[1], optional) is another, and
-- whether the reply is brief (ARGV[2]): how create.lua and create_unique.lua begin.
local function create_context()
  local current = redis.call('GET', KEYS[1])
  local want = opt(ARGV[1])
  return current, want ~= nil and current ~= want, ARGV[2] == '1'
end

-- Create the job at KEYS record key `key`, its arguments from ARGV[a] on (create.lua's
-- layout), KEYS 2 and 3 the watermarks and the due index; `current` the store's epoch,
-- `stale_epoch` whether the caller's is another. The reply of create.lua for one job.
local function create_job(key, a, current, stale_epoch, brief)
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
  local now = clock_text()
  local fields = {'attempt', '0', 'dispatches', '0', 'created_at', now, 'touched_at', now,
                  'history', history_append(nil, history_entry(nil, state, now, ARGV[a + 5],
                                                               ARGV[a + 6], ARGV[a + 7]))}
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
