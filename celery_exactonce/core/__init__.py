"""The core: values and rules with no I/O, imported by every other layer.

The job's states and their transition table (``states``), the job record and
the rule every store applies (``jobs``), what a store is asked to write
(``writes``), a job's identity and the rules of stored names (``refs``), the
stored payload (``payload``), times (``times``), idempotency keys (``keys``),
the clock (``clock``), the package's errors (``exceptions``), and the slot
math: a schedule's fire times (``slots``, on ``cron_slots`` and
``solar_slots``) and the record of the slots beat skipped (``skipped_slots``).
Nothing here imports another layer of the package.
"""
