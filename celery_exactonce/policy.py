"""A gated task's reconciler policy: its timeouts and opt-ins, and the one place they are read.

The settings (``exactonce_dispatch_timeout``...) are the defaults. A gated
task overrides them with ``exactonce_<name>`` attributes, a beat entry under
its ``options["exactonce"]``. Whoever creates a job writes the policy it saw
into the record (:data:`~celery_exactonce.dispatch.messages.POLICY_OPTION`), so a
process that does not import the task (a slim beat) still applies the task's
own; :meth:`Timeouts.of` is how every reader gets a job's limits.

Not here: what the reconciler does with the limits (:mod:`~celery_exactonce.reconcile.reconciler`),
how a beat entry's overrides are parsed (:mod:`~celery_exactonce.beat.entries`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.dispatch.messages import POLICY_OPTION

#: Settings a gated task may override as ``exactonce_<name>`` attributes (the reconciler's).
TASK_TIMEOUTS = ("dispatch_timeout", "dispatch_deadline", "running_timeout")
#: Opt-ins a gated task may set as ``exactonce_<name> = True`` (the reconciler's).
TASK_FLAGS = ("redispatch", "rerun")


def _attributes(task: Any) -> dict[str, Any]:
    """The policy attributes ``task`` sets, as it sets them (unchecked)."""
    found = {
        name: getattr(task, f"exactonce_{name}", None) for name in (*TASK_TIMEOUTS, *TASK_FLAGS)
    }
    return {name: value for name, value in found.items() if value is not None}


def task_policy(task: Any) -> dict[str, Any]:
    """The reconciler policy ``task`` overrides, as its jobs store it.

    Written into every job of a gated task by whoever creates it (under
    :data:`~celery_exactonce.dispatch.messages.POLICY_OPTION`), so that a process that
    does not import the task, a slim beat, still applies the task's own
    timeouts and opt-ins.
    """
    policy: dict[str, Any] = {}  # what _attributes finds, without its dicts (every submit)
    for name, attribute in _TIMEOUT_ATTRIBUTES:
        value = getattr(task, attribute, None)
        if value is not None:
            policy[name] = float(value)
    for name, attribute in _FLAG_ATTRIBUTES:
        if getattr(task, attribute, None):
            policy[name] = True
    if getattr(task, "exactonce_atomic", False):  # nothing of a run that did not commit can
        policy["atomic"] = policy["redispatch"] = True  # have committed: it runs again
    return policy


_TIMEOUT_ATTRIBUTES = tuple((name, f"exactonce_{name}") for name in TASK_TIMEOUTS)
_FLAG_ATTRIBUTES = tuple((name, f"exactonce_{name}") for name in TASK_FLAGS)


def check_timeouts(
    config: ExactOnceConfig,
    timeouts: Mapping[str, Any],
    *,
    prefix: str,
    setting: str | None = None,
) -> None:
    """Refuse per-task timeouts the settings' own rules refuse.

    The rules: ``dispatch_timeout > replay_age``, ``dispatch_deadline >=
    dispatch_timeout``, ``running_timeout >= 3 x heartbeat_interval + max_skew``.
    The :class:`~celery_exactonce.core.exceptions.ConfigurationError` starts with
    ``prefix`` (what set them) and names ``setting``, else the rule's setting.
    """
    if not timeouts:
        return
    try:
        dataclasses.replace(config, **timeouts)
    except (exceptions.ConfigurationError, TypeError) as exc:
        raise exceptions.ConfigurationError(
            f"{prefix}{exc}", setting=setting or getattr(exc, "setting", None)
        ) from exc


def task_timeouts(task: Any) -> dict[str, Any]:
    """The timeouts ``task`` overrides as attributes (for :func:`check_timeouts`)."""
    return {name: value for name, value in _attributes(task).items() if name in TASK_TIMEOUTS}


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """The reconciler's limits for one task: the settings, overridden by the task's policy."""

    dispatch_timeout: float
    dispatch_deadline: float
    running_timeout: float
    redispatch: bool
    rerun: bool
    #: The task's runs commit their effects with their end (``exactonce_atomic``).
    atomic: bool = False

    @classmethod
    def of(cls, config: ExactOnceConfig, task: Any, job: Job | None = None) -> Timeouts:
        """The limits for ``job``: the policy its record stores, else ``task``'s attributes.

        The record is written by the job's creator, which knows the task; this
        process (a beat that does not import the task's module) may not.
        A stored value of the wrong type is ignored (the setting applies).
        """
        stored = job.options.get(POLICY_OPTION) if job is not None else None
        given: Mapping[str, Any] = stored if isinstance(stored, dict) else _attributes(task)

        def pick(name: str, default: float) -> float:
            found = given.get(name)
            if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0:
                return float(found)
            return float(default)

        return cls(
            dispatch_timeout=pick("dispatch_timeout", config.dispatch_timeout),
            dispatch_deadline=pick("dispatch_deadline", config.dispatch_deadline),
            running_timeout=pick("running_timeout", config.running_timeout),
            redispatch=bool(given.get("redispatch")),
            rerun=bool(given.get("rerun")),
            atomic=given.get("atomic") is True,
        )


def youngest_ages(config: ExactOnceConfig, tasks: Iterable[Any]) -> tuple[float, float]:
    """The youngest ``DISPATCHED`` and ``RUNNING`` ages any of ``tasks``' limits act on."""
    dispatch = min(config.dispatch_timeout, config.dispatch_deadline)
    running = config.running_timeout
    for task in tasks:
        given = task_timeouts(task)
        for name in ("dispatch_timeout", "dispatch_deadline"):
            if name in given:
                dispatch = min(dispatch, float(given[name]))
        if "running_timeout" in given:
            running = min(running, float(given["running_timeout"]))
    return dispatch, running
