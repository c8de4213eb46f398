"""A gated task run in the caller's process: eager mode, ``apply()`` and direct calls.

Celery runs a task without a worker in three ways: eager mode
(``task_always_eager = True``: ``delay``/``apply_async`` run the body at once,
in the caller's process, as most Django test set-ups do), ``task.apply()``,
and a direct call (``task(*args)``, or ``task.run(*args)``, which calls the
function alone). In each, ``self.request.idempotency_key`` is set, and
deterministically:

* eager and ``apply()``: the key of the job ``task_id``
  (:func:`~celery_exactonce.dispatch.messages.submitted_key`), the very key a worker
  would see for a job submitted with that id: pass ``task_id`` for a key a
  test can know in advance;
* a direct call: there is no job and no task id; the key is that of
  ``"direct:" + the task's name`` at the UNIX epoch (:func:`direct_key`),
  the same for every direct call of the task.

The store: an eager run never needs a server. Where the app's store lives in
this process (``memory://``, or an ``InMemoryStore`` handed to
:func:`~celery_exactonce.runtime.install`, as the pytest plugin does), an
eager run goes through the store as a worker's would (:func:`record`): the job
is created, the gate admits the run and the outcome is written, so a test can
assert that it ran once, and a ``task_id`` submitted again is the same job,
not run again (its ``EagerResult`` is ``IGNORED``). An ``eta`` or
``countdown`` does not delay it: Celery's eager mode runs the body at once,
and so does this. Any other store is never opened by an eager run: the body
runs with its key and nothing is recorded. A direct call never touches a store.

Not here: where ``ExactOnceTask`` takes these paths (:mod:`~celery_exactonce.task.base`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery import states
from celery._state import _task_stack
from celery.app.task import Context
from celery.result import EagerResult

from celery_exactonce.config import settings_of
from celery_exactonce.core import keys, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.runtime import Runtime, installed, runtime_for
from celery_exactonce.stores import InMemoryStore
from celery_exactonce.task import submit

__all__ = [
    "call_directly",
    "direct_key",
    "in_process_runtime",
    "outside_request",
    "record",
    "run_key",
    "submit_eagerly",
]


def namespace_of(app: Any) -> str:
    """``exactonce_namespace`` of ``app`` as written (``"default"`` when unset), unchecked."""
    namespace = settings_of(app).get("exactonce_namespace")
    return namespace if isinstance(namespace, str) and namespace else "default"


def run_key(app: Any, task_id: str) -> str:
    """The idempotency key of an eager run (or ``apply()``) of job ``task_id``."""
    return messages.submitted_key(task_id, namespace_of(app))


def direct_key(app: Any, task_name: str) -> str:
    """The idempotency key of a direct call of task ``task_name`` (the same for every call)."""
    return keys.idempotency_key(f"direct:{task_name}", times.UNIX_EPOCH, namespace_of(app))


def in_process_runtime(app: Any) -> Runtime | None:
    """The runtime of ``app`` if its store lives in this process (in memory), else ``None``.

    Never opens a store that is not in memory: the runtime already built in
    this process, or one built for a ``memory://`` URL.
    """
    runtime = installed(app)
    if runtime is not None:
        return runtime if _in_memory(runtime.store) else None
    url = settings_of(app).get("exactonce_store_url")
    if isinstance(url, str) and url.split("://", 1)[0].lower() == "memory":
        return runtime_for(app)
    return None


def _in_memory(store: Any) -> bool:
    inner = getattr(store, "inner", store)  # a SigningStore wraps the store it signs for
    return isinstance(inner, InMemoryStore)


def submit_eagerly(
    task: Any,
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    call: Mapping[str, Any],
    options: dict[str, Any],
) -> Any:
    """Record an eager ``apply_async`` of ``task`` where the store is in memory.

    ``call``: its ``link``, ``link_error`` and ``shadow``. Returns ``None``
    when the body is to run (``options["headers"]`` then carry the job's
    headers, as a dispatch would), or the ``IGNORED`` ``EagerResult`` of a
    job that was there already (the same job, not run again). With no store
    in this process, ``None`` and nothing recorded.
    """
    runtime = in_process_runtime(task.app)
    if runtime is None:
        return None
    sent_args, sent_kwargs, shadow, merged = submit.before_send(
        task, args, kwargs, call.get("shadow"), options
    )
    new = submit.new_job(
        task,
        runtime.node,
        task_id,
        sent_args,
        sent_kwargs,
        link=call.get("link"),
        link_error=call.get("link_error"),
        shadow=shadow,
        options=merged,
        eager=True,
    )
    job = record(runtime, new)
    if job is None:
        return EagerResult(task_id, None, states.IGNORED, name=task.name)
    options["headers"] = {
        **(options.get("headers") or {}),
        **messages.message_headers(job, runtime.store.namespace),
    }
    return None


def record(runtime: Runtime, new: NewJob) -> Job | None:
    """Create the job of an eager call and mark it ``DISPATCHED``; ``None`` if it existed.

    A job already there is the same job submitted again (logged and counted,
    or :class:`~celery_exactonce.core.exceptions.JobConflict` for another payload):
    it is not run again.
    """
    job = submit.create(runtime, new)
    if job.rev != new.rev or job.state is not State.SCHEDULED:
        return None
    moved = runtime.store.transition(
        job.ref,
        Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED}),
            node=runtime.node,
            reason="eager: runs in the caller's process",
            rev=job.rev,
        ),
    )
    return moved.job if moved.applied else None


def call_directly(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``task(*args, **kwargs)``: the body, under a request that carries :func:`direct_key`.

    As Celery's own ``Task.__call__``: the task on the task stack and a request
    of its own, so ``current_task`` and ``self.request.args`` hold as they do there.
    """
    _task_stack.push(task)
    task.push_request(args=args, kwargs=kwargs, idempotency_key=direct_key(task.app, task.name))
    try:
        return task.run(*args, **kwargs)
    finally:
        task.pop_request()
        _task_stack.pop()


def outside_request(task: Any) -> Any:
    """The request ``task.request`` is outside any call (``task.run()``): it carries the key.

    Celery's own (an empty ``Context``) has no ``idempotency_key``. This one
    has it as a property of a class of its own, computed when read: Celery's
    ``push_request`` copies the current request's ``__dict__`` into each new
    one, and a key stored there would leak into every later request of the task.
    """
    cached = task.__dict__.get("_exactonce_outside")
    if cached is None:
        key = property(lambda _request: direct_key(task.app, task.name))
        cached = type("OutsideRequest", (Context,), {"idempotency_key": key})()
        task._exactonce_outside = cached
    return cached
