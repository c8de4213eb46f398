"""The one-write enqueue packs its ``EVALSHA`` as redis-py would, in one call where it can."""

from __future__ import annotations

import redis.connection as rc

from celery_exactonce.stores.redis import enqueue

COMMAND = ("EVALSHA", "a" * 40, 2, "ns:job:t:1", "ns:state:DISPATCHED", 9, "é", '{"k":1}', 12)


def test_the_command_is_packed_as_redis_py_packs_it_with_hiredis_or_without() -> None:
    hiredis_conn = rc.Connection()
    python_conn = rc.Connection()
    python_conn._command_packer = rc.PythonRespSerializer(6000, python_conn.encoder.encode)
    assert type(hiredis_conn._command_packer) is rc.HiredisRespSerializer  # redis[hiredis]
    for conn in (hiredis_conn, python_conn):
        assert b"".join(enqueue._packed(conn, COMMAND)) == b"".join(conn.pack_command(*COMMAND))
