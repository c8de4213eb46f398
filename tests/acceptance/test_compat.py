"""The same Celery scenarios with Celery's ``Task`` and with ``ExactOnceTask`` as ``task_cls``.

Each scenario is a plain function ``scenario(app) -> outcome`` that sends tasks
of ``apps/compat_app.py`` through a real prefork ``celery worker`` (Redis broker,
Redis result backend) and returns what could be observed: results, states, body
runs, exception types, what the bodies received. It runs once on a deployment
whose app has Celery's ``Task`` as ``task_cls`` and once on one whose app has
``ExactOnceTask`` (with a ``celery beat -S exactonce`` node, which dispatches the
delayed jobs: countdowns, etas, retries with a countdown), both at the same time;
the two outcomes must be equal. The scenarios whose outcome the broker decides
(:data:`BROKER_SPECIFIC`) run on RabbitMQ too.

The exceptions are :data:`DIFFERENCES`, the documented differences of
``ExactOnceTask`` (``docs/reference/differences.md``): for those the exactonce
outcome must be the documented one, and the plain one must differ from it (an
entry whose difference has gone must leave the table).

The deployments start once per module (a worker per variant, plus the beat), not
per scenario; every wait has a deadline, and an outcome that did not come in time
is part of the outcome (``{"timed_out": …}``), so that a variant that hangs fails
its comparison instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery, chain, chord, group, states
from celery.exceptions import TimeoutError as CeleryTimeoutError

from tests import services
from tests.acceptance.apps import compat_app
from tests.acceptance.harness import (
    REDIS_BROKER_DB,
    BeatProcess,
    WorkerProcess,
    holds,
    poll,
    process_env,
)

APP_MODULE = "tests.acceptance.apps.compat_app"

#: The Redis database of the result backend and of the bodies' own keys (never
#: flushed: every key of a deployment has its prefix, and is deleted with it).
RESULT_DB = int(os.environ.get("EXACTONCE_ACC_RESULT_REDIS_DB", "12"))

#: Pool processes per worker: a chord's header and body, a parent and its children.
CONCURRENCY = 4

#: How long a result that plain Celery has within a second may take.
TIMEOUT = 10.0
#: How long a result may take that comes through countdowns (retries, eta).
DELAYED_TIMEOUT = 20.0
#: How long an ignored result's ``get`` may take (plain Celery returns at once).
IGNORED_TIMEOUT = 2.0
#: How long a count or an errback that plain Celery has within a second may take.
SHORT_TIMEOUT = 3.0
#: How long a count must stay as it is to be the count ("nothing more happens").
QUIET = 0.5
#: How long after a countdown a delayed job has run for sure: beat sweeps delayed jobs
#: every ``exactonce_tick_interval`` (1 s), then the worker receives the message.
SWEEP_MARGIN = 2.5
#: How long one scenario may take on one variant, whatever it waits for.
SCENARIO_TIMEOUT = 120.0

Outcome = Any
Scenario = Callable[[Celery], Outcome]


# --- the two deployments ------------------------------------------------------------------


def _redis_url(db: int) -> str:
    parts = urlsplit(services.REDIS_URL)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", "", ""))


class Variant:
    """One ``task_cls``'s deployment: a worker (and, for ``exactonce``, a beat), its queue,
    its Redis keys and store namespace, and the in-process app that sends.

    Its scenarios run in one thread of its own (:meth:`run`): the result backend of
    an app is per thread, and a scenario subscribes and waits on the same one.
    """

    def __init__(self, kind: str, broker: str, directory: Path) -> None:
        self.kind = kind
        self.broker = broker
        self.directory = directory
        self.uid = uuid.uuid4().hex[:10]
        self.queue = f"compat-{kind}-{self.uid}"
        self.prefix = f"compat-{self.uid}:"
        self.namespace = f"compat-{self.uid}"
        self.broker_url = _redis_url(REDIS_BROKER_DB) if broker == "redis" else services.AMQP_URL
        self.result_url = _redis_url(RESULT_DB)
        self.store_url = services.REDIS_URL
        self.worker: WorkerProcess | None = None
        self.beat: BeatProcess | None = None
        self.app = compat_app.make_app(self.env, set_as_current=False)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"compat-{kind}")

    def __repr__(self) -> str:
        return f"<Variant {self.kind} on {self.broker} queue={self.queue}>"

    @property
    def env(self) -> dict[str, str]:
        """The environment of its worker and beat (and of its in-process app)."""
        return process_env(
            EXACTONCE_ACC_TASK_CLS=self.kind,
            EXACTONCE_ACC_BROKER_URL=self.broker_url,
            EXACTONCE_ACC_QUEUE=self.queue,
            EXACTONCE_ACC_RESULT_BACKEND=self.result_url,
            EXACTONCE_ACC_REDIS_PREFIX=self.prefix,
            EXACTONCE_ACC_STORE_URL=self.store_url,
            EXACTONCE_ACC_NAMESPACE=self.namespace,
        )

    def start(self) -> None:
        """Start the worker (and the beat) without waiting: :meth:`wait_ready` waits."""
        if self.kind == "exactonce":
            from celery_exactonce import runtime

            runtime.runtime_for(self.app)  # the store's schema exists before a gate runs
        with self.app.connection_for_write() as conn:  # the queue exists before a publish
            self.app.amqp.queues[self.queue](conn.default_channel).declare()
        self.worker = WorkerProcess(
            self.env,
            self.directory / f"{self.kind}-worker.log",
            queue=self.queue,
            concurrency=CONCURRENCY,
            name=f"compat-{self.kind}-{self.uid}",
            app_module=APP_MODULE,
        ).start()
        if self.kind == "exactonce":
            self.beat = BeatProcess(
                self.env, self.directory, f"{self.kind}-beat", app_module=APP_MODULE
            ).start()

    def wait_ready(self) -> None:
        assert self.worker is not None
        self.worker.wait_ready()
        if self.beat is not None:
            self.beat.wait_ready()

    def run(self, scenario: Scenario) -> Any:
        """A future of the scenario's outcome, run in this variant's thread.

        An exception the scenario did not expect is its outcome too
        (``{"scenario raised": …}``): the other variant's outcome still shows.
        """

        def outcome() -> Outcome:
            try:
                return scenario(self.app)
            except Exception as exc:
                return {"scenario raised": f"{type(exc).__name__}: {exc}"}

        return self.executor.submit(outcome)

    def logs(self, lines: int = 60) -> str:
        processes: list[WorkerProcess | BeatProcess | None] = [self.worker, self.beat]
        return "\n".join(
            f"--- {self.kind} {type(p).__name__}\n{p.log_tail(lines)}" for p in processes if p
        )

    def _release_backend(self) -> None:
        """Close what the app's result backend holds in this thread (its own, per thread)."""
        backend = self.app.backend
        backend.result_consumer.stop()
        # An AsyncResult collected later unsubscribes from what it waited on: with nothing
        # subscribed it does not open the pubsub connection again.
        backend.result_consumer.subscribed_to.clear()
        backend.client.connection_pool.disconnect()

    def close(self) -> None:
        """Kill its processes; delete its queue, Redis keys and store namespace; close the
        app's connections."""
        for process in (self.beat, self.worker):
            if process is not None:
                with contextlib.suppress(Exception):
                    process.kill()
        with contextlib.suppress(Exception):  # a scenario still running: its own deadlines
            self.executor.submit(self._release_backend).result(timeout=SCENARIO_TIMEOUT)
        self.executor.shutdown(wait=False, cancel_futures=True)
        urls = [self.result_url] + ([self.broker_url] if self.broker == "redis" else [])
        for url in urls:
            services.delete_redis_keys(url, f"{self.prefix}*")
        if self.broker != "redis":
            with self.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(self.queue)
                conn.default_channel.exchange_delete(self.queue)
        from celery_exactonce import runtime

        if self.kind == "exactonce":
            runtime.runtime_for(self.app).store.drop_namespace()
        runtime.reset(self.app)
        # Not the broker pools: kombu shares them between every app of one broker URL in
        # the process (the other acceptance tests' apps among them).
        self.app.close()


