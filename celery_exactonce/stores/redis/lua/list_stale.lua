-- Records in one state touched at least ARGV[1] microseconds ago, in the index's
-- order (touched_at, then member bytes), strictly after the cursor when one is given.
-- KEYS: 1 the state's index, 2 job key prefix
-- ARGV: 1 age, 2 limit, 3 cursor touched_at (opt), 4 cursor member (opt)

-- Whether `a` sorts after `b` byte by byte, as a sorted set orders the members of one
-- score (Lua's own `>` on strings follows the server's locale).
local function bytes_after(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end

local cutoff = clock() - tonumber(ARGV[1])
local first = 0
local at, after = opt(ARGV[3]), opt(ARGV[4])
if at then
  -- The members scored `at` hold ranks [lo, hi), in byte order: bisect for the first
  -- one past the cursor's member, O(log(ties) * log n) however many share the score.
  local lo = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. at)
  local hi = lo + redis.call('ZCOUNT', KEYS[1], at, at)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if bytes_after(redis.call('ZRANGE', KEYS[1], mid, mid)[1], after) then
      hi = mid
    else
      lo = mid + 1
    end
  end
  first = lo
end
-- Ranks below `stale` are the members touched at or before the cutoff. A member
-- whose record is missing is skipped without shortening the page: callers read a
-- short page as the end of the listing.
local stale = redis.call('ZCOUNT', KEYS[1], '-inf', us(cutoff))
local limit = tonumber(ARGV[2])
local out = {}
while first < stale and #out < limit do
  local last = math.min(first + limit - #out, stale) - 1
  for _, member in ipairs(redis.call('ZRANGE', KEYS[1], first, last)) do
    local record = record_of(KEYS[2] .. member, member)
    if #record > 0 then out[#out + 1] = record end
  end
  first = last + 1
end
return out
