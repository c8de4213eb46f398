-- Compare-and-swap jobs to new states (jobs.check_transition / apply_transition).
-- One call applies a batch, each job as if by its own call, in order.
-- KEYS: 1..9 state indexes (in STATES order), 10 due, 11 expire,
--       then per job: its record, its lease (a dummy when no lease)
-- ARGV: 1 retention in microseconds, 2 brief ('1': answer 'applied' without the record),
--       3 what a terminal record keeps of its history ('full', 'last' or 'none'),
--       4 whether it keeps its payload ('1' or '0'),
--       5 how long a terminal occurrence is kept, in microseconds, when shorter (opt),
--       then per job (ARGS_PER_JOB): member, to, expected states (comma-separated),
--       node, reason, rev (opt), attempt (opt), run_id (opt), lease token (opt),
--       stale_for seconds (opt), new rev, new run_id (opt), next_attempt ('1' or '0'),
--       run_at (opt), args JSON (opt), kwargs JSON (opt), task name (opt), signature (opt),
--       the history entry but its "from" and time (codec.history_tail)
-- Answer: per job {status[, HGETALL of the record]}
-- The hot path (beat's DISPATCHED and PUBLISHED writes) is as few commands as it
-- can be: one read, one write of the record, and the index moves it needs.
local ARGS_PER_JOB = 19
local retention, brief = tonumber(ARGV[1]), ARGV[2] == '1'
local keep_history, keep_payload = ARGV[3], ARGV[4] == '1'
local compacts = keep_history ~= 'full' or not keep_payload
local occurrence_retention = opt(ARGV[5])

local function transition(key, lease_key, a)
  local cur = redis.call('HMGET', key, 'state', 'rev', 'attempt', 'run_id', 'touched_at',
                         'fire_time', 'history', 'dispatches', 'terminal_at', 'task')
  local state = cur[1]
  if not state then
    return {'not_found'}
  end
  local token = opt(ARGV[a + 8])
  if token and redis.call('GET', lease_key) ~= token then
    return {'lease_lost', record_of(key, ARGV[a])}
  end
  local now = clock()
  local ok = not TERMINAL[state]
  if ok then
    ok = string.find(',' .. ARGV[a + 2] .. ',', ',' .. state .. ',', 1, true) ~= nil
  end
  local rev, attempt, run_id = opt(ARGV[a + 5]), opt(ARGV[a + 6]), opt(ARGV[a + 7])
  if ok and rev and cur[2] ~= rev then ok = false end
  if ok and attempt and cur[3] ~= attempt then ok = false end
  if ok and run_id and cur[4] ~= run_id then ok = false end
  local task = opt(ARGV[a + 16])
  if ok and task and cur[10] ~= task then ok = false end
  local stale_for = opt(ARGV[a + 9])
  if ok and stale_for and (now - tonumber(cur[5])) / 1000000 < tonumber(stale_for) then
    ok = false
  end
  if not ok then
    return {'conflict', record_of(key, ARGV[a])}
  end

  local member, to, node, reason = ARGV[a], ARGV[a + 1], ARGV[a + 3], ARGV[a + 4]
  local new_rev, next_attempt = ARGV[a + 10], ARGV[a + 12] == '1'
  local at = clock_text()
  local entry = '{"from":"' .. state .. '",' .. ARGV[a + 18] .. at .. '"}'
  local set = {'state', to, 'rev', new_rev, 'touched_at', at, 'node', node,
               'reason', reason,
               'history', history_append(cur[7], entry)}
  local del = {}
  local function put(field, value) set[#set + 1] = field; set[#set + 1] = value end
  if next_attempt then put('attempt', us(tonumber(cur[3]) + 1)) end
  if to == 'DISPATCHED' then put('dispatches', us(tonumber(cur[8] or '0') + 1)) end
  if to == 'RUNNING' then
    put('run_id', opt(ARGV[a + 11]))
    put('heartbeat_at', at)
  elseif next_attempt and cur[4] then
    del[#del + 1] = 'run_id'
  end
  local run_at, args, kwargs = opt(ARGV[a + 13]), opt(ARGV[a + 14]), opt(ARGV[a + 15])
  if run_at then
    put('run_at', run_at)
  elseif next_attempt then
    del[#del + 1] = 'run_at'  -- the next attempt waits for its own run_at, or none
  end
  if args then put('args', args) end
  if kwargs then put('kwargs', kwargs) end
  -- A new payload takes its own signature (or none): a signature never outlives it.
  local signature = opt(ARGV[a + 17])
  if signature then
    put('signature', signature)
  elseif args or kwargs then
    del[#del + 1] = 'signature'
  end
  if TERMINAL[to] then
    put('terminal_at', at)
    -- Compacted (jobs.compact_terminal): the history and payload as the settings keep
    -- them, and no 'ref' (the key holds it), so the record's values stay short.
    if compacts then
      local drop = {ref = true, history = keep_history == 'none' or nil}
      if not keep_payload then
        drop.args, drop.kwargs, drop.options, drop.signature = true, true, true, true
      end
      local kept = {}
      for i = 1, #set, 2 do
        local field, value = set[i], set[i + 1]
        if field == 'history' and keep_history == 'last' then
          value = history_append(nil, entry)
        end
        if not drop[field] then kept[#kept + 1] = field; kept[#kept + 1] = value end
      end
      set = kept
      for field in pairs(drop) do del[#del + 1] = field end
    end
  elseif cur[9] then
    del[#del + 1] = 'terminal_at'
  end
  if TERMINAL[to] and compacts then
    -- Written afresh: a hash Redis once encoded as a hashtable (a long value) stays one
    -- however short its values become; a new one of short values is a listpack.
    local record = {}
    local flat = redis.call('HGETALL', key)
    for i = 1, #flat, 2 do record[flat[i]] = flat[i + 1] end
    for i = 1, #set, 2 do record[set[i]] = set[i + 1] end
    for _, field in ipairs(del) do record[field] = nil end
    set = {}
    for field, value in pairs(record) do put(field, value) end
    redis.call('DEL', key)
    redis.call('HSET', key, unpack(set))
  else
    redis.call('HSET', key, unpack(set))
    if #del > 0 then redis.call('HDEL', key, unpack(del)) end
  end

  if to ~= state then
    redis.call('ZREM', state_key(1, state), member)
  end
  redis.call('ZADD', state_key(1, to), at, member)
  if to == 'PENDING' then
    redis.call('ZADD', KEYS[10], run_at, member)
  elseif state == 'PENDING' then
    redis.call('ZREM', KEYS[10], member)
  end
  -- A terminal record is purged through its state's index (scored by terminal_at: see
  -- purge_expired), unless its slot is later than that, or it is an occurrence kept for
  -- less than the retention: then the expiry index has it, scored by its expiry.
  local slot_later = cur[6] and tonumber(cur[6]) > now
  if TERMINAL[to] and occurrence_retention and string.sub(member, 1, 2) == 'o:' then
    local start = slot_later and tonumber(cur[6]) or now
    redis.call('ZADD', KEYS[11], us(start + tonumber(occurrence_retention)), member)
  elseif TERMINAL[to] and slot_later then
    redis.call('ZADD', KEYS[11], us(tonumber(cur[6]) + retention), member)
  end
  if brief then return {'applied'} end
  return {'applied', record_of(key, member)}
end

local out, a = {}, 6
for k = 12, #KEYS, 2 do
  out[#out + 1] = transition(KEYS[k], KEYS[k + 1], a)
  a = a + ARGS_PER_JOB
end
return out