def start_variants(broker: str, directory: Path) -> Iterator[dict[str, Variant]]:
    """Both variants on ``broker``, started side by side; closed after the module."""
    for service in ("redis", {"redis": None, "amqp": "rabbitmq"}[broker]):
        if service is not None:
            services.need(service)
    variants = {kind: Variant(kind, broker, directory) for kind in compat_app.TASK_CLASSES}
    try:
        for variant in variants.values():
            variant.start()
        for variant in variants.values():
            variant.wait_ready()
        yield variants
    finally:
        errors = []
        for variant in variants.values():
            try:
                variant.close()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        compat_app.close_clients()
        if errors:
            raise errors[0]


@pytest.fixture(scope="module")
def redis_variants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Variant]]:
    """The plain and the exactonce deployment on a Redis broker."""
    yield from start_variants("redis", tmp_path_factory.mktemp("compat-redis"))


@pytest.fixture(scope="module")
def amqp_variants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Variant]]:
    """The plain and the exactonce deployment on RabbitMQ (the broker-specific scenarios)."""
    yield from start_variants("amqp", tmp_path_factory.mktemp("compat-amqp"))


# --- what a scenario observes -------------------------------------------------------------


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


def task(app: Celery, name: str) -> Any:
    return app.tasks[f"compat.{name}"]


