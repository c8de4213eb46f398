"""OpenTelemetry traces across the store: a job's trace goes on from where it was submitted.

With ``opentelemetry-api`` installed (and a tracer provider set up by the
application, as ``opentelemetry-instrumentation-celery`` expects), a job keeps
the trace context of the code that submitted it: :func:`capture` writes the
current context (W3C ``traceparent``/``tracestate``) into the job's stored
options at submit, under :data:`TRACE_OPTION`, and :func:`publishing` makes
it the current context again around the publish, wherever and whenever that
happens (the caller's own process, beat's sweep of a delayed job an hour
later, the reconciler's replay, a retry's next attempt). Celery's
instrumentation then makes its publish span a child of the submitter's span
and carries it in the message; the worker's run span, and the body's own
spans, continue the same trace. A beat occurrence has no submitter: its
dispatch span is the root of a trace of its own, with the entry and the fire
time as attributes.

Our own spans (:func:`span`): ``exactonce.submit``, ``exactonce.claim``,
``exactonce.dispatch`` and ``exactonce.gate``, with the job id, the
idempotency key, the attempt, and for an occurrence the entry and fire time
(:data:`ATTRIBUTES`). Without ``opentelemetry-api``, or with it and no tracer
provider set up, every function here is a no-op costing a flag test (and an
``isinstance``); without it nothing imports it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import Any

#: Stored job option (never published as an option): the submitter's trace context.
TRACE_OPTION = "exactonce_trace"

#: The span attributes we set, by the name of :func:`span`'s keyword.
ATTRIBUTES = {
    "job_id": "exactonce.job_id",
    "idempotency_key": "exactonce.idempotency_key",
    "attempt": "exactonce.attempt",
    "entry": "exactonce.entry",
    "fire_time": "exactonce.fire_time",
    "task": "celery.task_name",
    "jobs": "exactonce.jobs",
}

_api: Any = None
_checked = False
#: The tracer providers that record nothing: the API's stand-in before an application
#: sets one, and the no-op one. With either, nothing here does any work.
_inert: tuple[type, ...] = ()
_tracer: Any = None
#: Whether the environment names a tracer provider for the API to load when first asked.
_from_environment = False
_UNREAD = object()


def _opentelemetry() -> Any:
    """The ``opentelemetry`` API modules (``trace``, ``propagate``, ``context``), or ``None``."""
    global _api, _checked, _inert, _from_environment  # noqa: PLW0603  (one answer per process)
    if not _checked:
        if importlib.util.find_spec("opentelemetry") is not None:
            try:
                from opentelemetry import context, propagate, trace

                _api = (trace, propagate, context)
                _inert = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
                _from_environment = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
            except ImportError:  # a namespace package without the API
                _api = None
        _checked = True
    return _api


def _tracing() -> Any:
    """The API modules where this process records spans (a tracer provider is set), or ``None``.

    Many packages depend on ``opentelemetry-api``: installed with no provider set
    up, it costs a flag test and an ``isinstance``, not a span per call.
    """
    api = _opentelemetry()
    if api is None:
        return None
    # The provider the API holds once one is set (None before): read as is, it spares the
    # API's look-up of its environment variable at every call, unless that variable names
    # a provider for the API to load.
    provider = getattr(api[0], "_TRACER_PROVIDER", _UNREAD)
    if provider is None and not _from_environment:
        return None
    if provider is _UNREAD or provider is None:
        provider = api[0].get_tracer_provider()
    return None if isinstance(provider, _inert) else api


def capture() -> dict[str, str] | None:
    """The current trace context as a carrier to store with a job; ``None`` outside a trace."""
    api = _tracing()
    if api is None:
        return None
    trace, propagate, _ = api
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def restored(carrier: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[None]:
    """The context stored in ``carrier`` is the current one inside (nothing without one)."""
    api = _tracing()
    if api is None or not carrier:
        return contextlib.nullcontext()
    return _attached(api, carrier)


@contextlib.contextmanager
def _attached(api: Any, carrier: Mapping[str, Any]) -> Iterator[None]:
    _, propagate, context = api
    token = context.attach(propagate.extract(dict(carrier)))
    try:
        yield
    finally:
        context.detach(token)


def span(
    name: str, *, root: bool = False, **attributes: Any
) -> contextlib.AbstractContextManager[Any]:
    """A span ``name`` around the block (``root``: of a trace of its own), with
    :data:`ATTRIBUTES` set from ``attributes`` (``None`` values left out)."""
    global _tracer  # noqa: PLW0603  (one per process: the API's tracer follows its provider)
    api = _tracing()
    if api is None:
        return contextlib.nullcontext()
    trace, _, context = api
    values = {
        ATTRIBUTES.get(key, f"exactonce.{key}"): value
        if isinstance(value, (bool, int, float))
        else str(value)
        for key, value in attributes.items()
        if value is not None
    }
    if _tracer is None:
        _tracer = trace.get_tracer("celery_exactonce")
    start = context.Context() if root else None
    # An exception through our spans is not theirs to mark (a duplicate's Ignore, a retry).
    return _tracer.start_as_current_span(  # type: ignore[no-any-return]
        name,
        context=start,
        attributes=values,
        record_exception=False,
        set_status_on_exception=False,
    )


def publishing(job: Any, key: str | None) -> contextlib.AbstractContextManager[Any]:
    """Around the publish of ``job``: its submitter's context, and an ``exactonce.dispatch``
    span in it (an occurrence's: the root of its own trace, with the entry and fire time)."""
    if _tracing() is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    carrier = job.options.get(TRACE_OPTION)
    stack.enter_context(restored(carrier))
    stack.enter_context(
        span(
            "exactonce.dispatch",
            root=carrier is None and job.entry is not None,
            job_id=job.ref.id,
            task=job.task,
            attempt=job.attempt,
            idempotency_key=key,
            entry=job.entry,
            fire_time=None if job.fire_time is None else job.fire_time.isoformat(),
        )
    )
    return stack
