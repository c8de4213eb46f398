"""The Redis store's errors: which driver errors may pass, and :class:`NotReplicated`.

* :func:`store_error`: a driver error as the package's: ``StoreUnavailable``
  when retrying may help (the server is unreachable, slow, loading, failing
  over or read-only: :data:`TRANSIENT`, or a reply in
  :data:`TRANSIENT_REPLIES`), else ``StoreError``;
* :data:`REROUTE`: the errors after which a cluster's slot table is read again;
* :class:`NotReplicated`: a counted write (or a confirmed read) that fewer
  than ``exactonce_min_replicas`` replicas confirmed in time.

Not here: the boundary that raises them
(:meth:`RedisCore._wrap <celery_exactonce.stores.redis.base.RedisCore._wrap>`,
which also blanks secrets and refuses a closed store).
"""

from __future__ import annotations

import redis.exceptions as rexc

from celery_exactonce.core import exceptions

#: Errors after which retrying may help: the server is unreachable, slow,
#: loading, failing over or read-only (a replica promoted under us).
TRANSIENT: tuple[type[Exception], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.TryAgainError,
    rexc.ClusterDownError,
    rexc.MasterDownError,
    rexc.ReadOnlyError,
    rexc.MovedError,  # a cluster's slot moved (the command did not run)
    rexc.AskError,
)
#: Server replies that mean the same though redis-py has no class for them.
TRANSIENT_REPLIES = ("BUSY", "MASTERDOWN", "NOREPLICAS", "LOADING", "TRYAGAIN")

#: Errors after which a cluster's slot table is read again: the slot moved, or its
#: master does not answer (dead, and maybe failed over: a pipeline, sent to the
#: slot's master as the table says, would go on trying it). Single commands
#: already reread it inside redis-py.
REROUTE = (rexc.MovedError, rexc.AskError, rexc.ConnectionError, rexc.TimeoutError)


class NotReplicated(exceptions.StoreUnavailable):
    """A write the master applied, not confirmed by ``min_replicas`` replicas in time.

    Its outcome is unknown, as after a lost answer: a failover may yet lose it.
    """


def store_error(exc: rexc.RedisError, message: str) -> exceptions.StoreError:
    """``exc`` as the package's error, with ``message`` (secrets already blanked)."""
    transient = isinstance(exc, TRANSIENT) or (
        isinstance(exc, rexc.ResponseError) and str(exc).startswith(TRANSIENT_REPLIES)
    )
    error = exceptions.StoreUnavailable if transient else exceptions.StoreError
    return error(message)