def settle(result: Any, timeout: float = TIMEOUT) -> Outcome:
    """``{"value": …}``, ``{"raised": <exception type>}`` or ``{"timed_out": <state>}``."""
    try:
        value = result.get(timeout=timeout)
    except CeleryTimeoutError:
        return {"timed_out": getattr(result, "state", None)}
    except Exception as exc:
        return {"raised": type(exc).__name__}
    return {"value": value}


def settle_once_ready(app: Celery, result: Any, timeout: float = TIMEOUT) -> Outcome:
    """:func:`settle` once the result backend holds the task's outcome.

    For a chord whose header failed: ``get`` raises a failed parent's error first,
    and the body may not be marked failed yet when it does.
    """
    final_state(app, result.id, tuple(states.READY_STATES), timeout=timeout)
    return settle(result, timeout=1.0)


def raised(call: Callable[[], object]) -> str | None:
    """The type of the exception ``call()`` raised, or ``None``."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return None


def settled_runs(app: Celery, tag: str, expect: int, timeout: float = SHORT_TIMEOUT) -> int:
    """Body runs under ``tag`` once ``expect`` is reached (or ``timeout`` passed) and the
    count stayed for :data:`QUIET` seconds (a count still growing ``timeout`` later is
    taken as it is then)."""
    with contextlib.suppress(AssertionError):
        poll(lambda: compat_app.runs(app, tag) >= expect, timeout=timeout, interval=0.05)
    deadline = time.monotonic() + timeout
    while True:
        count = compat_app.runs(app, tag)
        try:
            holds(lambda count=count: compat_app.runs(app, tag) == count, seconds=QUIET)
        except AssertionError:
            if time.monotonic() < deadline:
                continue
        return count


def runs_while(app: Celery, tag: str, seconds: float) -> int:
    """Body runs under ``tag``, watched for ``seconds``: the count once it changed, or at
    the end (for a job that falls due within them)."""
    before = compat_app.runs(app, tag)
    with contextlib.suppress(AssertionError):
        holds(lambda: compat_app.runs(app, tag) == before, seconds=seconds)
    return compat_app.runs(app, tag)


def noted(app: Celery, tag: str, at_least: int = 1, timeout: float = SHORT_TIMEOUT) -> Outcome:
    """The notes of ``tag`` once there are ``at_least``; ``{"timed_out": notes}`` if not."""
    try:
        return poll(
            lambda: (found := compat_app.notes(app, tag)) and len(found) >= at_least and found,
            timeout=timeout,
            interval=0.05,
        )
    except AssertionError:
        return {"timed_out": compat_app.notes(app, tag)}


def stored(app: Celery, task_id: str) -> bool:
    """Whether the app's store has a job of ``task_id`` (never, for plain Celery)."""
    from celery_exactonce import runtime
    from celery_exactonce.core.refs import JobRef

    return runtime.runtime_for(app).store.get(JobRef.submitted(task_id)) is not None


def final_state(app: Celery, task_id: str, states: tuple[str, ...], timeout: float) -> str:
    """The result backend's state of ``task_id`` once it is one of ``states`` (or at the
    deadline)."""
    result = app.AsyncResult(task_id)
    with contextlib.suppress(AssertionError):
        poll(lambda: result.state in states, timeout=timeout, interval=0.1)
    return str(result.state)


def errback_notes(found: Outcome, **task_ids: str) -> Outcome:
    """Errback notes with the ``task_id`` each saw named (``task_ids``: name → id)."""
    if not isinstance(found, list):
        return found
    names = {task_id: name for name, task_id in task_ids.items()}
    described = [
        {**entry, "task_id": names.get(entry.get("task_id"), "another id")}
        if "task_id" in entry
        else entry
        for entry in found
    ]
    return sorted(described, key=repr)


# --- the scenarios ------------------------------------------------------------------------

SCENARIOS: dict[str, Scenario] = {}
#: Scenarios that need what the environment may lack: name → why not, or ``None``.
REQUIRES: dict[str, Callable[[], str | None]] = {}


def scenario(
    name: str, requires: Callable[[], str | None] | None = None
) -> Callable[[Scenario], Scenario]:
    """Register a scenario under its stable name (the differences page names it)."""

    def register(fun: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"two scenarios named {name!r}")
        SCENARIOS[name] = fun
        if requires is not None:
            REQUIRES[name] = requires
        return fun

    return register


# 1. canvas, retries, revoke, expires


@scenario("chain_of_three")
def chain_of_three(app: Celery) -> Outcome:
    add, mul = task(app, "add"), task(app, "mul")
    result = chain(add.s(1, 2), add.s(3), mul.s(10)).apply_async()
    return {
        "last": settle(result),
        "middle": settle(result.parent),
        "first": settle(result.parent.parent),
    }


