"""A statement whose plan does not depend on its values, run on PostgreSQL with a kept plan.

The store's PostgreSQL connections plan every run of a statement anew
(``plan_cache_mode = force_custom_plan``, set as each connects: see
:mod:`~celery_exactonce.stores.sql.engine`): a generic plan made while a
table was nearly empty would read the whole table for one key. An ``INSERT …
SELECT`` of bound values reads no table for its plan (its ``ON CONFLICT``
arbiter is the primary key whatever the statistics), so its generic plan is
the custom one, made once instead of on every run (40-80 µs of the server's
time a submit). :func:`run_kept` sends, in one message through libpq's
pipeline mode:

* ``set_config('plan_cache_mode', 'force_generic_plan', true)``: for this
  implicit transaction only (``SET LOCAL`` would warn outside a ``BEGIN``),
  with the statement's own settings (:data:`BY_KEY`) the same way;
* ``PREPARE`` of the statement (by name), the first time on this connection;
* its execution, the values bound as parameters (text format);
* the ``Sync`` that ends the implicit transaction: in autocommit, the commit,
  and the mode back to the connection's own, whatever happened.

If one fails, none took effect. A prepared statement the connection lost (a
``DEALLOCATE ALL``, or another server connection behind a transaction
pooler) is prepared again, and one the server has already (a pooler again)
is run; nothing was written by the attempt that found out.

A statement that reads a table is kept only if its generic plan is its
custom one whatever the statistics: the brief one-row ``UPDATE`` of the gate
(:data:`BY_KEY`). Its conditions other than the key name no index (a guard
on the state is wrapped in ``IS TRUE``, and every other index of the jobs
table is partial, its predicate unproven for a parameter), so with
``enable_seqscan`` off, whatever the table held when the plan was made, the
primary key is the one way to its row; an ``ANALYZE`` that invalidates the
plan replans it in the same message, under the same settings.

On the connections :func:`allow` names (the store's engine's; Django's), for
statements with ``%(name)s`` parameters bound to ``str``, ``int`` or ``None``.

Elsewhere a statement goes as psycopg's ``execute`` sends it, work of the
caller's run at its first wait to read (:func:`at_first_read`, where
:func:`splits`).
"""

from __future__ import annotations

import functools
import hashlib
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Settings = tuple[tuple[str, str], ...]
"""Settings a kept statement runs (and is planned) under, as ``(name, value)`` pairs."""

#: A statement whose plan reads no table (an ``INSERT`` of bound values): no setting.
AS_IS: Settings = ()
#: A statement that finds its one row by its key: no plan but by an index.
BY_KEY: Settings = (("enable_seqscan", "off"),)
_SETTING = re.compile(r"\w+")
_UNDEFINED_PREPARED = "26000"  # invalid_sql_statement_name
_DUPLICATE_PREPARED = "42P05"  # duplicate_prepared_statement
_PARAM = re.compile(r"%\((\w+)\)s|%%")
_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open on the connection

#: The connections statements may be prepared on, with the statements prepared on each.
_PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


@functools.cache
def supported() -> bool:
    """Whether psycopg 3 is here, on a libpq with pipeline mode (14 or later)."""
    try:
        from psycopg import Pipeline
    except ImportError:  # pragma: no cover - psycopg 3 not installed
        return False
    return bool(Pipeline.is_supported())


def allow(driver: Any) -> None:
    """Let :func:`run_kept` prepare statements on ``driver`` if it is a psycopg 3
    connection on a libpq with pipeline mode (else nothing changes)."""
    if driver not in _PREPARED and hasattr(driver, "pgconn") and supported():
        _PREPARED[driver] = set()


def keeps(driver: Any) -> bool:
    """Whether :func:`run_kept` can run a statement on ``driver``: one :func:`allow`
    named, in autocommit, outside any pipeline or transaction (its ``Sync`` commits)."""
    return (
        driver in _PREPARED
        and driver.autocommit is True
        and getattr(driver, "_pipeline", None) is None
        and driver.pgconn.transaction_status == _IDLE
    )


