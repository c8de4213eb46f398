"""``exactonce_unique``: the key of a unique submission, from a gated task's arguments.

A gated task declares what makes two calls "the same work"::

    @app.task(base=ExactOnceTask, exactonce_unique=("user_id",))
    def sync(user_id, full=False): ...

    @app.task(base=ExactOnceTask, exactonce_unique=lambda user_id, **_: f"user-{user_id}")
    def resync(user_id, reason): ...

With names, the key is the task and the values of those parameters, bound as
Python binds the call (``sync(5)`` and ``sync(user_id=5)`` are one key;
defaults count; a name a ``**kwargs`` takes must be in the call); with a
function (of the call's arguments, not a method of the task), the task and
what it returns. Either must be JSON; a call the key cannot be made from is
refused (``InvalidPayload``, naming the task), before anything is stored. The
stored key is a SHA-256 of that (``u:`` and 64 hex digits): the same length
for every key, and no argument value in the store's index.

While a job with the key is live, a submission with it is that job
(:mod:`celery_exactonce.stores.unique`). Not here: the submit
(:mod:`~celery_exactonce.task.submit`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_exactonce.core import exceptions

#: The attribute of a gated task that makes its submissions unique.
ATTRIBUTE = "exactonce_unique"


def spec_of(task: Any) -> Sequence[str] | Callable[..., Any] | None:
    """The task's ``exactonce_unique``, checked (``None``: its submissions are not unique).

    Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError` naming the
    task and the attribute: not a function nor names, an empty list, a name the
    task's function does not take.
    """
    unwrap = getattr(task, "_get_current_object", None)  # a task Celery has not made yet
    task = unwrap() if unwrap is not None else task
    if getattr(type(task), ATTRIBUTE, None) is None and ATTRIBUTE not in getattr(
        task, "__dict__", {}
    ):
        return None  # the common case, on every gated submit: asked cheaply
    # As set on the class (a function there is no method of the task: it takes the call's
    # arguments, not the task).
    spec = inspect.getattr_static(task, ATTRIBUTE, None)
    if isinstance(spec, (staticmethod, classmethod)):
        spec = getattr(task, ATTRIBUTE)
    if spec is None or callable(spec):
        return spec  # type: ignore[no-any-return]
    where = f"{task.name}.{ATTRIBUTE}"
    if isinstance(spec, str) or not isinstance(spec, (tuple, list)) or not spec:
        raise exceptions.ConfigurationError(
            f"{where} = {spec!r}: give the names of the arguments that make two calls the "
            '"same work" (a tuple: ("user_id",)), or a function of the call\'s arguments',
            setting=ATTRIBUTE,
        )
    takes = _parameters(task)
    for name in spec:
        if not isinstance(name, str) or (takes is not None and name not in takes):
            raise exceptions.ConfigurationError(
                f"{where}: {name!r} is not an argument of {task.name}"
                + (f" (it takes {', '.join(takes) or 'none'})" if takes is not None else ""),
                setting=ATTRIBUTE,
            )
    return tuple(spec)


def key_of(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str | None:
    """The unique key of a call of ``task`` (``None``: the task's submissions are not unique).

    Raises :class:`~celery_exactonce.core.exceptions.InvalidPayload` when the
    values the key is made of are not JSON, or the call does not bind.
    """
    spec = spec_of(task)
    if spec is None:
        return None
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    try:
        if callable(spec):
            values: Any = spec(*args, **kwargs)
        else:
            values = _named(inspect.signature(task.run).bind(*args, **kwargs), spec)
    except (TypeError, KeyError) as exc:
        raise exceptions.InvalidPayload(
            f"{task.name}: its {ATTRIBUTE} key cannot be made from this call: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        text = json.dumps([task.name, values], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise exceptions.InvalidPayload(
            f"{task.name}: the values of its {ATTRIBUTE} key are not JSON: {exc}"
        ) from exc
    return "u:" + hashlib.sha256(text.encode()).hexdigest()


def _named(bound: inspect.BoundArguments, names: Sequence[str]) -> list[Any]:
    """The values of ``names`` in a bound call, defaults filled in (from ``**kwargs`` too)."""
    bound.apply_defaults()
    extra: dict[str, Any] = {}
    for parameter in bound.signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            extra = bound.arguments.get(parameter.name, {})
    values = []
    for name in names:
        if name in bound.arguments:
            values.append(bound.arguments[name])
        elif name in extra:
            values.append(extra[name])
        else:
            raise KeyError(f"the call gives no {name!r}")
    return values


def _parameters(task: Any) -> list[str] | None:
    """The names the task's function takes (``None``: it takes any, ``**kwargs``)."""
    try:
        parameters = inspect.signature(task.run).parameters.values()
    except (TypeError, ValueError):  # a builtin: nothing to check against
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind is not p.VAR_POSITIONAL]
