"""What operators see: events and counters, beat's gauges, Prometheus, Sentry Crons.

``metrics`` is the one path of every event (a log record, a counter, a Sentry
report when the application set Sentry up); every layer reports through it,
and it imports nothing of the package. ``gauges`` reads beat's gauges and the
store's counts, ``prometheus`` serves ``/metrics``, ``sentry_crons`` reports
beat entries to Sentry Crons.
"""