@scenario("group_of_four")
def group_of_four(app: Celery) -> Outcome:
    add = task(app, "add")
    result = group(add.s(i, i) for i in range(4)).apply_async()
    return {"group": settle(result), "states": [child.state for child in result.results]}


@scenario("chord_with_header_and_body")
def chord_with_header_and_body(app: Celery) -> Outcome:
    add, tsum = task(app, "add"), task(app, "tsum")
    result = chord(add.s(i, i) for i in range(4))(tsum.s())
    return {"body": settle(result), "header": settle(result.parent)}


@scenario("chain_inside_chord")
def chain_inside_chord(app: Celery) -> Outcome:
    add, mul, tsum = task(app, "add"), task(app, "mul"), task(app, "tsum")
    result = chord([chain(add.s(1, 1), mul.s(3)), add.s(2, 2)])(tsum.s())
    return {"body": settle(result), "header": settle(result.parent)}


@scenario("retry_with_countdown_until_it_succeeds")
def retry_with_countdown_until_it_succeeds(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "retry_until").delay(tag, 2)
    return {
        "result": settle(result, DELAYED_TIMEOUT),
        "runs": settled_runs(app, tag, expect=3),
    }


@scenario("retry_past_max_retries")
def retry_past_max_retries(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "retry_forever").delay(tag)
    return {
        "result": settle(result, DELAYED_TIMEOUT),
        "state": result.state,
        "runs": settled_runs(app, tag, expect=3),
    }


@scenario("autoretry_for")
def autoretry_for(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "autoretry").delay(tag, 2)
    return {
        "result": settle(result, DELAYED_TIMEOUT),
        "runs": settled_runs(app, tag, expect=3),
    }


@scenario("revoke_before_run")
def revoke_before_run(app: Celery) -> Outcome:
    tag, countdown = new_tag(), 2.0
    result = task(app, "count").apply_async((tag, 1), countdown=countdown)
    result.revoke()
    state = final_state(app, result.id, ("REVOKED", "SUCCESS"), timeout=TIMEOUT)
    return {
        "state": state,
        "result": settle(result, timeout=1.0),
        "runs once due": runs_while(app, tag, seconds=countdown + SWEEP_MARGIN),
        "state once due": app.AsyncResult(result.id).state,
    }


@scenario("expires_in_the_past")
def expires_in_the_past(app: Celery) -> Outcome:
    tag = new_tag()
    expired = datetime.now(timezone.utc) - timedelta(minutes=1)
    result = task(app, "count").apply_async((tag, 1), expires=expired)
    state = final_state(app, result.id, ("REVOKED", "SUCCESS"), timeout=TIMEOUT)
    return {
        "state": state,
        "result": settle(result, timeout=1.0),
        "runs": settled_runs(app, tag, expect=0),
    }


# 2. errbacks


@scenario("link_error_on_a_task")
def link_error_on_a_task(app: Celery) -> Outcome:
    tag = new_tag()
    errbacks = [task(app, "on_error").s(tag=tag), task(app, "on_error_id").s(tag=tag)]
    result = task(app, "fail").apply_async(("boom",), link_error=errbacks)
    return {
        "result": settle(result),
        "errbacks": errback_notes(noted(app, tag, at_least=2), failed=result.id),
    }


@scenario("errback_on_a_chord_body")
def errback_on_a_chord_body(app: Celery) -> Outcome:
    tag = new_tag()
    add, fail, tsum = task(app, "add"), task(app, "fail"), task(app, "tsum")
    body = tsum.s().on_error(task(app, "on_error").s(tag=tag))
    result = chord([add.si(1, 1), fail.si("boom")])(body)
    return {
        "body": settle_once_ready(app, result),
        "errbacks": errback_notes(noted(app, tag), body=result.id),
    }


@scenario("immutable_bytes_errback_on_a_chord_in_a_chain")
def immutable_bytes_errback_on_a_chord_in_a_chain(app: Celery) -> Outcome:
    tag = new_tag()
    add, fail, tsum = task(app, "add"), task(app, "fail"), task(app, "tsum")
    body = tsum.s().on_error(task(app, "on_error_bytes").si(tag.encode()))
    result = chain(add.si(2, 2), chord([add.si(1, 1), fail.si("boom")], body)).apply_async()
    found = noted(app, tag)
    if isinstance(found, list):  # the payload is the tag: name it
        as_bytes = ["bytes", tag.encode().hex()]
        found = [
            {**entry, "payload": "the tag, as bytes"} if entry.get("payload") == as_bytes else entry
            for entry in found
        ]
    return {"last": settle_once_ready(app, result), "errbacks": found}


