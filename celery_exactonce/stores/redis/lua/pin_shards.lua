-- Pin a sharded namespace's exactonce_shards in its one-slot meta, so that a
-- node started with one shard refuses it (its setup reads the pin); refuse a
-- namespace that already holds one-slot data. Return the pinned count, '1'
-- for one-slot data.    KEYS: 1 the one-slot meta    ARGV: 1 shards
local pinned = redis.call('HGET', KEYS[1], 'shards')
if pinned then return pinned end
if redis.call('HEXISTS', KEYS[1], 'format_version') == 1 then return '1' end
redis.call('HSET', KEYS[1], 'shards', ARGV[1])
return ARGV[1]
