"""How the SQL store drives psycopg's ``execute`` generator to run work while its answer is out."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
from psycopg.waiting import Wait

from celery_exactonce.stores.sql import pgwire


def _statement(events: list[str]) -> Generator[Any, Any, str]:
    """psycopg's shape: wait to write (send), then to read twice, then the answer."""
    events.append("sent")
    yield Wait.W
    yield Wait.R
    events.append("read")
    yield Wait.R
    return "answer"


def _drive(gen: Generator[Any, Any, Any]) -> tuple[list[Any], Any]:
    waits = []
    try:
        waits.append(next(gen))
        while True:
            waits.append(gen.send(True))
    except StopIteration as stop:
        return waits, stop.value


def test_meanwhile_runs_once_at_the_first_wait_to_read_and_the_answer_passes_through() -> None:
    events: list[str] = []
    waits, answer = _drive(
        pgwire.at_first_read(_statement(events), lambda: events.append("meanwhile"))
    )
    # The waits are psycopg's own, the work ran once, after the send and before any read
    assert waits == [Wait.W, Wait.R, Wait.R] and answer == "answer"
    assert events == ["sent", "meanwhile", "read"]


def test_what_meanwhile_raises_is_raised_once_the_answer_is_read() -> None:
    events: list[str] = []

    def meanwhile() -> None:
        raise ValueError("build failed")

    with pytest.raises(ValueError, match="build failed"):
        _drive(pgwire.at_first_read(_statement(events), meanwhile))
    # The statement's answer was read all the same: the connection is left idle
    assert events == ["sent", "read"]


def test_a_kept_statement_numbers_its_parameters_once_each_in_order() -> None:
    form = pgwire.kept("SELECT %(a)s, %(b)s || %(a)s, 'x%%'")
    assert form.query == b"SELECT $1, $2 || $1, 'x%'" and form.keys == ("a", "b")
    assert form.name.startswith(b"exactonce_") and pgwire.kept("SELECT %(a)s, %(b)s") is not form


def test_a_statement_kept_under_its_settings_is_another_prepared_statement() -> None:
    sql = "UPDATE t SET a = %(a)s WHERE k = %(k)s"
    plain, by_key = pgwire.kept(sql), pgwire.kept(sql, pgwire.BY_KEY)
    # The settings are set with the mode, for the statement's implicit transaction alone
    assert by_key.setup == (
        b"SELECT set_config('plan_cache_mode', 'force_generic_plan', true),"
        b" set_config('enable_seqscan', 'off', true)"
    )
    assert plain.setup == b"SELECT set_config('plan_cache_mode', 'force_generic_plan', true)"
    # A plan made under other settings is another statement's, by its name
    assert by_key.query == plain.query and by_key.name != plain.name
    assert pgwire.kept(sql, pgwire.BY_KEY) is by_key
    with pytest.raises(ValueError, match="not a setting"):
        pgwire.Kept(sql, (("enable_seqscan", "off', true); DROP TABLE t; --"),))


def test_only_a_psycopg_3_connection_may_keep_a_plan() -> None:
    class Other:  # psycopg2, or any other driver: no libpq connection of psycopg 3's
        autocommit = True

    other = Other()
    pgwire.allow(other)
    assert not pgwire.keeps(other)