@scenario("errback_on_a_group")
def errback_on_a_group(app: Celery) -> Outcome:
    tag = new_tag()
    add, fail = task(app, "add"), task(app, "fail")
    members = group(add.si(1, 1), fail.si("boom"), add.si(2, 2))
    members.link_error(task(app, "on_error").s(tag=tag))
    result = members.apply_async()
    outcome = settle(result)
    with contextlib.suppress(AssertionError):
        poll(lambda: all(child.ready() for child in result.results), timeout=TIMEOUT)
    return {
        "group": outcome,
        "states": [child.state for child in result.results],
        "errbacks": errback_notes(noted(app, tag), failed=result.results[1].id),
    }


# 3. what apply_async refuses before anything is sent


@scenario("wrong_arguments_refused_at_send")
def wrong_arguments_refused_at_send(app: Celery) -> Outcome:
    tag, task_id = new_tag(), str(uuid.uuid4())
    count = task(app, "count")
    return {
        "add.delay(5)": raised(lambda: task(app, "add").delay(5)),
        "count with three arguments": raised(
            lambda: count.apply_async((tag, 1, 2), task_id=task_id)
        ),
        "stored": stored(app, task_id),
        "runs": settled_runs(app, tag, expect=0),
    }


@scenario("soft_time_limit_above_time_limit_refused_at_send")
def soft_time_limit_above_time_limit_refused_at_send(app: Celery) -> Outcome:
    task_id = str(uuid.uuid4())
    return {
        "raised": raised(lambda: task(app, "bad_limits").apply_async(task_id=task_id)),
        "stored": stored(app, task_id),
    }


def _pydantic_missing() -> str | None:
    return None if compat_app.Order is not None else "pydantic is not installed"


@scenario("pydantic_model_argument", requires=_pydantic_missing)
def pydantic_model_argument(app: Celery) -> Outcome:
    assert compat_app.Order is not None
    order = compat_app.Order(item="tea", quantity=3, price=Decimal("2.50"))
    return {"result": settle(task(app, "order_total").delay(order))}


# 4. payload types kombu's JSON carries

TYPED_ARGS = (
    b"\x00\xffraw",
    datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc),
    datetime(2026, 1, 2, 3, 4, 5),  # naive
    uuid.UUID(int=42),
    Decimal("19.990"),
)
TYPED_KWARGS = {
    "raw": b"\x01bytes",
    "when": datetime(2030, 6, 7, 8, 9, 10, tzinfo=timezone(timedelta(hours=2))),
    "id": uuid.UUID(int=7),
    "amount": Decimal("0.10"),
    "nested": {"at": [datetime(2026, 1, 2), Decimal("1E+3")], "raw": [b"x"]},
}


@scenario("payload_types")
def payload_types(app: Celery) -> Outcome:
    """Typed arguments and keyword arguments of a task, and of its callback (``link``)."""
    tag = new_tag()
    typed = task(app, "typed")
    link = typed.s(*TYPED_ARGS, tag=tag, **TYPED_KWARGS)
    result = typed.apply_async(TYPED_ARGS, {"tag": new_tag(), **TYPED_KWARGS}, link=link)
    return {"body saw": settle(result), "link saw": noted(app, tag)}


@scenario("payload_types_in_errbacks")
def payload_types_in_errbacks(app: Celery) -> Outcome:
    """Typed arguments of an immutable errback (``link_error``), as its body receives them."""
    tag = new_tag()
    errback = task(app, "typed").si(*TYPED_ARGS, tag=tag, **TYPED_KWARGS)
    result = task(app, "fail").apply_async(("boom",), link_error=errback)
    return {"result": settle(result), "errback saw": noted(app, tag)}


# 5. results


@scenario("result_subscription_and_forget")
def result_subscription_and_forget(app: Celery) -> Outcome:
    result = task(app, "add").apply_async((2, 3))
    backend = app.backend
    key = backend.get_key_for_task(result.id)
    subscribed = key in backend.result_consumer.subscribed_to
    outcome = settle(result)
    state = result.state
    result.forget()
    return {
        "subscribed once sent": subscribed,
        "result": outcome,
        "state": state,
        "state once forgotten": app.AsyncResult(result.id).state,
        "subscribed once forgotten": key in backend.result_consumer.subscribed_to,
    }


@scenario("ignore_result_task_attribute")
def ignore_result_task_attribute(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "quiet").delay(tag)
    return {
        "ignored": result.ignored,
        "get": settle(result, timeout=IGNORED_TIMEOUT),
        "runs": settled_runs(app, tag, expect=1),
        "state": app.AsyncResult(result.id).state,
    }


@scenario("ignore_result_apply_async_option")
def ignore_result_apply_async_option(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "count").apply_async((tag, 7), ignore_result=True)
    return {
        "ignored": result.ignored,
        "get": settle(result, timeout=IGNORED_TIMEOUT),
        "runs": settled_runs(app, tag, expect=1),
        "state": app.AsyncResult(result.id).state,
    }


