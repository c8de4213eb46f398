-- Compare-and-swap a job to a new state (jobs.check_transition / apply_transition).
-- KEYS: 1 job, 2 lease (a dummy when no lease), 3..11 state indexes
--       (in STATES order), 12 due, 13 expire
-- ARGV: 1 member, 2 to, 3 expected states (comma-separated), 4 node, 5 reason,
--       6 rev (opt), 7 attempt (opt), 8 run_id (opt), 9 lease token (opt),
--       10 stale_for seconds (opt), 11 new rev, 12 new run_id (opt),
--       13 next_attempt ('1' or '0'), 14 run_at (opt), 15 args JSON (opt),
--       16 kwargs JSON (opt), 17 retention in microseconds,
--       18 brief ('1': answer 'applied' without the record)
-- The hot path (beat's DISPATCHED and PUBLISHED writes) is as few commands as it
-- can be: one read, one write of the record, and the index moves it needs.
local key = KEYS[1]
local cur = redis.call('HMGET', key, 'state', 'rev', 'attempt', 'run_id', 'touched_at',
                       'fire_time', 'history', 'dispatches', 'terminal_at')
local state = cur[1]
if not state then
  return {'not_found'}
end
local token = opt(ARGV[9])
if token and redis.call('GET', KEYS[2]) ~= token then
  return {'lease_lost', redis.call('HGETALL', key)}
end
local now = clock()
local ok = not TERMINAL[state]
if ok then
  ok = false
  for s in string.gmatch(ARGV[3], '[^,]+') do
    if s == state then ok = true break end
  end
end
local rev, attempt, run_id = opt(ARGV[6]), opt(ARGV[7]), opt(ARGV[8])
if ok and rev and cur[2] ~= rev then ok = false end
if ok and attempt and cur[3] ~= attempt then ok = false end
if ok and run_id and cur[4] ~= run_id then ok = false end
local stale_for = opt(ARGV[10])
if ok and stale_for and (now - tonumber(cur[5])) / 1000000 < tonumber(stale_for) then
  ok = false
end
if not ok then
  return {'conflict', redis.call('HGETALL', key)}
end

local to, member, next_attempt = ARGV[2], ARGV[1], ARGV[13] == '1'
local set = {'state', to, 'rev', ARGV[11], 'touched_at', us(now),
             'node', ARGV[4], 'reason', ARGV[5],
             'history', history_append(cur[7], state, to, now, ARGV[4], ARGV[5], ARGV[11])}
local del = {}
local function put(field, value) set[#set + 1] = field; set[#set + 1] = value end
if next_attempt then put('attempt', us(tonumber(cur[3]) + 1)) end
if to == 'DISPATCHED' then put('dispatches', us(tonumber(cur[8] or '0') + 1)) end
if to == 'RUNNING' then
  put('run_id', opt(ARGV[12]))
  put('heartbeat_at', us(now))
elseif next_attempt and cur[4] then
  del[#del + 1] = 'run_id'
end
local run_at, args, kwargs = opt(ARGV[14]), opt(ARGV[15]), opt(ARGV[16])
if run_at then put('run_at', run_at) end
if args then put('args', args) end
if kwargs then put('kwargs', kwargs) end
if TERMINAL[to] then
  put('terminal_at', us(now))
elseif cur[9] then
  del[#del + 1] = 'terminal_at'
end
redis.call('HSET', key, unpack(set))
if #del > 0 then redis.call('HDEL', key, unpack(del)) end

if to ~= state then
  redis.call('ZREM', state_key(3, state), member)
end
redis.call('ZADD', state_key(3, to), us(now), member)
if to == 'PENDING' then
  redis.call('ZADD', KEYS[12], run_at, member)
elseif state == 'PENDING' then
  redis.call('ZREM', KEYS[12], member)
end
if TERMINAL[to] then
  local start = now
  if cur[6] and tonumber(cur[6]) > start then start = tonumber(cur[6]) end
  redis.call('ZADD', KEYS[13], us(start + tonumber(ARGV[17])), member)
end
if ARGV[18] == '1' then return {'applied'} end
return {'applied', redis.call('HGETALL', key)}
