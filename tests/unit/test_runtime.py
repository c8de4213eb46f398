"""The per-process runtime of an app (celery_exactonce/runtime.py): config, store and dispatcher.

The config is read and validated once per app; the runtime is built once per
process (again in a forked child, never closing the parent's store), from the
settings or around a store handed in; :func:`~celery_exactonce.runtime.reset`
forgets both and closes only a store the runtime opened. Stores are in memory,
or a Redis URL on a closed port where a test shows that nothing touches the network.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, StoreError, StoreUnavailable, runtime
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core.refs import JobRef, process_id
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores import signing
from celery_exactonce.testing import InMemoryStore

#: Nothing listens on port 1: a connection there is refused at once.
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    """Builds apps with ``exactonce_*`` settings (memory store unless told); resets each after."""
    made: list[Celery] = []

    def build(**settings: Any) -> Celery:
        app = Celery(f"runtime-unit-{len(made)}", set_as_current=False)
        conf = {"store_url": "memory://", **settings}
        app.conf.update({f"exactonce_{name}": value for name, value in conf.items()})
        made.append(app)
        return app

    yield build
    for app in made:
        runtime.reset(app)


def a_record(store: Any, job_id: str = "r-1") -> None:
    created = store.create(NewJob(JobRef.submitted(job_id), "t.x", State.SCHEDULED, node="n"))
    assert created.created


# -- the config ----------------------------------------------------------------------------


def test_the_config_of_an_app_is_read_once_until_reset(make_app: Callable[..., Celery]) -> None:
    app = make_app(namespace="first")
    config = runtime.config_for(app)
    assert config.namespace == "first"
    # A setting changed afterwards is not seen: the config was read once
    app.conf.exactonce_namespace = "second"
    assert runtime.config_for(app) is config
    # until the app is reset
    runtime.reset(app)
    assert runtime.config_for(app).namespace == "second"


def test_a_refused_config_is_refused_every_time_never_kept(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(dispatch_timeout=30)  # not above replay_age (60 s)
    for _ in range(2):
        with pytest.raises(ConfigurationError) as info:
            runtime.config_for(app)
        assert info.value.setting == "exactonce_dispatch_timeout"
    with pytest.raises(ConfigurationError):
        runtime.runtime_for(app)
    # Once the setting is fixed, the next call reads it: nothing refused was kept
    app.conf.exactonce_dispatch_timeout = 120
    assert runtime.config_for(app).dispatch_timeout == 120


def test_apps_each_have_their_own_config_and_runtime(make_app: Callable[..., Celery]) -> None:
    first, second = make_app(namespace="one"), make_app(namespace="two")
    one, two = runtime.runtime_for(first), runtime.runtime_for(second)
    assert one is not two and one.store is not two.store
    assert (one.store.namespace, two.store.namespace) == ("one", "two")
    # Resetting one app leaves the other's runtime and store alone
    runtime.reset(first)
    assert runtime.runtime_for(second) is two
    assert two.store.get(JobRef.submitted("absent")) is None


# -- the runtime ---------------------------------------------------------------------------


def test_the_runtime_is_built_once_from_the_settings(make_app: Callable[..., Celery]) -> None:
    app = make_app(namespace="built")
    built = runtime.runtime_for(app)
    assert runtime.runtime_for(app) is built
    assert built.app is app and built.config is runtime.config_for(app)
    assert built.pid == os.getpid() and built.owns_store
    assert isinstance(built.store, InMemoryStore) and built.store.namespace == "built"
    # No node id set: the node is this host and process
    assert built.node == f"{socket.gethostname()}:{os.getpid()}"
    assert built.signer is None and built.store_error_at is None


def test_the_node_id_setting_names_the_node_and_its_dispatcher(
    make_app: Callable[..., Celery],
) -> None:
    built = runtime.runtime_for(make_app(node_id="node-7"))
    assert built.node == "node-7" and built.dispatcher.node == "node-7"


def test_the_dispatcher_follows_the_settings(make_app: Callable[..., Celery]) -> None:
    app = make_app(publish_timeout=7.0, retry_delay_store=0.25, replay_age=90.0)
    built = runtime.runtime_for(app)
    dispatcher = built.dispatcher
    assert dispatcher.store is built.store
    assert dispatcher.publisher.timeout == 7.0  # type: ignore[attr-defined]
    assert dispatcher.retrier is not None
    # A failed dispatch is retried from retry_delay_store until the reconciler replays it
    assert (dispatcher.retrier.first_delay, dispatcher.retrier.give_up_after) == (0.25, 90.0)


def test_first_uses_from_many_threads_at_once_build_one_runtime(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    barrier = threading.Barrier(8)
    built: list[runtime.Runtime] = []
    lock = threading.Lock()

    def first_use() -> None:
        barrier.wait(timeout=10)
        found = runtime.runtime_for(app)
        with lock:
            built.append(found)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(built) == 8
    assert all(found is built[0] for found in built)


def test_a_runtime_inherited_across_a_fork_is_rebuilt_the_parents_store_left_open(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    inherited = runtime.runtime_for(app)
    a_record(inherited.store)
    # Given the runtime was built by another process (a prefork child sees its parent's)
    inherited.pid = os.getpid() + 1
    # When this process uses the app
    rebuilt = runtime.runtime_for(app)
    # Then it builds its own runtime and store client
    assert rebuilt is not inherited and rebuilt.pid == os.getpid()
    assert rebuilt.store is not inherited.store
    assert runtime.runtime_for(app) is rebuilt
    # and leaves the parent's store open: closing it would close the parent's sockets
    assert inherited.store.get(JobRef.submitted("r-1")) is not None


def test_a_forked_child_is_told_its_own_process_id_without_asking_the_kernel_each_time() -> None:
    # Given this process's id, as every per-process cache checks it
    assert process_id() == os.getpid()
    # When the process forks, the child reports what it is told
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's lines run in the child)
        os.write(write, f"{process_id()} {os.getpid()}".encode())
        os._exit(0)
    os.close(write)
    told, actual = os.read(read, 64).decode().split()
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    # Then the child was told its own id, not its parent's
    assert int(told) == int(actual) == child != process_id()


def test_reset_closes_the_store_the_runtime_opened(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    first = runtime.runtime_for(app)
    runtime.reset(app)
    with pytest.raises(StoreError, match="closed"):
        first.store.get(JobRef.submitted("any"))
    # The next use builds a new runtime, with a store of its own
    second = runtime.runtime_for(app)
    assert second is not first
    assert second.store.get(JobRef.submitted("any")) is None


def test_reset_leaves_a_store_opened_by_another_process_open(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    inherited = runtime.runtime_for(app)
    inherited.pid = os.getpid() + 1  # built by the parent of a forked child
    runtime.reset(app)
    assert inherited.store.get(JobRef.submitted("any")) is None  # still open
    assert runtime.runtime_for(app) is not inherited


def test_reset_of_an_app_never_used_does_nothing(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    runtime.reset(app)
    assert runtime.runtime_for(app).store.get(JobRef.submitted("any")) is None


def test_an_installed_store_is_used_and_never_closed_by_reset(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(namespace="settings")
    mine = InMemoryStore("mine")
    installed = runtime.install(app, mine)
    assert runtime.runtime_for(app) is installed
    assert installed.store is mine and installed.dispatcher.store is mine
    assert not installed.owns_store
    # The store belongs to whoever handed it in: reset forgets the runtime, not the store
    runtime.reset(app)
    a_record(mine)
    assert runtime.runtime_for(app) is not installed
    assert runtime.runtime_for(app).store is not mine


def test_install_replaces_the_runtime_built_before(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    built = runtime.runtime_for(app)
    mine = InMemoryStore("default")
    installed = runtime.install(app, mine)
    assert installed is not built and runtime.runtime_for(app) is installed
    # The store the replaced runtime opened is closed, as reset closes it
    with pytest.raises(StoreError, match="closed"):
        built.store.get(JobRef.submitted("any"))


def test_install_leaves_a_store_handed_in_before_open(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    first, second = InMemoryStore("default"), InMemoryStore("default")
    runtime.install(app, first)
    runtime.install(app, second)
    assert runtime.runtime_for(app).store is second
    a_record(first)  # still open: it belongs to whoever handed it in


def test_install_takes_a_config_of_its_own(make_app: Callable[..., Celery]) -> None:
    app = make_app(namespace="settings")
    config = ExactOnceConfig(store_url="memory://", namespace="given", node_id="given-node")
    installed = runtime.install(app, InMemoryStore("given"), config)
    assert installed.config is config and installed.node == "given-node"


def test_a_runtime_built_without_setup_touches_no_store(make_app: Callable[..., Celery]) -> None:
    """The worker gate builds its runtime with ``setup=False``: a store outage must reach
    the gate's own error handling, not fail the task before it."""
    app = make_app(store_url=UNREACHABLE_REDIS)
    # Given a store that cannot be reached, a runtime with setup is refused, and not kept
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            runtime.runtime_for(app)
    # When the runtime is built without setup, nothing is connected: it is built
    quiet = runtime.runtime_for(app, setup=False)
    assert quiet.owns_store and quiet.store.namespace == "default"
    # and it is the one every later use gets
    assert runtime.runtime_for(app) is quiet