# 6. parents and children; a failing chord's graph


@scenario("add_to_parent_false")
def add_to_parent_false(app: Celery) -> Outcome:
    result = task(app, "spawn").delay()
    outcome = settle(result)
    if "value" not in outcome:
        return {"parent": outcome}
    names = {task_id: name for name, task_id in outcome["value"].items()}
    return {
        "parent": {"value": sorted(outcome["value"])},
        "children": [names.get(child.id, "another id") for child in result.children or []],
    }


@scenario("failing_chord_with_an_errback_on_its_body")
def failing_chord_with_an_errback_on_its_body(app: Celery) -> Outcome:
    tag = new_tag()
    add, fail, tsum = task(app, "add"), task(app, "fail"), task(app, "tsum")
    body = tsum.s().on_error(task(app, "on_error_id").s(tag=tag))
    result = chord([add.si(1, 1), fail.si("boom"), add.si(2, 2)])(body)
    outcome = settle_once_ready(app, result)
    header = result.parent
    with contextlib.suppress(AssertionError):
        poll(lambda: all(child.ready() for child in header.results), timeout=TIMEOUT)
    return {
        "body": outcome,
        "body state": result.state,
        "header states": [child.state for child in header.results],
        "errbacks": errback_notes(noted(app, tag), body=result.id),
        # What was published from inside the worker is added to a task's children
        # only as Celery adds it (never the errbacks and chord parts it sends itself).
        "children": [len(child.children or ()) for child in (*header.results, result)],
    }


# 7. Reject(requeue=True)


@scenario("reject_requeue")
def reject_requeue(app: Celery) -> Outcome:
    tag = new_tag()
    result = task(app, "reject_once").delay(tag)
    return {
        "result": settle(result),
        "runs": settled_runs(app, tag, expect=2),
        "seen": noted(app, tag, at_least=2, timeout=1.0),
    }


@scenario("reject_then_succeed")
def reject_then_succeed(app: Celery) -> Outcome:
    """Celery's own shape: reject until ``request.delivery_info['redelivered']``, then succeed.

    Before the fix, ExactOnceTask's requeued copy was a new message, not
    redelivered: the body rejected it again, and again, and never returned.
    """
    tag = new_tag()
    result = task(app, "reject_then_succeed").delay(tag)
    return {
        "result": settle(result),
        "runs": settled_runs(app, tag, expect=2),
        "seen": noted(app, tag, at_least=2, timeout=1.0),
    }


# 8. replace()


def _replaced(app: Celery, how: str, expect_probes: int) -> Outcome:
    tag = new_tag()
    result = task(app, "replacing").delay(1, how, tag=tag)
    return {
        "result": settle(result),
        "replacement saw": noted(app, tag, at_least=expect_probes),
    }


@scenario("replace_with_a_task")
def replace_with_a_task(app: Celery) -> Outcome:
    return _replaced(app, "task", 1)


@scenario("replace_with_a_chain")
def replace_with_a_chain(app: Celery) -> Outcome:
    return _replaced(app, "chain", 1)


@scenario("replace_with_a_group")
def replace_with_a_group(app: Celery) -> Outcome:
    return _replaced(app, "group", 2)


@scenario("chain_through_a_replacing_task")
def chain_through_a_replacing_task(app: Celery) -> Outcome:
    tag = new_tag()
    add, mul = task(app, "add"), task(app, "mul")
    replacing = task(app, "replacing").s("task", tag=tag)
    result = chain(add.s(1, 1), replacing, mul.s(10)).apply_async()
    return {"last": settle(result), "replacement saw": noted(app, tag)}


# 9. request.eta


@scenario("eta_seen_by_the_body")
def eta_seen_by_the_body(app: Celery) -> Outcome:
    countdown = 2.0
    requested = datetime.now(timezone.utc) + timedelta(seconds=countdown)
    outcome = settle(task(app, "eta_probe").apply_async(countdown=countdown), DELAYED_TIMEOUT)
    if "value" not in outcome:
        return outcome
    eta = outcome["value"]
    if eta is None:
        return {"eta": None}
    seen = datetime.fromisoformat(eta)
    seen = seen if seen.tzinfo else seen.replace(tzinfo=timezone.utc)
    return {
        "eta": "set",
        "within 1 s of the requested time": abs(seen - requested).total_seconds() < 1,
    }


# 10. one task id, applied twice


@scenario("frozen_signature_reapplied")
def frozen_signature_reapplied(app: Celery) -> Outcome:
    tag = new_tag()
    signature = task(app, "count").s(tag, 1)
    signature.freeze()
    first = signature.apply_async()
    second = signature.apply_async()
    return {
        "same task id": first.id == second.id,
        "first": settle(first),
        "second": settle(second),
        "runs": settled_runs(app, tag, expect=2),
    }


