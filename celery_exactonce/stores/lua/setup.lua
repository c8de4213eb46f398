-- Write the key-format marker if absent; return the stored format version.
-- KEYS: 1 meta    ARGV: 1 format version, 2 namespace
local version = redis.call('HGET', KEYS[1], 'format_version')
if version then return version end
redis.call('HSET', KEYS[1], 'format_version', ARGV[1], 'namespace', ARGV[2])
return ARGV[1]
