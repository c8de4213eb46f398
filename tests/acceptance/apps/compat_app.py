"""A Celery app configured only from the environment, whose ``task_cls`` is Celery's or ours.

``celery -A tests.acceptance.apps.compat_app worker`` (and ``beat -S exactonce``) run
it; ``tests/acceptance/test_compat.py`` builds the same app with :func:`make_app` to
send the scenarios' tasks. Every task is a plain ``@app.task``: it gets the app's
``task_cls``, so the same scenarios run once on Celery's ``Task`` and once on
``ExactOnceTask``. Every setting comes from these variables:

``EXACTONCE_ACC_TASK_CLS``         ``plain`` (``celery.Task``, the default) or ``exactonce``
                                   (``celery_exactonce.ExactOnceTask``)
``EXACTONCE_ACC_BROKER_URL``       broker (``redis://…`` or ``amqp://…``)
``EXACTONCE_ACC_QUEUE``            ``task_default_queue`` (unique per deployment)
``EXACTONCE_ACC_RESULT_BACKEND``   the Redis result backend's URL; the tasks' own keys
                                   (:func:`bump`, :func:`note`) live there too
``EXACTONCE_ACC_REDIS_PREFIX``     prefix of every Redis key of the deployment: the Redis
                                   broker's and the result backend's ``global_keyprefix``,
                                   and the tasks' own keys
``EXACTONCE_ACC_STORE_URL``        ``exactonce_store_url``
``EXACTONCE_ACC_NAMESPACE``        ``exactonce_namespace``

Both task classes get the same settings (the store's included): only ``task_cls``
differs. A body leaves what it saw in Redis: :func:`bump` counts its runs under a
tag, :func:`note` appends a JSON value to the tag's list, and the test reads them
with :func:`runs` and :func:`notes`. :func:`describe` turns what a body received
into type names and values a test can compare.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from celery import Celery, Task, chain, group
from celery.exceptions import Reject, SoftTimeLimitExceeded

TASK_CLASSES = ("plain", "exactonce")

#: Redis visibility sweep, as the ledger app's (kombu's default restores an expired
#: unacked message only about every 100 s).
REDIS_RESTORE_INTERVAL = 1

try:  # the pydantic scenario runs only where pydantic is installed
    import pydantic
except ImportError:  # pragma: no cover - depends on the environment
    pydantic = None  # type: ignore[assignment]


if pydantic is not None:

    class Order(pydantic.BaseModel):
        """The model argument of ``compat.order_total`` (``pydantic=True``)."""

        item: str
        quantity: int
        price: Decimal

else:  # pragma: no cover - depends on the environment
    Order = None  # type: ignore[assignment,misc]


def task_cls(name: str) -> type[Task] | str:
    """The ``task_cls`` the variable names."""
    if name == "plain":
        return "celery.app.task:Task"
    if name == "exactonce":
        from celery_exactonce import ExactOnceTask

        return ExactOnceTask
    raise ValueError(f"EXACTONCE_ACC_TASK_CLS must be one of {TASK_CLASSES}, got {name!r}")


def _note_delivery(app: Celery, task: Task, tag: str) -> int:
    """Count a run under ``tag`` and note its retries and whether it came redelivered."""
    run = bump(app, tag)
    delivery = task.request.delivery_info or {}
    redelivered = delivery.get("redelivered")
    note(app, tag, {"run": run, "retries": task.request.retries, "redelivered": redelivered})
    return run


def make_app(env: Mapping[str, str] = os.environ, *, set_as_current: bool = True) -> Celery:
    """The compat app configured from ``env`` (``os.environ`` in a worker or beat)."""
    kind = env.get("EXACTONCE_ACC_TASK_CLS", "plain")
    app = Celery("compat_app", task_cls=task_cls(kind), set_as_current=set_as_current)
    prefix = env.get("EXACTONCE_ACC_REDIS_PREFIX", "")
    broker_url = env.get("EXACTONCE_ACC_BROKER_URL", "")
    transport: dict[str, Any] = {}
    if broker_url.startswith(("amqp://", "pyamqp://", "amqps://")):
        transport["confirm_publish"] = True
    elif broker_url.startswith(("redis://", "rediss://")):
        transport.update(
            unacked_restore_interval=REDIS_RESTORE_INTERVAL, unacked_restore_throttle=1
        )
        if prefix:
            transport["global_keyprefix"] = prefix
    app.conf.update(
        broker_url=broker_url or None,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        result_backend=env.get("EXACTONCE_ACC_RESULT_BACKEND") or None,
        result_backend_transport_options={"global_keyprefix": prefix} if prefix else {},
        task_default_queue=env.get("EXACTONCE_ACC_QUEUE", "celery"),
        worker_prefetch_multiplier=1,
        worker_send_task_events=False,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        exactonce_store_url=env.get("EXACTONCE_ACC_STORE_URL"),
        exactonce_namespace=env.get("EXACTONCE_ACC_NAMESPACE", "default"),
        compat_prefix=prefix,  # the tasks' own keys (bump, note)
    )
    _register_tasks(app)
    return app


# --- what the bodies leave in Redis ----------------------------------------------------

_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def _redis(app: Celery) -> Any:
    """A client of the result backend's Redis, one per process (pool children included)."""
    import redis

    url = app.conf.result_backend
    if not url:
        raise RuntimeError("EXACTONCE_ACC_RESULT_BACKEND is not set: nowhere to record")
    key = (os.getpid(), url)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = redis.Redis.from_url(url)
        return _clients[key]