@scenario("frozen_chord_reapplied")
def frozen_chord_reapplied(app: Celery) -> Outcome:
    """A frozen chord applied again once the first application completed."""
    tag = new_tag()
    count, tsum = task(app, "count"), task(app, "tsum")
    frozen = chord([count.s(tag, 1), count.s(tag, 2)], tsum.s())
    frozen.freeze()
    first = frozen.apply_async()
    first_outcome = settle(first)
    second = frozen.apply_async()
    return {
        "same ids": first.id == second.id,
        "first": first_outcome,
        "second": settle(second),
        "header runs": settled_runs(app, tag, expect=4),
    }


@scenario("frozen_chain_in_two_chords")
def frozen_chain_in_two_chords(app: Celery) -> Outcome:
    """One frozen chain as a part of two chords, the second sent once the first completed."""
    tag = new_tag()
    add, count, mul, tsum = (task(app, name) for name in ("add", "count", "mul", "tsum"))
    part = chain(count.s(tag, 1), mul.s(3))
    part.freeze()
    first = chord([part, add.si(2, 2)])(tsum.s())
    first_outcome = settle(first)
    try:
        second = chord([part, add.si(3, 3)])(tsum.s())
    except Exception as exc:
        second_outcome = {"raised at send": type(exc).__name__}
    else:
        second_outcome = settle(second)
    return {
        "first": first_outcome,
        "second": second_outcome,
        "runs of the part": settled_runs(app, tag, expect=2),
    }


# 11. time limits


@scenario("soft_time_limit_caught_by_the_body")
def soft_time_limit_caught_by_the_body(app: Celery) -> Outcome:
    return settle(task(app, "sleepy").delay(5))


# --- the documented differences -----------------------------------------------------------

#: Scenario name → (why ExactOnceTask differs, the outcome it has instead of plain Celery's).
#: Mirrored by docs/reference/differences.md, which names the scenario of each case.
DIFFERENCES: dict[str, tuple[str, Outcome]] = {
    "frozen_signature_reapplied": (
        "ExactOnceTask treats one task_id as one job: applying the same frozen signature "
        "again returns the existing job, and the body runs once (Celery's Task runs it "
        "once per apply_async)",
        {"same task id": True, "first": {"value": 1}, "second": {"value": 1}, "runs": 1},
    ),
    "frozen_chord_reapplied": (
        "one task_id is one job inside canvases too: a frozen chord applied again runs its "
        "tasks once, and the second apply_async returns results of the same ids, which hold "
        "the first run's outcome",
        {"same ids": True, "first": {"value": 3}, "second": {"value": 3}, "header runs": 2},
    ),
    "frozen_chain_in_two_chords": (
        "a frozen signature placed in a second canvas would leave that canvas waiting for a "
        "part that never runs again: it is refused with JobConflict where the part is "
        "submitted",
        {"first": {"value": 7}, "second": {"raised at send": "JobConflict"}, "runs of the part": 1},
    ),
    "reject_requeue": (
        "Reject(requeue=True) cannot give back a message whose attempt has run (the gate "
        "would refuse it): the job moves to its next attempt and a new copy is published, so "
        "the body runs again once, sees it redelivered as a message given back, and sees "
        "request.retries one higher",
        {
            "result": {"value": 2},
            "runs": 2,
            "seen": [
                {"redelivered": False, "retries": 0, "run": 1},
                {"redelivered": True, "retries": 1, "run": 2},
            ],
        },
    ),
}

#: The scenarios whose outcome depends on the broker: run on RabbitMQ too.
BROKER_SPECIFIC = ("reject_requeue", "reject_then_succeed")


# --- the tests ----------------------------------------------------------------------------


def timed_out(outcome: Outcome) -> bool:
    """Whether any part of ``outcome`` did not come in time (or the scenario raised)."""
    if isinstance(outcome, dict):
        if "timed_out" in outcome or "scenario raised" in outcome:
            return True
        return any(timed_out(value) for value in outcome.values())
    if isinstance(outcome, list):
        return any(timed_out(value) for value in outcome)
    return False


def run_both(name: str, variants: dict[str, Variant]) -> dict[str, Outcome]:
    """The scenario's outcome on each variant, run side by side."""
    reason = REQUIRES.get(name, lambda: None)()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    futures = {kind: variant.run(SCENARIOS[name]) for kind, variant in variants.items()}
    return {kind: future.result(timeout=SCENARIO_TIMEOUT) for kind, future in futures.items()}


