-- Write the key-format marker if absent; return the stored format version, or
-- 'shards=<n>' when the meta pins another exactonce_shards (nothing written).
-- KEYS: 1 meta    ARGV: 1 format version, 2 namespace, 3 shards
local pinned = redis.call('HGET', KEYS[1], 'shards')
if pinned and pinned ~= ARGV[3] then return 'shards=' .. pinned end
local version = redis.call('HGET', KEYS[1], 'format_version')
if version then return version end
redis.call('HSET', KEYS[1], 'format_version', ARGV[1], 'namespace', ARGV[2])
if ARGV[3] ~= '1' then redis.call('HSET', KEYS[1], 'shards', ARGV[3]) end
return ARGV[1]
