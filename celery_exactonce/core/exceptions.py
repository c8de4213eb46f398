"""The error tree of celery-exactonce.

Every error the package raises on purpose derives from :class:`ExactOnceError`,
so callers can catch the package's errors in one place. Driver errors (redis,
psycopg, PyMySQL, sqlite3) never leak out of a store: they are wrapped at the
store boundary into :class:`StoreError` or, when retrying may help,
:class:`StoreUnavailable`.
"""

from __future__ import annotations


class ExactOnceError(Exception):
    """A celery-exactonce error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip().splitlines()[0])


class ConfigurationError(ExactOnceError):
    """A setting is missing, malformed or inconsistent with another setting.

    The message names the culprit: the ``exactonce_*`` setting, the store URL
    (with its credentials redacted) or the beat entry.
    """

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        self.setting = setting
        super().__init__(message)


class InvalidPayload(ExactOnceError, ValueError):
    """A job's arguments, options or identifiers cannot be stored.

    Raised before anything is written, so nothing partial is ever stored.
    """


class InvalidRequest(ExactOnceError, ValueError):
    """A request the protocol does not allow, built by code rather than from data.

    A transition the state table does not have, an effect set for the wrong
    target state, a job created in a state it cannot start in: a bug in the
    caller, raised before anything is written. What a user passes in (task
    names, arguments, options, ids) is refused with :class:`InvalidPayload`.
    """


class StoreError(ExactOnceError):
    """The job store failed an operation.

    The operation may or may not have applied when the error is raised after
    the request was sent; callers settle that by reading the record back (its
    ``rev`` is the op id of the write that produced it).
    """


class StoreUnavailable(StoreError):
    """The store could not be reached or did not answer in time (transient)."""


class SchemaMismatch(StoreError):
    """The store holds data of a newer, unknown schema or key-format version."""


class FormatTooNew(SchemaMismatch):
    """A record or message of a newer format than this version reads
    (:mod:`celery_exactonce.core.formats`): upgrade this process."""


class LeaseLost(ExactOnceError):
    """We no longer hold a lease we were working under.

    Raised inside a reconcile pass, which stops there (another reconciler
    owns the work now); a dispatch made under a lease that was lost answers
    ``LOST`` with this error.
    """


class SubmitAmbiguous(ExactOnceError):
    """A submit whose create may have applied: resubmit the same task_id.

    Attributes
    ----------
    task_id:
        The id to submit again; resubmitting it is safe (the store creates a
        job at most once per id).
    """

    def __init__(self, task_id: str, message: str | None = None) -> None:
        self.task_id = task_id
        super().__init__(
            message
            or f"submit of task_id {task_id!r} may or may not have been stored; "
            "resubmit the same task_id"
        )


class JobConflict(ExactOnceError):
    """A ``task_id`` that exists already, for another task or another payload."""