def check(name: str, variants: dict[str, Variant]) -> None:
    """Equal outcomes, or the documented one (:data:`DIFFERENCES`); both shown if not."""
    outcomes = run_both(name, variants)
    plain, exactonce = outcomes["plain"], outcomes["exactonce"]
    shown = f"scenario {name}:\n  plain Task:    {plain!r}\n  ExactOnceTask: {exactonce!r}"
    if timed_out(plain) or plain != exactonce:
        print(f"{shown}\n" + "\n".join(variant.logs() for variant in variants.values()))
    assert not timed_out(plain), f"plain Celery did not complete the scenario\n{shown}"
    if name in DIFFERENCES:
        why, documented = DIFFERENCES[name]
        assert exactonce == documented, (
            f"ExactOnceTask does not behave as documented ({why}): expected {documented!r}\n{shown}"
        )
        assert plain != documented, f"the documented difference is gone ({why})\n{shown}"
        return
    assert exactonce == plain, f"ExactOnceTask differs from Celery's Task\n{shown}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_scenario_has_the_outcome_of_celerys_task(
    name: str, redis_variants: dict[str, Variant]
) -> None:
    """Equal outcomes on a Redis broker, or the documented ExactOnceTask one (DIFFERENCES)."""
    check(name, redis_variants)


@pytest.mark.parametrize("name", BROKER_SPECIFIC)
def test_a_broker_specific_scenario_has_the_outcome_of_celerys_task_on_rabbitmq(
    name: str, amqp_variants: dict[str, Variant]
) -> None:
    """The same comparison on RabbitMQ, for the scenarios whose outcome the broker decides."""
    check(name, amqp_variants)


def test_every_documented_difference_names_a_scenario() -> None:
    """An entry of DIFFERENCES (and of the docs page mirroring it) is tested by its scenario."""
    assert set(DIFFERENCES) <= set(SCENARIOS), sorted(set(DIFFERENCES) - set(SCENARIOS))


def test_a_task_that_rejects_every_delivery_stops_at_max_retries_and_fails(
    redis_variants: dict[str, Variant],
) -> None:
    """``Reject(requeue=True)`` on every delivery: one run per attempt, then a visible failure.

    Plain Celery gives the message back forever. ExactOnceTask counts each
    requeue as a retry: past ``max_retries`` (2 here) the task fails with
    ``MaxRetriesExceededError`` and its job ends ``FAILED``. Before the fix
    nothing bounded it: the requeued copies ran on, each a new attempt.
    """
    from celery_exactonce import runtime
    from celery_exactonce.core.refs import JobRef

    def rejects_always(app: Celery) -> Outcome:
        tag = new_tag()
        result = task(app, "reject_always").delay(tag)
        outcome = settle(result, timeout=TIMEOUT)
        job = runtime.runtime_for(app).store.get(JobRef.submitted(result.id))
        return {
            "result": outcome,
            "runs": settled_runs(app, tag, expect=3),
            "seen": noted(app, tag, at_least=3, timeout=1.0),
            "job": job and (str(job.state), job.attempt, "max_retries=2" in job.reason),
        }

    variant = redis_variants["exactonce"]
    outcome = variant.run(rejects_always).result(timeout=SCENARIO_TIMEOUT)
    if timed_out(outcome) or outcome.get("runs") != 3:
        print(variant.logs())
    assert outcome == {
        "result": {"raised": "MaxRetriesExceededError"},
        "runs": 3,
        "seen": [
            {"redelivered": False, "retries": 0, "run": 1},
            {"redelivered": True, "retries": 1, "run": 2},
            {"redelivered": True, "retries": 2, "run": 3},
        ],
        "job": ("FAILED", 2, True),
    }
    assert variant.worker is not None
    assert "requeue refused: out of retries (max_retries=2)" in variant.worker.log()


def test_plain_celery_gives_an_always_rejected_message_back_past_max_retries(
    redis_variants: dict[str, Variant],
) -> None:
    """What the previous test compares with: Celery's ``Task`` does not count requeues.

    The same task runs on, far past ``max_retries`` (2), each run the same
    retry (0), until it is revoked (which ends the loop here).
    """

    def rejects_always(app: Celery) -> Outcome:
        tag = new_tag()
        result = task(app, "reject_always").delay(tag)
        try:
            poll(lambda: compat_app.runs(app, tag) >= 6, timeout=TIMEOUT, interval=0.05)
        finally:
            app.control.revoke(result.id)
        deadline = time.monotonic() + TIMEOUT
        while True:  # the revoke reaches the worker: the count stays (raises if it never does)
            count = compat_app.runs(app, tag)
            try:
                holds(lambda count=count: compat_app.runs(app, tag) == count, seconds=QUIET)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
        retries = sorted({note["retries"] for note in compat_app.notes(app, tag)})
        return {"retries seen": retries, "stopped once revoked": True}

    variant = redis_variants["plain"]
    outcome = variant.run(rejects_always).result(timeout=SCENARIO_TIMEOUT)
    assert outcome == {"retries seen": [0], "stopped once revoked": True}
