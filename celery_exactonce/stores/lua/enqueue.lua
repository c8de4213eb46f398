-- Create a job straight into DISPATCHED and push its message, in one atomic
-- step: for a broker on the same Redis server as the store, the record and
-- the message exist together or not at all.
-- KEYS: 1 job record, 2 the DISPATCHED index, then one key per broker command
-- ARGV: 1 store db, 2 broker db, 3..4 the record's two history entries as JSON
--       text, each open at its time (the store time, the same in both: the
--       create and the dispatch), 5 n, then n field/value items of the
--       record, the first 'ref' (its value is the index member), then per
--       broker command: its name (lpush, pexpire or publish) and its value
-- Answer: {'created'}, {'exists', HGETALL of the record}, or
--         {'push_failed', error}: nothing was written.
local key, member = KEYS[1], ARGV[7]
if redis.call('EXISTS', key) == 1 then
  return {'exists', redis.call('HGETALL', key)}
end
local store_db, broker_db = ARGV[1], ARGV[2]
local n = tonumber(ARGV[5])

-- The message first, in the broker's database: a push that fails is undone
-- (nothing else ran in between, so each LPUSH is still at its list's head)
-- and nothing is written.
local commands = {lpush = 'LPUSH', pexpire = 'PEXPIRE', publish = 'PUBLISH'}
if broker_db ~= store_db then redis.call('SELECT', broker_db) end
local pushed = {}
local a = 6 + 2 * n
for k = 3, #KEYS do
  local name = commands[ARGV[a]]
  local reply
  if name then
    reply = redis.pcall(name, KEYS[k], ARGV[a + 1])
  else
    reply = {err = 'unknown broker command ' .. tostring(ARGV[a])}
  end
  if type(reply) == 'table' and reply.err then
    for i = #pushed, 1, -1 do redis.call('LPOP', pushed[i]) end
    if broker_db ~= store_db then redis.call('SELECT', store_db) end
    return {'push_failed', reply.err}
  end
  if name == 'LPUSH' then pushed[#pushed + 1] = KEYS[k] end
  a = a + 2
end
if broker_db ~= store_db then redis.call('SELECT', store_db) end

local at = clock()
local now = us(at)
local history = table.concat({ARGV[3], now, ARGV[4], now, '"}]'})
redis.call('HSET', key, unpack(ARGV, 6, 5 + 2 * n))
redis.call('HSET', key, 'attempt', '0', 'dispatches', '1', 'created_at', now,
           'touched_at', now, 'history', history)
redis.call('ZADD', KEYS[2], now, member)
return {'created'}
