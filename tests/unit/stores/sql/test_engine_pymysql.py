"""How the SQL store runs work of the caller's while a PyMySQL statement's answer is out
(:func:`~celery_exactonce.stores.sql.engine.execute`)."""

from __future__ import annotations

from typing import Any

import pytest
from pymysql.connections import Connection

from celery_exactonce.stores.sql import engine as sql_engine


class _Wire(Connection):  # type: ignore[misc]
    """A PyMySQL connection that records what goes on the wire instead of using one."""

    def __init__(self, events: list[str], fail: BaseException | None = None) -> None:
        super().__init__(defer_connect=True)
        self.events, self.fail = events, fail
        self.server_status = 0  # as a server's first answer leaves it: backslash escapes

    def _execute_command(self, command: int, sql: Any) -> None:
        self.events.append(f"sent {sql!r}")

    def _read_query_result(self, unbuffered: bool = False) -> int:
        self.events.append("read")
        if self.fail is not None:
            raise self.fail
        self._result = None
        return 1


class _Cursor:
    """The part of PyMySQL's cursor :func:`sql_engine._pymysql_meanwhile` drives: ``execute``."""

    def __init__(self, connection: _Wire) -> None:
        self.connection = connection

    def execute(self, sql: str, values: Any) -> None:
        query = sql % tuple(self.connection.escape(value) for value in values)
        self.connection.query(query)


def test_meanwhile_runs_once_after_the_query_is_sent_and_before_its_answer_is_read() -> None:
    events: list[str] = []
    wire = _Wire(events)
    assert sql_engine._pymysql_overlaps(wire) and sql_engine.overlaps(wire)
    sql_engine._pymysql_meanwhile(
        _Cursor(wire), "INSERT INTO t VALUES (%s)", ("a'b",), lambda: events.append("meanwhile")
    )
    # Sent bound and escaped, then the caller's work, then the answer read
    assert events == ["sent b\"INSERT INTO t VALUES ('a\\\\'b')\"", "meanwhile", "read"]
    # And the connection is PyMySQL's own again: a later answer is read without it
    assert "_read_query_result" not in vars(wire)
    wire.query("COMMIT")
    assert events[-1] == "read" and events.count("meanwhile") == 1


def test_what_meanwhile_raises_is_raised_once_the_answer_is_read() -> None:
    events: list[str] = []

    def meanwhile() -> None:
        raise ValueError("build failed")

    wire = _Wire(events)
    with pytest.raises(ValueError, match="build failed"):
        sql_engine._pymysql_meanwhile(_Cursor(wire), "SELECT %s", (1,), meanwhile)
    assert events == ["sent b'SELECT 1'", "read"] and "_read_query_result" not in vars(wire)


def test_a_refused_statement_raises_its_error_and_leaves_the_connection_as_it_was() -> None:
    events: list[str] = []
    wire = _Wire(events, fail=RuntimeError("1062 duplicate"))
    with pytest.raises(RuntimeError, match="1062"):
        sql_engine._pymysql_meanwhile(
            _Cursor(wire), "SELECT %s", (1,), lambda: events.append("meanwhile")
        )
    assert events == ["sent b'SELECT 1'", "meanwhile", "read"]
    assert "_read_query_result" not in vars(wire)


def test_on_a_connection_with_answers_left_unread_meanwhile_runs_first() -> None:
    """PyMySQL reads an earlier message's answers before it sends: those are not this one's."""

    class Left:
        has_next = True

    events: list[str] = []
    wire = _Wire(events)
    wire._result = Left()
    sql_engine._pymysql_meanwhile(
        _Cursor(wire), "SELECT %s", (1,), lambda: events.append("meanwhile")
    )
    assert events == ["meanwhile", "sent b'SELECT 1'", "read"]
    assert "_read_query_result" not in vars(wire)


def test_only_a_pymysql_connection_is_driven() -> None:
    class Other:  # mysqlclient, psycopg 2, sqlite3: meanwhile runs before the statement
        autocommit = False

    assert not sql_engine._pymysql_overlaps(Other()) and not sql_engine.overlaps(Other())
