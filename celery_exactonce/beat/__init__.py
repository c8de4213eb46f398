"""Beat: :class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler` and its parts.

The scheduler (``scheduler``, what Celery calls) decides with values from
modules that never call back into it: the entries and their policy
(``entries``), the plan of a tick (``planner``), the claims of the planned
slots and the dispatch of the won ones (``claimer``, ``claims``,
``conflicts``), the skipped slots (``skips``), the store-loss guard
(``store_loss``), the entries by next slot (``due_heap``), the due delayed
jobs (``sweeper``) and beat's own log lines (``log``).
"""
