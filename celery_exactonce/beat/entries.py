"""Beat entries as beat uses them: each entry's policy, its checks, and the job of one slot.

Every entry is checked when beat starts (and when one is added at run time):
its name, schedule, task name, arguments and options must make a job the
store can hold and ``send_task`` can publish. A bad entry is refused with a
:class:`~celery_exactonce.core.exceptions.ConfigurationError` naming it, so beat
does not start with it (rather than dying at its first due slot on every
node). Arguments kombu's JSON serializer carries (``datetime``, ``Decimal``,
``UUID``, ``bytes``...) are stored in kombu's encoding and published as plain
Celery publishes them.

Per-entry overrides live under ``options["exactonce"]`` (:class:`EntryPolicy`):
``{"catchup": "all", "max_lateness": 600, "deadline": 300}``.

Not here: which slots are due and which to claim (:mod:`~celery_exactonce.beat.planner`),
the claims themselves (:mod:`~celery_exactonce.beat.claimer`) and Celery's scheduler
interface (:mod:`~celery_exactonce.beat.scheduler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timedelta, tzinfo
from typing import Any

from celery_exactonce import config as config_module
from celery_exactonce.core import exceptions, keys, refs, slots
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import GATED_OPTION, POLICY_OPTION, check_options
from celery_exactonce.policy import TASK_FLAGS, TASK_TIMEOUTS, check_timeouts

#: Entry option key holding per-entry overrides.
ENTRY_OPTIONS = "exactonce"
#: Entry option marking one of beat's own entries (the reconciler's): its won
#: slots run on beat's runner, and its skipped slots are no lost work. Refused
#: on the entries of an app.
INTERNAL_OPTION = "exactonce_internal"

#: The keys of an entry's ``options["exactonce"]``.
ENTRY_KEYS = ("catchup", "max_lateness", "deadline", "gated", *TASK_TIMEOUTS, *TASK_FLAGS)

#: Entry options that are beat's, not ``send_task``'s: never stored with a job.
_BEAT_OPTIONS = frozenset({ENTRY_OPTIONS, INTERNAL_OPTION})


def occurrence_id(namespace: str, entry: str, fire_time: datetime) -> str:
    """The job id (Celery ``task_id``) of an occurrence: its idempotency key."""
    return keys.idempotency_key(entry, fire_time, namespace)


@dataclasses.dataclass(frozen=True)
class EntryPolicy:
    """An entry's settings: ``options["exactonce"]`` over the app's ``exactonce_*`` defaults.

    ``catchup``       ``latest`` | ``all`` | ``none`` (default ``exactonce_catchup``)
    ``max_lateness``  seconds after its fire time a slot is still claimed (default
                      ``exactonce_max_lateness``; ``None``: no bound but the window)
    ``deadline``      seconds after its fire time an occurrence may still be
                      published; past it the message expires (``None``: no deadline)
    ``gated``         whether the workers run the task as an ``ExactOnceTask``.
                      Beat tells by itself when it imports the task; for a task
                      it does not import, the entry must say (``True``/``False``),
                      or beat refuses to start: guessing "plain" would write
                      each occurrence ``PUBLISHED`` and the workers' gate would
                      refuse to run it.
    ``dispatch_timeout``, ``dispatch_deadline``, ``running_timeout``, ``redispatch``,
    ``rerun``         the task's reconciler policy, as its ``exactonce_*``
                      attributes give it (gated entries only); beat reads the
                      attributes of a task it imports, and these override them.

    ``internal`` is not an override: it marks beat's own entries
    (:data:`INTERNAL_OPTION`).
    """

    catchup: config_module.Catchup
    max_lateness: float | None
    deadline: float | None
    gated: bool = False
    task_policy: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    internal: bool = False

    @classmethod
    def of(
        cls,
        name: str,
        entry: Any,
        config: config_module.ExactOnceConfig,
        *,
        task_gated: bool | None = None,
        task_policy: Mapping[str, Any] | None = None,
        internal_allowed: bool = False,
    ) -> EntryPolicy:
        """The entry's policy; a :class:`ConfigurationError` naming the entry if it is wrong.

        ``task_gated`` says whether the entry's task, as this process registers
        it, is an ``ExactOnceTask`` (``None``: not registered here), and
        ``task_policy`` is that task's own reconciler policy. Only beat's own
        entries (``internal_allowed``) may carry :data:`INTERNAL_OPTION`.
        """
        options = entry.options or {}
        overrides = options.get(ENTRY_OPTIONS) or {}
        where = f"beat entry {name!r}: options[{ENTRY_OPTIONS!r}]"
        internal = options.get(INTERNAL_OPTION) is True
        if INTERNAL_OPTION in options and not (internal_allowed and internal):
            raise _refused(f"beat entry {name!r}: option {INTERNAL_OPTION!r} is beat's own")
        if not isinstance(overrides, dict):
            raise _refused(f"{where} must be a dict")
        unknown = sorted(set(overrides) - set(ENTRY_KEYS))
        if unknown:
            raise _refused(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(ENTRY_KEYS)})"
            )
        try:
            catchup = config_module.as_catchup(overrides.get("catchup", config.catchup))
        except exceptions.ConfigurationError as exc:
            raise _refused(f"{where}: {exc}") from exc
        lateness = _seconds(
            where, "max_lateness", overrides.get("max_lateness", config.max_lateness)
        )
        gated = _gated(name, entry, where, overrides.get("gated"), task_gated)
        policy = _entry_task_policy(where, overrides, config, task_policy or {}, gated)
        deadline = _seconds(where, "deadline", overrides.get("deadline"))
        return cls(catchup, lateness, deadline, gated, policy, internal)


def check_entry(
    name: object,
    entry: Any,
    policy_of: Callable[[str, Any], EntryPolicy],
    *,
    tz: tzinfo,
    now: datetime,
    namespace: str,
    node: str,
) -> EntryPolicy:
    """Check ``entry`` as beat will use it; its policy, or :class:`ConfigurationError` naming it.

    Its schedule, its policy (``policy_of(name, entry)``, :meth:`EntryPolicy.of`
    with what this process knows of the task), its options (none that the
    dispatch path sets itself, ``headers`` a dict), and the job of a slot: name,
    task name and payload storable (what kombu's JSON carries).
    """
    label = f"beat entry {_label(name)}"
    if not isinstance(name, str):
        raise _refused(f"{label}: the name must be a string")
    slots.validate_schedule(name, entry.schedule, tz, at=now)
    policy = policy_of(name, entry)
    try:
        check_options(publish_options(entry), context=label)
        occurrence(name, entry, now, policy, namespace=namespace, node=node)
    except exceptions.InvalidPayload as exc:
        text = str(exc)
        if text.startswith(f"{refs.Space.OCCURRENCE}:"):  # the probe job's id: noise here
            text = text.partition(": ")[2]
        message = text if text.startswith(label) else f"{label}: {text}"
        raise _refused(message) from exc
    return policy


@contextlib.contextmanager
def reading(name: object) -> Iterator[None]:
    """Any error while entry ``name`` is built or checked, as a refusal naming it.

    Celery raises what it raises (a ``TypeError`` for an unknown field, an
    ``AttributeError`` for a schedule that is a string...), with no entry
    named: beat would end on a traceback rather than one line.
    """
    try:
        yield
    except exceptions.ConfigurationError:
        raise
    except Exception as exc:
        what = f"{type(exc).__name__}: {exc}"
        raise _refused(f"beat entry {_label(name)} cannot be read ({what})") from exc


def readable(schedule: Mapping[str, Any], build: Callable[[str, Any], Any]) -> Mapping[str, Any]:
    """``schedule``, once ``build(name, fields)`` made each entry (else a refusal naming it)."""
    for name, fields in schedule.items():
        with reading(name):
            build(name, fields)
    return schedule


def publish_options(entry: Any) -> dict[str, Any]:
    """The entry's options that go to ``send_task`` (beat's own taken out)."""
    return {k: v for k, v in (entry.options or {}).items() if k not in _BEAT_OPTIONS}


def occurrence(
    name: str, entry: Any, fire: datetime, policy: EntryPolicy, *, namespace: str, node: str
) -> NewJob:
    """The job of ``entry``'s slot at ``fire``, as ``node`` claims it (``SCHEDULED``)."""
    options = {k: v for k, v in publish_options(entry).items() if v is not None}
    options[GATED_OPTION] = policy.gated
    if policy.gated:
        options[POLICY_OPTION] = dict(policy.task_policy)
    return NewJob(
        JobRef.occurrence(occurrence_id(namespace, name, fire)),
        entry.task,
        State.SCHEDULED,
        node=node,
        args=list(entry.args or ()),
        kwargs=dict(entry.kwargs or {}),
        options=options,
        entry=name,
        fire_time=fire,
        deadline=deadline_of(policy, fire),
        reason="beat claim",
    )


