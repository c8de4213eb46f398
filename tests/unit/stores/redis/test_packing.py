"""The store's commands are packed as redis-py packs them, by hiredis in one call where it can."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.connection as rc

from celery_exactonce.stores.redis.client import HiredisPacker, client_from_url, packed

COMMAND = ("EVALSHA", "a" * 40, 2, "ns:job:t:1", "ns:state:DISPATCHED", 9, "é", '{"k":1}', 12)


def _redis_py(*args: Any) -> bytes:
    return b"".join(rc.HiredisRespSerializer().pack(*args))


def test_the_command_is_packed_as_redis_py_packs_it_with_hiredis_or_without() -> None:
    hiredis_conn = rc.Connection()
    ours = rc.Connection(command_packer=HiredisPacker())
    python_conn = rc.Connection()
    python_conn._command_packer = rc.PythonRespSerializer(6000, python_conn.encoder.encode)
    assert type(hiredis_conn._command_packer) is rc.HiredisRespSerializer  # redis[hiredis]
    for conn in (hiredis_conn, ours, python_conn):
        assert b"".join(packed(conn, COMMAND)) == b"".join(conn.pack_command(*COMMAND))


@pytest.mark.parametrize(
    "command",
    [
        COMMAND,
        ("SET", b"k", memoryview(b"v")),
        ("SET", "k", bytearray(b"v")),  # hiredis refuses it: redis-py converts it
        ("SET", "k", 1.5),
        ("SCRIPT LOAD", "return 1"),  # a name of two words: redis-py splits it
        (b"CLIENT SETNAME", "n"),
    ],
)
def test_the_stores_packer_packs_every_command_as_redis_py(command: tuple[Any, ...]) -> None:
    assert b"".join(HiredisPacker().pack(*command)) == _redis_py(*command)


def test_what_redis_py_refuses_the_stores_packer_refuses_the_same_way() -> None:
    for value in (None, True):
        with pytest.raises(redis.DataError):
            HiredisPacker().pack("SET", "k", value)


def test_the_stores_own_client_packs_with_it() -> None:
    client = client_from_url("redis://127.0.0.1:1/0", 1.0, {})
    assert isinstance(client.connection_pool.connection_kwargs["command_packer"], HiredisPacker)
    connection = client.connection_pool.make_connection()
    assert isinstance(connection._command_packer, HiredisPacker)
