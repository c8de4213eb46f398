"""Real Redis servers restarted or misconfigured (a private server per test)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.core.jobs import CreateStatus
from tests.integration.redis_server import redis_server
from tests.support.helpers import occurrence, poll


def _config(url: str) -> ExactOnceConfig:
    app = Celery("redis-server-test", set_as_current=False)
    app.conf.exactonce_store_url = url
    return ExactOnceConfig.from_app(app)


def test_restart_without_persistence_is_detected_by_the_next_claim() -> None:
    with redis_server() as server:
        store = open_store(_config(server.url))
        try:
            # Given a node that claimed a slot under the store's epoch
            epoch = store.epoch()
            fire = store.now().replace(microsecond=0)
            assert store.create(occurrence("e", fire), epoch=epoch).created
            # When Redis is killed and comes back empty
            server.kill()
            with pytest.raises(StoreUnavailable):
                store.get(occurrence("e", fire).ref)
            server.start()

            # Then the next claim with the remembered epoch is refused, writing nothing
            def claim() -> CreateStatus | None:
                try:
                    return store.create(
                        occurrence("e", fire + timedelta(seconds=1)), epoch=epoch
                    ).status
                except StoreUnavailable:
                    return None  # reconnecting

            assert poll(claim) is CreateStatus.EPOCH_MISMATCH
            assert store.get(occurrence("e", fire + timedelta(seconds=1)).ref) is None
            assert store.epoch() != epoch
        finally:
            store.close()


def test_eviction_policy_other_than_noeviction_refuses_start_up() -> None:
    with redis_server("--maxmemory-policy", "allkeys-lru") as server:
        with pytest.raises(ConfigurationError, match="noeviction") as info:
            open_store(_config(server.url))
        assert info.value.setting == "exactonce_store_url"


def test_noeviction_server_is_accepted() -> None:
    with redis_server("--maxmemory-policy", "noeviction") as server:
        store = open_store(_config(server.url))
        try:
            assert store.now() is not None
        finally:
            store.close()


def test_batched_writes_load_their_script_again_after_a_script_flush() -> None:
    with redis_server() as server:
        store = open_store(_config(server.url))
        try:
            # Given a store whose batches ran once (their scripts are cached by sha)
            fire = store.now().replace(microsecond=0)
            assert [r.created for r in store.create_many([occurrence("a", fire)])] == [True]
            # When the server forgets every script (a restart keeps data, not scripts)
            redis.Redis.from_url(server.url).script_flush()
            # Then the next batch loads the script and runs each call exactly once
            later = [occurrence(name, fire) for name in ("b", "c")]
            assert [r.status for r in store.create_many(later)] == [CreateStatus.CREATED] * 2
            again = store.create_many(later)
            assert [r.status for r in again] == [CreateStatus.EXISTS] * 2
        finally:
            store.close()