def deadline_of(policy: EntryPolicy, fire: datetime) -> datetime | None:
    """The deadline of the slot at ``fire`` (``None``: the policy sets none)."""
    return None if policy.deadline is None else fire + timedelta(seconds=policy.deadline)


def entry_of(new: NewJob) -> str:
    """An occurrence's entry name (every claim beat builds has one)."""
    assert new.entry is not None  # noqa: S101
    return new.entry


def fire_of(new: NewJob) -> datetime:
    """An occurrence's fire time (every claim beat builds has one)."""
    assert new.fire_time is not None  # noqa: S101
    return new.fire_time


def _refused(message: str) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(message, setting="beat_schedule")


def _gated(name: str, entry: Any, where: str, declared: object, task_gated: bool | None) -> bool:
    """Whether the entry's task is gated: what beat sees of it, or what the entry declares."""
    if declared is not None and not isinstance(declared, bool):
        raise _refused(f"{where}['gated'] must be True or False, got {declared!r}")
    if task_gated is None:
        if declared is None:
            raise _refused(
                f"beat entry {name!r}: task {entry.task!r} is not registered in this beat "
                "process, so beat cannot tell whether the workers gate it. Import the task's "
                "module in beat (app.conf.imports or include), or declare it on the entry: "
                f"options={{{ENTRY_OPTIONS!r}: {{'gated': True}}}} for an ExactOnceTask, "
                "{'gated': False} for a plain task"
            )
        return declared
    if declared is not None and declared is not task_gated:
        kind = "an ExactOnceTask" if task_gated else "a plain task"
        raise _refused(f"{where}['gated'] is {declared}, but task {entry.task!r} is {kind} here")
    return task_gated


