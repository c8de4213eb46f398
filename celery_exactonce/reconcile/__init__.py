"""The reconciler: the passes that settle stale jobs, and :func:`cancel`.

A pass over the stale jobs (``reconciler``), what a pass did (``passes``),
the passes over the store's partitions under their leases
(``leased_passes``), the reconcile task and its beat-side runner (``task``),
and the cancel of a job not yet dispatched (``cancel``).
"""
