"""What operators see: events and counters, beat's gauges, Prometheus, Sentry Crons, traces.

``metrics`` is the one path of every event (a log record, a counter, a Sentry
report when the application set Sentry up); every layer reports through it,
and it imports nothing of the package. ``gauges`` reads beat's gauges and the
store's counts (and, with ``entry_health``, each beat entry's health),
``prometheus`` serves ``/metrics``, ``sentry_crons`` reports beat entries to
Sentry Crons. ``traces`` carries a job's OpenTelemetry trace across the store
and makes our spans; like ``metrics``, it imports nothing of the package.
"""