def _entry_task_policy(
    where: str,
    overrides: Mapping[str, Any],
    config: config_module.ExactOnceConfig,
    task_policy: Mapping[str, Any],
    gated: bool,
) -> dict[str, Any]:
    """The reconciler policy an entry's occurrences store: the task's, then the entry's."""
    given = [key for key in (*TASK_TIMEOUTS, *TASK_FLAGS) if overrides.get(key) is not None]
    if not gated:
        if given:
            raise _refused(f"{where}: {', '.join(given)} apply to gated tasks only")
        return {}
    policy = dict(task_policy)
    for key in TASK_FLAGS:
        value = overrides.get(key)
        if value is not None and not isinstance(value, bool):
            raise _refused(f"{where}[{key!r}] must be True or False, got {value!r}")
        if value is not None:
            policy[key] = value
    for key in TASK_TIMEOUTS:
        seconds = _seconds(where, key, overrides.get(key))
        if seconds is not None:
            policy[key] = seconds
    timeouts = {key: policy[key] for key in TASK_TIMEOUTS if key in policy}
    check_timeouts(config, timeouts, prefix=f"{where}: ", setting="beat_schedule")
    return policy


def _seconds(where: str, key: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise _refused(f"{where}[{key!r}] must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _label(name: object) -> str:
    """An entry name for a message: its repr, cut short if long."""
    text = repr(name)
    return text if len(text) <= 60 else f"{text[:40]}…"
