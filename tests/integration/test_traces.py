"""Traces across the store: a delayed job's trace goes from its caller to the body, through beat.

A real (in-process) worker and a beat thread on the Redis broker and store,
Celery's OpenTelemetry instrumentation, and the SDK's in-memory exporter:
every span of the run (the caller's, ours, the instrumentation's publish and
run spans, the body's) lands in one exporter, whichever thread made it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_exactonce import ExactOnceTask, runtime
from tests import services
from tests.integration.test_gate import beat_thread
from tests.support.helpers import poll

otel_trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
celery_instrumentation = pytest.importorskip("opentelemetry.instrumentation.celery")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402

EXPORTER = in_memory.InMemorySpanExporter()
RAN: dict[str, int] = {}
#: The idempotency key each label's body saw.
KEYS: dict[str, str] = {}
LOCK = threading.Lock()


def tracer_provider() -> Any:
    """This process's tracer provider, ours (set once: OpenTelemetry keeps the first)."""
    provider = otel_trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        otel_trace.set_tracer_provider(provider)
    return otel_trace.get_tracer_provider()


def make_app() -> Celery:
    uid = uuid.uuid4().hex[:8]
    app = Celery("traces", broker=services.REDIS_URL, set_as_current=False)
    app.conf.update(
        exactonce_store_url=services.REDIS_URL,
        exactonce_namespace=f"traces-{uid}",
        exactonce_tick_interval=0.1,
        task_default_queue=f"traces-{uid}",
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_transport_options={"global_keyprefix": f"traces-{uid}:"},
        beat_schedule={
            "every-second": {"task": "t.traced", "schedule": 1.0, "args": ("beat",)},
        },
    )

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.traced")
    def traced(self: Any, label: str) -> None:
        with otel_trace.get_tracer("tests").start_as_current_span("body"), LOCK:
            RAN[label] = RAN.get(label, 0) + 1
            KEYS[label] = self.request.idempotency_key

    return app


@pytest.fixture(scope="module")
def traced_app() -> Iterator[Celery]:
    services.need("redis")
    provider = tracer_provider()
    instrumentor = celery_instrumentation.CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    app = make_app()
    try:
        with (
            start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10),
            beat_thread(app),
        ):
            yield app
    finally:
        instrumentor.uninstrument()
        store = runtime.runtime_for(app).store
        store.drop_namespace()  # type: ignore[attr-defined]
        runtime.reset(app)
        services.delete_redis_keys(services.REDIS_URL, f"{app.conf.task_default_queue}*")


def spans_of(trace_id: int) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for span in EXPORTER.get_finished_spans():
        if span.context.trace_id == trace_id:
            found.setdefault(span.name, []).append(span)
    return found


def parent(span: Any, spans: dict[str, list[Any]]) -> str | None:
    """The name of ``span``'s parent among ``spans`` (``None``: a root, or not among them)."""
    if span.parent is None:
        return None
    for name, named in spans.items():
        if any(s.context.span_id == span.parent.span_id for s in named):
            return name
    return None


@pytest.mark.timeout(60)
def test_a_delayed_jobs_trace_goes_from_its_caller_through_beats_sweep_to_the_body(
    traced_app: Celery,
) -> None:
    # Given a caller in a trace of its own
    label = f"delayed-{uuid.uuid4().hex[:6]}"
    tracer = otel_trace.get_tracer("tests")
    with tracer.start_as_current_span("caller") as caller:
        # When it submits a gated task with a countdown (the job waits in the store;
        # beat's sweep publishes it when due, in another thread, with no trace of its own)
        result = traced_app.tasks["t.traced"].apply_async((label,), countdown=1)
    poll(lambda: RAN.get(label) == 1, timeout=30)

    # Then one trace goes from the caller to the body's span in the worker
    def complete() -> dict[str, list[Any]] | None:  # the run's span ends after the body's
        spans = spans_of(caller.get_span_context().trace_id)
        return spans if {"body", "run/t.traced", "exactonce.gate"} <= set(spans) else None

    spans = poll(complete, timeout=10)
    chain = {name: parent(named[0], spans) for name, named in spans.items()}
    assert chain["exactonce.submit"] == "caller"
    # ... the sweep's publish, restored in the submit's context, an hour (a second) later
    assert chain["exactonce.dispatch"] == "exactonce.submit"
    assert chain["apply_async/t.traced"] == "exactonce.dispatch"
    assert chain["run/t.traced"] == "apply_async/t.traced"
    assert chain["exactonce.gate"] == "run/t.traced"
    assert chain["body"] == "run/t.traced"
    dispatch = spans["exactonce.dispatch"][0]
    assert dispatch.attributes["exactonce.job_id"] == result.id
    assert dispatch.attributes["exactonce.attempt"] == 0
    assert dispatch.attributes["exactonce.idempotency_key"] == KEYS[label]
    assert spans["exactonce.gate"][0].attributes["exactonce.job_id"] == result.id


@pytest.mark.timeout(60)
def test_a_beat_occurrence_is_the_root_of_its_trace_with_its_entry_and_fire_time(
    traced_app: Celery,
) -> None:
    # Given beat's entry every second, run by the worker
    poll(lambda: RAN.get("beat", 0) >= 1, timeout=30)

    # Then each occurrence's dispatch starts a trace of its own, which the run continues
    def occurrence() -> Any:
        for span in EXPORTER.get_finished_spans():
            if span.name == "exactonce.dispatch" and span.attributes.get("exactonce.entry"):
                spans = spans_of(span.context.trace_id)
                if {"body", "run/t.traced"} <= set(spans):  # the run's span ends last
                    return span, spans
        return None

    dispatch, spans = poll(occurrence, timeout=20)
    assert dispatch.parent is None  # a root: beat's tick is no one's child
    assert dispatch.attributes["exactonce.entry"] == "every-second"
    fire_time = dispatch.attributes["exactonce.fire_time"]
    assert fire_time.endswith("+00:00") and fire_time[:4].isdigit()
    assert dispatch.attributes["celery.task_name"] == "t.traced"
    assert parent(spans["run/t.traced"][0], spans) == "apply_async/t.traced"
    assert parent(spans["apply_async/t.traced"][0], spans) == "exactonce.dispatch"
    # ... and beat's claim of the slot is a trace of its own, too
    claims = [s for s in EXPORTER.get_finished_spans() if s.name == "exactonce.claim"]
    assert claims and all(s.parent is None and s.attributes["exactonce.jobs"] >= 1 for s in claims)
