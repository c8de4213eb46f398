"""Publishing a job's message through Celery, and telling a failed publish definite or not.

:class:`CeleryPublisher` is what :class:`~celery_exactonce.dispatch.dispatcher.Dispatcher`
publishes through: Celery's ``send_task`` on a producer of the app's pool, with
kombu's publish retry off, batched where the transport batches. A failure is
:class:`PublishFailed`, *definite* only when nothing can have been sent
(:func:`connection_refused`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from kombu.exceptions import LimitExceeded, OperationalError

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.payload import decode_payload
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.capture import (
    PUSH_COMMANDS,
    Captured,
    Captures,
    KeptProducer,
    Prepared,
    Where,
    push,
)
from celery_exactonce.dispatch.messages import CALL_OPTIONS, INTERNAL_OPTIONS, check_options
from celery_exactonce.observe import metrics, traces

#: Transport commands a publish batch may buffer before kombu flushes it by itself:
#: far above a chunk's (a message is one to a few), so only :meth:`CeleryPublisher.flush`
#: sends, and a failure is known to concern exactly the chunk.
PUBLISH_BUFFER_MAX = 100_000


class PublishFailed(Exception):
    """A publish that did not (certainly) reach the broker."""

    def __init__(self, message: str, *, definite: bool, permanent: bool = False) -> None:
        super().__init__(message)
        self.definite = definite
        self.permanent = permanent


class Publisher(Protocol):
    """Sends one job's message; returns what the caller may hand on (``send_task``'s result).

    ``extra`` holds options of this publish only (:data:`CALL_OPTIONS` among them).
    Raises :class:`PublishFailed` on failure.
    """

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> Any: ...


def _reached_the_transport(exc: BaseException) -> bool:
    """Whether ``exc`` was raised once kombu was handing the message over (``Producer._publish``).

    An error raised before that (Celery building the message, a keyword
    ``send_task`` refuses) cannot have sent anything.
    """
    messaging = os.path.join("kombu", "messaging.py")
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_publish" and code.co_filename.endswith(messaging):
            return True
        tb = tb.tb_next
    return False


def connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a refused or unresolvable connect.

    Only such a failure proves that nothing was sent; every other publish
    error may have left a message on the broker.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionRefusedError, socket.gaierror)):
            return True
        if isinstance(current, OSError) and current.errno == errno.ECONNREFUSED:
            return True
        if "Connection refused" in str(current) and "connecting to" in str(current):
            return True  # redis-py's connect error, which keeps no errno
        current = current.__cause__ or current.__context__
    return False


class CeleryPublisher:
    """Publishes through the Celery app's producer pool, kombu's retry off.

    Inside :meth:`batch`, every publish of this thread goes through one
    producer, acquired and connection-checked once for the whole batch; where
    the transport batches publishes (kombu's ``Producer.batch``: the Redis
    transport pipelines them), messages are buffered until :meth:`flush`,
    which sends them in one round trip and says whether they landed. A
    publish outside a batch (one message: the SQL stores' one-write submit)
    is sent at once: kombu's Redis buffer is a pipeline of its own, dearer
    than the one command.
    ``timeout`` (``exactonce_publish_timeout``) bounds each publish where the
    transport supports it; one that times out counts as ambiguous.
    """

    def __init__(self, app: Any, *, timeout: float | None = None) -> None:
        self.app = app
        self.timeout = timeout
        self._local = threading.local()
        self._captures = Captures(app)
        #: ``broker_pool_acquire_timeout``, read once: a lookup in Celery's settings costs
        #: as much as a tenth of a gated submit's own work.
        self._acquire_timeout = app.conf.get("broker_pool_acquire_timeout")

    @contextlib.contextmanager
    def batch(self, *, buffered: bool = True) -> Iterator[None]:
        """Publish the calls made inside on one producer from the pool.

        Messages still buffered at the end are flushed (:class:`PublishFailed`
        if that fails), or discarded, never half-sent, if the block raised.
        Not ``buffered``: each one is sent as it is published.
        """
        local = self._local
        if getattr(local, "producer", None) is not None:
            yield  # nested: the outer batch's producer serves
            return
        with self._acquire() as producer:
            local.producer, local.checked, local.connect_error = producer, False, None
            local.buffer, local.buffered = None, buffered
            try:
                yield
                self.flush()
            finally:
                buffer, local.buffer = local.buffer, None
                local.producer = local.connect_error = None
                if buffer is not None:
                    error = RuntimeError("publish batch abandoned")
                    buffer.__exit__(RuntimeError, error, None)  # discards

    def _acquire(self) -> Any:
        """A producer from the app's pool, as ``app.producer_or_acquire(None)`` takes one
        (but for its timeout, read when the publisher was made)."""
        timeout = self._acquire_timeout
        try:
            return self.app.producer_pool.acquire(block=True, timeout=timeout)
        except LimitExceeded as exc:  # as Celery says it
            raise OperationalError(
                f"Timed out waiting for a broker producer after {timeout}s: every one of "
                f"broker_pool_limit ({self.app.conf.broker_pool_limit}) is in use; raise "
                "broker_pool_limit or broker_pool_acquire_timeout"
            ) from exc

    def flush(self) -> None:
        """Send the messages this thread's batch buffered; :class:`PublishFailed` if not all did.

        Nothing buffered (no batch, or a transport that publishes at once): nothing to do.
        """
        local = self._local
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            return
        local.buffer = None
        try:
            buffer.__exit__(None, None, None)  # kombu flushes on a clean exit
        except Exception as exc:
            local.checked = False
            raise PublishFailed(
                f"batched publish failed: {exc}", definite=connection_refused(exc)
            ) from exc

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
        options = self.message_options(job, headers, extra)
        if getattr(self._local, "producer", None) is None:
            with self.batch(buffered=False):
                return self._publish(job, options)
        return self._publish(job, options)

    def message_options(
        self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The ``send_task`` keywords of one publish of ``job`` (but those naming the job itself).

        :class:`PublishFailed` (definite, permanent) if the stored options cannot make one.
        """
        call = {name: extra[name] for name in CALL_OPTIONS.intersection(extra)}
        try:
            options = self._options(
                job, headers, {k: v for k, v in extra.items() if k not in CALL_OPTIONS}
            )
        except (TypeError, ValueError) as exc:  # before anything is sent
            raise PublishFailed(
                f"cannot build the message: {exc}", definite=True, permanent=True
            ) from exc
        options.update(call)
        options.setdefault("add_to_parent", False)  # only a submitting worker task has a parent
        return options

    def capturable(self) -> bool:
        """Whether :meth:`capture` may build a message here: ``False`` once this process
        found the broker is not a Redis it can capture for (decided at the first capture)."""
        return self._captures.possible(shared=True)

    def capture(
        self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any], where: Where
    ) -> Captured | None:
        """Build ``job``'s message as Celery and kombu would publish it, and send nothing.

        For a Redis broker that ``where`` (the store's ``shares_server``, or
        ``None``: anywhere) says suits: Celery's ``send_task`` runs on a
        producer whose channel collects kombu's final Redis commands (``LPUSH``
        of the encoded message to its routed, prioritised queue, and whatever
        else kombu's Redis transport would run for it) instead of sending them,
        so routing, priorities, encoding and headers are kombu's own.
        Queues and exchanges are declared as a publish declares them.

        ``None`` when the broker is not a plain Redis there (another
        transport, Sentinel, another host or a unix socket), when kombu's
        Redis transport cannot hand its commands over (before kombu 5.7), or
        when the message could not be built: the caller takes the general
        path, which reports any error.
        :class:`PublishFailed` (permanent) as :meth:`message_options`.
        """
        options = self.message_options(job, headers, extra)
        target = self._captures.take(where)
        if target is None:
            return None
        try:
            sent = self._send_task(job, target.producer, options)
        except Exception as exc:
            metrics.event(
                "enqueue_skipped",
                f"message of {job.ref} not built by capture ({exc}): general path",
                level=logging.DEBUG,
                job_id=job.ref.id,
                task=job.task,
            )
            return None
        finally:
            commands, target.channel.commands = target.channel.commands, []
            self._captures.give(target, where)
        if not commands or any(
            len(args) != 2 or name not in PUSH_COMMANDS for name, *args in commands
        ):
            return None
        pushed = tuple((name, target.prefix + str(key), value) for name, key, value in commands)
        return Captured(sent, target.db, pushed, target.client)

    def _options(
        self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The ``send_task`` options of one publish: stored ones decoded, ours added."""
        options = {k: v for k, v in {**job.options, **extra}.items() if k not in INTERNAL_OPTIONS}
        check_options(options, context=f"job {job.ref}")
        options = dict(decode_payload(options))
        options["headers"] = {**dict(options.get("headers") or {}), **headers}
        if job.deadline is not None:
            options["expires"] = job.deadline
        if job.run_at is not None:
            # The ``eta`` the job waited for in the store (it is due now): the worker
            # shows it as ``request.eta``, as it would the ETA of a plain message.
            options.setdefault("eta", job.run_at)
        if self.timeout is not None:
            options.setdefault("timeout", self.timeout)
        return options

    def prepare(
        self,
        job: Job,
        headers: Mapping[str, Any],
        extra: Mapping[str, Any],
        held: contextlib.ExitStack | None = None,
    ) -> Prepared:
        """Build ``job``'s message as :meth:`__call__` would; send nothing.

        On a plain Redis broker the message is captured (:meth:`capture`):
        :attr:`Prepared.send` sends kombu's commands as they are, on a
        connection of the capture's. Elsewhere ``send_task`` runs on a batch's
        producer (:meth:`batch`: the caller's, or one entered in ``held``,
        open until the message is sent) with its ``publish`` calls kept
        (:class:`KeptProducer`): all but the sending (routing, the message,
        its signals, the result) is done here; :attr:`Prepared.send` makes the
        calls (but declaring what is declared already).
        :class:`PublishFailed` (definite) as :meth:`__call__`.
        """
        if self._captures.possible(shared=False):
            captured = self.capture(job, headers, extra, None)
            if captured is not None:
                return Prepared(captured.sent, (), lambda: self._push(captured))
        if held is not None and getattr(self._local, "producer", None) is None:
            held.enter_context(self.batch(buffered=False))  # one message, sent at once
        options = self.message_options(job, headers, extra)
        kept = KeptProducer(self._connected())
        try:
            sent = self._send_task(job, kept, options)
        except Exception as exc:
            failed = self._failure(exc)
            raise PublishFailed(str(failed), definite=True, permanent=failed.permanent) from exc

        def send(producer: Any) -> Any:
            kept.replay(producer)
            return sent

        return Prepared(sent, tuple(kept.calls), lambda: self._publish_on(send))

    def _push(self, captured: Captured) -> Any:
        """Send a message :meth:`prepare` captured; ``send_task``'s result."""
        try:
            push(captured)
        except Exception as exc:
            raise PublishFailed(str(exc), definite=connection_refused(exc)) from exc
        return captured.sent

    def _connected(self) -> Any:
        """The batch's producer, its connection checked (kombu's retries off) before its first
        publish and after a failed one: a refused connection (:class:`PublishFailed`,
        definite) is told apart from a publish that may have landed."""
        local = self._local
        if not local.checked:
            local.connect_error, local.checked = self._connect(local.producer), True
        if local.connect_error is not None:
            error = local.connect_error
            raise PublishFailed(f"connect failed: {error}", definite=True) from error
        return local.producer

    def _publish(self, job: Job, options: dict[str, Any]) -> Any:
        """Send (or buffer) ``job``'s message on the batch's producer."""
        return self._publish_on(lambda producer: self._send_task(job, producer, options))

    def _publish_on(self, send: Callable[[Any], Any]) -> Any:
        """``send`` on the batch's producer (connected first), buffered where kombu batches."""
        local = self._local
        producer = self._connected()
        if local.buffer is None and local.buffered and hasattr(producer, "batch"):  # kombu 5.7
            buffer = producer.batch(max_size=PUBLISH_BUFFER_MAX)
            buffer.__enter__()
            local.buffer = buffer
        try:
            return send(producer)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> PublishFailed:
        """The :class:`PublishFailed` of a publish that raised ``exc`` (raise it ``from exc``).

        One that reached the transport may have landed, and the connection is
        checked again before the next publish; one raised before (Celery could
        not build the message from the stored job, or encode it) sent nothing,
        and no later try would build it either.
        """
        from kombu.exceptions import EncodeError

        if isinstance(exc, EncodeError):
            return PublishFailed(f"cannot encode: {exc}", definite=True, permanent=True)
        if isinstance(exc, (TypeError, ValueError)) and not _reached_the_transport(exc):
            built = f"cannot build the message: {type(exc).__name__}: {exc}"
            return PublishFailed(built, definite=True, permanent=True)
        self._local.checked = False
        return PublishFailed(str(exc), definite=connection_refused(exc))

    def _send_task(self, job: Job, producer: Any, options: Mapping[str, Any]) -> Any:
        """Celery's ``send_task`` of ``job`` on ``producer``, kombu's publish retry off.

        In the trace of the code that submitted the job, if it was in one
        (:func:`~celery_exactonce.observe.traces.publishing`).
        """
        key = (options.get("headers") or {}).get(messages.HEADER_IDEMPOTENCY_KEY)
        with traces.publishing(job, key):
            return self.app.send_task(
                job.task,
                args=decode_payload(job.args),
                kwargs=decode_payload(job.kwargs),
                task_id=messages.message_task_id(job),
                producer=producer,
                retries=job.attempt,
                retry=False,
                **options,
            )

    def expired(self, job: Job) -> None:
        """Record ``job``, past its deadline and never sent, as a worker records an expired message.

        The result becomes ``REVOKED`` (``TaskRevokedError('expired')``), so a
        caller waiting on it is answered as plain Celery answers it. Best
        effort: a result backend that fails is logged, the job is ``CANCELLED``.
        """
        if job.options.get("ignore_result"):
            return
        try:
            self.app.backend.mark_as_revoked(messages.message_task_id(job), "expired")
        except Exception as exc:
            metrics.event(
                "result_write_failed",
                f"could not record the expiry of {job.ref} in the result backend: {exc}",
                level=logging.WARNING,
                job_id=job.ref.id,
                task=job.task,
            )

    @staticmethod
    def _connect(producer: Any) -> Exception | None:
        """Connect ``producer`` without kombu's retries; the error if that failed."""
        try:
            producer.connection.ensure_connection(max_retries=0)
        except Exception as exc:
            return exc
        return None