def close_clients() -> None:
    """Close the Redis clients :func:`bump` and the readers opened in this process."""
    with _clients_lock:
        for key in [key for key in _clients if key[0] == os.getpid()]:
            _clients.pop(key).close()


def _key(app: Celery, kind: str, tag: str) -> str:
    return f"{app.conf.compat_prefix}compat:{kind}:{tag}"


def bump(app: Celery, tag: str) -> int:
    """Count one body run under ``tag``; the count so far."""
    return int(_redis(app).incr(_key(app, "runs", tag)))


def runs(app: Celery, tag: str) -> int:
    """How many body runs :func:`bump` counted under ``tag``."""
    return int(_redis(app).get(_key(app, "runs", tag)) or 0)


def note(app: Celery, tag: str, value: Any) -> None:
    """Append ``value`` (JSON) to the list of ``tag``."""
    _redis(app).rpush(_key(app, "notes", tag), json.dumps(value, sort_keys=True))


def notes(app: Celery, tag: str) -> list[Any]:
    """The values :func:`note` appended under ``tag``, in order."""
    return [json.loads(raw) for raw in _redis(app).lrange(_key(app, "notes", tag), 0, -1)]


def describe(value: Any) -> Any:
    """``value`` as JSON that keeps each leaf's type: ``[type name, text]``.

    Containers stay containers (a tuple is described as a list: JSON
    carries none); an object of another type is described by its type name only.
    """
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, dict):
        return {str(key): describe(item) for key, item in value.items()}
    name = type(value).__name__
    if isinstance(value, bytes):
        return [name, value.hex()]
    if isinstance(value, (datetime, date)):
        return [name, value.isoformat()]
    if value is None or isinstance(value, (bool, int, float, str, Decimal, uuid.UUID)):
        return [name, str(value)]
    return [name]


# --- the tasks ------------------------------------------------------------------------


