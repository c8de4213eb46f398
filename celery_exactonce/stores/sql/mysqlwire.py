"""A statement on a PyMySQL connection with work of the caller's run while its answer is out.

PyMySQL's ``Cursor.execute`` binds the values (``mogrify``), writes the query
packet (``Connection._execute_command``) and then waits to read the answer
(``Connection._read_query_result``), all in one call. :func:`execute_meanwhile`
runs ``meanwhile`` at that wait: the statement (and, sent with it, its
``COMMIT``) is on the server while the caller builds its message. The
caller's own order is unchanged: the message is sent only after this
answers that the record is the caller's.

It takes one private name, ``_read_query_result``, which PyMySQL calls right
after the query packet is written: for this one call it is wrapped on the
connection, run ``meanwhile`` first, and is restored at its first call.
Everything else is the cursor's own ``execute``. :func:`splits` says whether
the PyMySQL here has that name; elsewhere ``meanwhile`` runs before the
statement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_READ = "_read_query_result"


@functools.cache
def splits() -> bool:
    """Whether PyMySQL is here, and reads a query's answer by ``_read_query_result``."""
    try:
        from pymysql.connections import Connection  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - PyMySQL not installed
        return False
    reads = getattr(Connection, _READ, None)
    return callable(reads) and callable(getattr(Connection, "query", None))


def overlaps(driver: Any) -> bool:
    """Whether ``driver`` is a PyMySQL connection :func:`execute_meanwhile` can drive."""
    if not splits():
        return False
    from pymysql.connections import Connection

    return isinstance(driver, Connection) and _READ not in vars(driver)


def execute_meanwhile(cursor: Any, sql: str, values: Any, meanwhile: Callable[[], None]) -> None:
    """``cursor.execute(sql, values)`` with ``meanwhile`` run once its query is sent.

    ``meanwhile`` runs after the query packet is written and before a byte of
    the answer is read; what it raises is raised once the answer is read
    (the connection left as ``execute`` leaves it). If the query cannot be
    sent, ``meanwhile`` does not run; the error is ``execute``'s. On a
    connection with answers of an earlier message still unread (which
    ``execute`` reads first), ``meanwhile`` runs before the statement.
    """
    driver = cursor.connection
    if getattr(getattr(driver, "_result", None), "has_next", False):
        # PyMySQL would first read the answers an earlier message left: not this one's
        meanwhile()
        cursor.execute(sql, values)
        return
    read = getattr(driver, _READ)
    failed: list[BaseException] = []

    def read_after(*args: Any, **kwargs: Any) -> Any:
        vars(driver).pop(_READ, None)  # once: a later answer (the COMMIT's) is read as ever
        try:
            meanwhile()
        except BaseException as exc:  # raised below, once the answer is read
            failed.append(exc)
        return read(*args, **kwargs)

    setattr(driver, _READ, read_after)
    try:
        cursor.execute(sql, values)
    finally:
        vars(driver).pop(_READ, None)
    if failed:
        raise failed[0]