def test_the_latest_store_error_is_kept(make_app: Callable[..., Celery]) -> None:
    built = runtime.runtime_for(make_app())
    built.note_store_error(100.0)
    built.note_store_error(50.0)  # an older error, noted late, moves nothing back
    assert built.store_error_at == 100.0
    built.note_store_error(150.0)
    assert built.store_error_at == 150.0


def test_a_store_error_noted_without_a_time_is_noted_now(make_app: Callable[..., Celery]) -> None:
    built = runtime.runtime_for(make_app())
    before = time.monotonic()
    built.note_store_error()
    after = time.monotonic()
    assert built.store_error_at is not None and before <= built.store_error_at <= after


def test_a_signing_key_signs_every_write_and_arms_the_dispatcher(
    make_app: Callable[..., Celery],
) -> None:
    mine = InMemoryStore("default")
    signed = runtime.install(make_app(signing_key="k" * 32), mine)
    assert signed.signer is not None and signed.dispatcher.signer is signed.signer
    assert isinstance(signed.store, signing.SigningStore) and signed.store.inner is mine
    a_record(signed.store)
    record = mine.get(JobRef.submitted("r-1"))
    assert record is not None and record.signature
    assert signed.signer.problem(record) is None
    # Without a key the store is the one handed in, and nothing is signed
    plain = runtime.install(make_app(), InMemoryStore("default"))
    assert plain.signer is None and plain.dispatcher.signer is None
    assert isinstance(plain.store, InMemoryStore)
