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
--         {'push_failed', error}: nothing was written. An error reply (the
--         record refused: a server out of memory) has written nothing either.
--
-- The order is what makes it atomic. Redis runs a script's commands as they
-- come and keeps what ran: a command that fails undoes nothing. An LPUSH is
-- taken back with an LPOP, a record with a DEL; a PUBLISH (a fanout
-- exchange's message) reaches its subscribers at once and cannot be taken
-- back. So every command is checked first (its name; a PUBLISH's ACL), then
-- the queues' pushes and the record are written, undone if one fails, and
-- the PUBLISHes run last, when nothing after them can fail. (A server out
-- of memory refuses only a script's first write: a PUBLISH, not a write,
-- would pass, and the record's HSET after it fail.)
local key, member = KEYS[1], ARGV[7]
if redis.call('EXISTS', key) == 1 then
  return {'exists', record_of(key, member)}
end
local store_db, broker_db = ARGV[1], ARGV[2]
local n = tonumber(ARGV[5])

local commands = {lpush = 'LPUSH', pexpire = 'PEXPIRE', publish = 'PUBLISH'}
local queued, published = {}, {}
local a = 6 + 2 * n
for k = 3, #KEYS do
  local name = commands[ARGV[a]]
  if not name then
    return {'push_failed', 'unknown broker command ' .. tostring(ARGV[a])}
  end
  local command = {name, KEYS[k], ARGV[a + 1]}
  if name == 'PUBLISH' then
    -- redis.acl_check_cmd: Redis 7 and later; before it, a refused PUBLISH
    -- is met below, where the first one still undoes everything.
    if redis.acl_check_cmd and not redis.acl_check_cmd('PUBLISH', KEYS[k], ARGV[a + 1]) then
      return {'push_failed', 'NOPERM this user may not PUBLISH to ' .. KEYS[k]}
    end
    published[#published + 1] = command
  else
    queued[#queued + 1] = command
  end
  a = a + 2
end

-- Undo what ran (in the store's database on entry and on return): the
-- record if it was written, then each LPUSH, still at its list's head
-- (nothing else ran in between).
local pushed, written = {}, false
local function undo()
  if written then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[2], member)
  end
  if broker_db ~= store_db then redis.call('SELECT', broker_db) end
  for i = #pushed, 1, -1 do redis.call('LPOP', pushed[i]) end
  if broker_db ~= store_db then redis.call('SELECT', store_db) end
end

-- The queues' pushes, in the broker's database.
if broker_db ~= store_db then redis.call('SELECT', broker_db) end
for _, command in ipairs(queued) do
  local reply = redis.pcall(command[1], command[2], command[3])
  if type(reply) == 'table' and reply.err then
    if broker_db ~= store_db then redis.call('SELECT', store_db) end
    undo()
    return {'push_failed', reply.err}
  end
  if command[1] == 'LPUSH' then pushed[#pushed + 1] = command[2] end
end
if broker_db ~= store_db then redis.call('SELECT', store_db) end

-- The record.
local now = clock_text()
local history = table.concat({ARGV[3], now, ARGV[4], now, '"}]'})
-- One HSET for the whole record (all or nothing), then its index entry.
local reply = redis.pcall('HSET', key, 'attempt', '0', 'dispatches', '1', 'created_at', now,
                          'touched_at', now, 'history', history, unpack(ARGV, 6, 5 + 2 * n))
if type(reply) == 'table' and reply.err then
  undo()
  return redis.error_reply(reply.err)
end
written = true
reply = redis.pcall('ZADD', KEYS[2], now, member)
if type(reply) == 'table' and reply.err then
  undo()
  return redis.error_reply(reply.err)
end

-- The fanout's messages, last.
for i, command in ipairs(published) do
  local reply = redis.pcall(command[1], command[2], command[3])
  if type(reply) == 'table' and reply.err then
    if i == 1 then  -- nothing reached a subscriber yet
      undo()
      return {'push_failed', reply.err}
    end
    return redis.error_reply(reply.err)  -- (Redis before 7 only: see above)
  end
end
return {'created'}