class Kept:
    """A statement's text for :func:`run_kept`: ``$n`` parameters, and its name."""

    __slots__ = ("keys", "name", "query", "setup")

    def __init__(self, sql: str, settings: Settings = AS_IS) -> None:
        keys: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"
            if match.group(1) not in keys:
                keys.append(match.group(1))
            return f"${keys.index(match.group(1)) + 1}"

        text = _PARAM.sub(number, sql)
        self.keys = tuple(keys)
        self.query = text.encode()
        # For the rest of the implicit transaction (``SET LOCAL`` would warn there).
        configs = [("plan_cache_mode", "force_generic_plan"), *settings]
        if not all(_SETTING.fullmatch(part) for pair in configs for part in pair):
            raise ValueError(f"not a setting: {settings!r}")
        self.setup = (
            "SELECT " + ", ".join(f"set_config('{n}', '{v}', true)" for n, v in configs)
        ).encode()
        # The plan is made under the settings: another set, another statement.
        digest = hashlib.sha256(self.setup + b"\0" + self.query).hexdigest()[:24]
        self.name = f"exactonce_{digest}".encode()


_KEPT: dict[tuple[str, Settings], Kept] = {}


def kept(sql: str, settings: Settings = AS_IS) -> Kept:
    """The :class:`Kept` form of ``sql`` (``%(name)s`` parameters) under ``settings``, made once."""
    form = _KEPT.get((sql, settings))
    if form is None:
        form = _KEPT[sql, settings] = Kept(sql, settings)
    return form


