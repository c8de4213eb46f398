-- Create jobs if absent, checking the epoch and each occurrence's watermark.
-- One call creates a batch, each job as if by its own call: the epoch is
-- checked once, then every job in order.
-- KEYS: 1 epoch, 2 watermarks, 3 due, 4..12 state indexes (in STATES order),
--       then one job record per job
-- ARGV: 1 expected epoch (opt), 2 brief ('1': answer the status only),
--       then per job: entry ('' for none), fire_time, member, state,
--       run_at ('' for none), node, reason, rev, n, then n field/value items
-- Answer: per job {status, epoch[, HGETALL of the record]}
local current, stale_epoch, brief = create_context()

local out, a = {}, 3
for k = 13, #KEYS do
  out[#out + 1] = create_job(KEYS[k], a, current, stale_epoch, brief)
  a = a + 9 + tonumber(ARGV[a + 8])
end
return out