def _register_tasks(app: Celery) -> None:  # noqa: PLR0915 - one definition per task
    @app.task(shared=False, name="compat.add")
    def add(x: Any, y: Any) -> Any:
        return x + y

    @app.task(shared=False, name="compat.mul")
    def mul(x: Any, y: Any) -> Any:
        return x * y

    @app.task(shared=False, name="compat.tsum")
    def tsum(values: list[Any]) -> Any:
        return sum(values)

    @app.task(shared=False, name="compat.fail")
    def fail(message: str) -> None:
        raise ValueError(message)

    @app.task(shared=False, name="compat.count")
    def count(tag: str, value: Any = None) -> Any:
        """Count the run; return ``value``."""
        bump(app, tag)
        return value

    @app.task(shared=False, name="compat.quiet", ignore_result=True)
    def quiet(tag: str) -> str:
        """``count`` whose result is ignored (a task attribute)."""
        bump(app, tag)
        return "quiet"

    @app.task(bind=True, shared=False, name="compat.retry_until", max_retries=5)
    def retry_until(self: Task, tag: str, failures: int) -> int:
        """``self.retry(countdown=1)`` on the first ``failures`` runs; returns ``retries``."""
        bump(app, tag)
        if self.request.retries < failures:
            raise self.retry(countdown=1)
        return int(self.request.retries)

    @app.task(bind=True, shared=False, name="compat.retry_forever", max_retries=2)
    def retry_forever(self: Task, tag: str) -> None:
        """Retries until ``max_retries`` is exhausted (``MaxRetriesExceededError``)."""
        bump(app, tag)
        raise self.retry(countdown=1)

    @app.task(
        bind=True,
        shared=False,
        name="compat.autoretry",
        autoretry_for=(KeyError,),
        retry_kwargs={"max_retries": 5, "countdown": 1},
        retry_backoff=False,
        retry_jitter=False,
    )
    def autoretry(self: Task, tag: str, failures: int) -> int:
        """Raises ``KeyError`` on the first ``failures`` runs; returns ``retries``."""
        bump(app, tag)
        if self.request.retries < failures:
            raise KeyError(tag)
        return int(self.request.retries)

    @app.task(shared=False, name="compat.on_error")
    def on_error(request: Any, exc: Any, traceback: Any, tag: str) -> None:
        """An errback Celery calls in the failing task's worker: ``(request, exc, traceback)``."""
        note(app, tag, {"style": "request", "task_id": request.id, "exc": type(exc).__name__})

    @app.task(shared=False, name="compat.on_error_id")
    def on_error_id(task_id: str, tag: str) -> None:
        """An errback of one positional argument: Celery sends it as a task (``task_id``)."""
        note(app, tag, {"style": "task_id", "task_id": task_id})

    @app.task(shared=False, name="compat.on_error_bytes")
    def on_error_bytes(payload: Any) -> None:
        """An immutable errback (``.si(tag.encode())``): sent as a task, its own argument only."""
        tag = payload.decode() if isinstance(payload, bytes) else str(payload)
        note(app, tag, {"style": "bytes", "payload": describe(payload)})

    @app.task(shared=False, name="compat.typed")
    def typed(*args: Any, tag: str, **kwargs: Any) -> Any:
        """What the body received, described (:func:`describe`); noted under ``tag`` too."""
        seen = {"args": describe(args), "kwargs": describe(kwargs)}
        note(app, tag, seen)
        return seen

    @app.task(bind=True, shared=False, name="compat.reject_once", acks_late=True)
    def reject_once(self: Task, tag: str) -> int:
        """``Reject(requeue=True)`` on its first run; returns the run's number."""
        run = _note_delivery(app, self, tag)
        if run == 1:
            raise Reject("the first run asks for the message again", requeue=True)
        return run

    @app.task(bind=True, shared=False, name="compat.reject_then_succeed", acks_late=True)
    def reject_then_succeed(self: Task, tag: str) -> int:
        """Celery's own shape: reject until the message comes back redelivered; its run."""
        run = bump(app, tag)
        redelivered = bool(self.request.delivery_info["redelivered"])
        note(app, tag, {"run": run, "redelivered": redelivered})
        if not redelivered:
            raise Reject("not redelivered yet", requeue=True)
        return run

    @app.task(bind=True, shared=False, name="compat.reject_always", acks_late=True, max_retries=2)
    def reject_always(self: Task, tag: str) -> None:
        """``Reject(requeue=True)`` on every delivery (plain Celery requeues it forever)."""
        _note_delivery(app, self, tag)
        raise Reject("never takes it", requeue=True)

    @app.task(bind=True, shared=False, name="compat.probe")
    def probe(self: Task, x: Any, y: Any, tag: str | None = None) -> Any:
        """``add`` that notes the ``replaced_task_nesting`` it saw under ``tag``."""
        if tag:
            note(app, tag, {"nesting": self.request.replaced_task_nesting})
        return x + y

    @app.task(bind=True, shared=False, name="compat.replacing")
    def replacing(self: Task, x: Any, how: str, tag: str | None = None) -> None:
        """Replaces itself with ``probe(x, 1)``, a chain or a group of probes (``how``)."""
        if how == "task":
            raise self.replace(probe.s(x, 1, tag=tag))
        if how == "chain":
            raise self.replace(chain(probe.s(x, 1, tag=tag), mul.s(10)))
        if how == "group":
            raise self.replace(group(probe.s(x, 1, tag=tag), probe.s(x, 2, tag=tag)))
        raise ValueError(f"unknown replacement {how!r}")

    @app.task(bind=True, shared=False, name="compat.spawn")
    def spawn(self: Task) -> dict[str, str]:
        """Sends two children, one with ``add_to_parent=False``; returns their ids."""
        detached = add.apply_async((1, 1), add_to_parent=False)
        attached = add.apply_async((2, 2))
        return {"detached": detached.id, "attached": attached.id}

    @app.task(bind=True, shared=False, name="compat.eta_probe")
    def eta_probe(self: Task) -> Any:
        """The ``request.eta`` the body saw (an ISO string, a datetime or ``None``)."""
        eta = self.request.eta
        return eta.isoformat() if isinstance(eta, datetime) else eta

    @app.task(shared=False, name="compat.bad_limits", soft_time_limit=5, time_limit=2)
    def bad_limits() -> None:
        """A soft time limit above the hard one: Celery refuses it at ``apply_async``."""

    @app.task(bind=True, shared=False, name="compat.sleepy", soft_time_limit=1)
    def sleepy(self: Task, seconds: float) -> str:
        """Sleeps past its soft time limit, catches it and returns a marker."""
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            return "soft time limit"
        return "slept"

    if Order is not None:

        @app.task(shared=False, name="compat.order_total", pydantic=True)
        def order_total(order: Order) -> dict[str, Any]:  # type: ignore[valid-type]
            """What a ``pydantic=True`` body received."""
            return {
                "type": type(order).__name__,
                "total": str(order.quantity * order.price),  # type: ignore[attr-defined]
            }


#: The app ``celery -A tests.acceptance.apps.compat_app worker`` (or ``beat``) runs.
app = make_app(os.environ)