def _encode(value: Any, encoding: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode(encoding)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(f"no text form for a {type(value).__name__} parameter")


def _exchange(pgconn: Any, meanwhile: Callable[[], None] | None) -> Any:
    """psycopg's wait protocol: flush, run ``meanwhile``, read every result up to the Sync.

    Answers the results, and what ``meanwhile`` raised (``None``: nothing).
    """
    from psycopg import pq
    from psycopg.waiting import Ready, Wait

    while pgconn.flush() != 0:
        if (yield Wait.RW) & Ready.R:
            pgconn.consume_input()
    failed: BaseException | None = None
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException as exc:  # raised once every result is read
            failed = exc
    results = []
    while True:
        while pgconn.is_busy():
            if (yield Wait.R):
                pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            continue
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            break
        results.append(result)
    return results, failed


def values_of(driver: Any, form: Kept, values: Mapping[str, Any]) -> list[bytes | None]:
    """``form``'s parameters from ``values``, in text format; ``TypeError``: a value that
    is not a ``str``, an ``int`` or ``None`` (nothing is sent)."""
    encoding = driver.info.encoding
    return [_encode(values[key], encoding) for key in form.keys]


def run_kept(driver: Any, form: Kept, params: list[bytes | None], meanwhile: Any) -> Any:
    """Run ``form`` on ``driver`` (:func:`keeps`) with a kept plan: its rows, as
    ``Cursor.fetchall`` answers them (``None``: it answers none).

    ``meanwhile`` runs once, while the statement and its commit are on the way.
    """
    (rows,) = run_kept_many(driver, [(form, params)], meanwhile)
    return rows


def run_kept_many(
    driver: Any, items: Sequence[tuple[Kept, list[bytes | None]]], meanwhile: Any = None
) -> list[Any]:
    """Run every ``(form, params)`` of ``items`` on ``driver`` (:func:`keeps`), each with a
    kept plan, in one message and one implicit transaction: each one's rows, in order.

    The settings are the first form's (every form must share them). One ``Sync``
    ends them all: in autocommit, one commit. If one fails, none took effect.
    ``meanwhile`` runs once, while the statements and their commit are on the way.
    """
    from psycopg import errors, pq

    pgconn = driver.pgconn
    encoding = driver.info.encoding
    prepared = _PREPARED[driver]
    ok = pq.ExecStatus.COMMAND_OK
    with driver.lock:
        for attempt in range(len(items) + 1):  # each retry finds one more form lost, or there
            preparing = [form.name not in prepared for form, _ in items]
            pgconn.enter_pipeline_mode()
            try:
                _send(pgconn, items, preparing)
                results, failed = driver.wait(_exchange(pgconn, meanwhile if not attempt else None))
                pgconn.exit_pipeline_mode()
            except BaseException:
                if pgconn.pipeline_status != pq.PipelineStatus.OFF:
                    driver.close()  # results left unread: the pool must not reuse it
                raise
            if failed is not None:  # every result read: the connection is as it was
                raise failed
            # Each result after the settings': a form's PREPARE (if sent), then its run.
            answers, steps = [], []
            for (form, _), prepare in zip(items, preparing, strict=True):
                if prepare:
                    steps.append((form, True))
                steps.append((form, False))
            for (form, prepares), result in zip(steps, results[1:], strict=True):
                if prepares and result.status == ok:  # prepared, whatever came after
                    prepared.add(form.name)
                elif not prepares:
                    answers.append(result)
            failure = next(
                (i for i, r in enumerate(results) if r.status == pq.ExecStatus.FATAL_ERROR), None
            )
            if failure is None:
                break
            error = results[failure]
            sqlstate = (error.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
            if failure == 0 or attempt == len(items):
                raise errors.error_from_result(error, encoding=encoding)
            form, prepares = steps[failure - 1]
            # Nothing was written. A form there already (a pooler's other connection):
            # run it; one lost (DEALLOCATE ALL; a pooler again): prepare it again.
            if prepares and sqlstate == _DUPLICATE_PREPARED:
                prepared.add(form.name)
            elif not prepares and sqlstate == _UNDEFINED_PREPARED:
                prepared.discard(form.name)
            else:
                raise errors.error_from_result(error, encoding=encoding)
    return _rows(driver, answers)


def _send(pgconn: Any, items: Sequence[tuple[Kept, list[bytes | None]]], prepare: Any) -> None:
    """Queue the settings, each form's ``PREPARE`` (where ``prepare`` says) and run, a ``Sync``."""
    pgconn.send_query_params(items[0][0].setup, None)
    for (form, params), prepares in zip(items, prepare, strict=True):
        if prepares:
            pgconn.send_prepare(form.name, form.query)
        pgconn.send_query_prepared(form.name, params)
    pgconn.pipeline_sync()


def _rows(driver: Any, answers: list[Any]) -> list[Any]:
    """Each answer's rows, as ``Cursor.fetchall`` answers them (``None``: it answers none)."""
    from psycopg import pq
    from psycopg.adapt import Transformer

    loader = Transformer(driver)
    rows: list[Any] = []
    for answer in answers:
        if answer.status == pq.ExecStatus.COMMAND_OK:
            rows.append(None)
            continue
        loader.set_pgresult(answer)
        rows.append(loader.load_rows(0, answer.ntuples, tuple))
    return rows


@functools.cache
def splits() -> bool:
    """Whether psycopg 3 is here with the part of its cursor :func:`~.engine.execute` drives itself.

    ``Cursor._execute_gen`` is the generator ``Cursor.execute`` runs: it sends
    the statement (with its ``Sync``: in autocommit, the commit too) and then
    waits to read the answer. :func:`~.engine.execute` runs a function at that wait.
    """
    try:
        from psycopg import Cursor
        from psycopg.waiting import Wait
    except ImportError:  # pragma: no cover - psycopg 3 not installed
        return False
    return hasattr(Cursor, "_execute_gen") and hasattr(Wait, "R")


def at_first_read(gen: Any, meanwhile: Callable[[], None]) -> Any:
    """Drive psycopg's generator ``gen``, running ``meanwhile`` once, at its first wait to read.

    By then the statement is sent: the server works on it while ``meanwhile``
    runs. What ``meanwhile`` raises is raised once ``gen`` has read its
    answer, so the connection is left as ``Cursor.execute`` leaves it.
    """
    from psycopg.waiting import Wait

    failed: BaseException | None = None
    pending: Callable[[], None] | None = meanwhile
    try:
        wait = next(gen)
        while True:
            if pending is not None and wait == Wait.R:
                try:
                    pending()
                except BaseException as exc:  # raised below, once the answer is read
                    failed = exc
                pending = None
            wait = gen.send((yield wait))
    except StopIteration as stop:
        if failed is not None:
            raise failed from None
        return stop.value
