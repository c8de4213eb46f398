"""A Celery app whose store holds a job in every state, and the dashboard on it.

:class:`Site` is one store namespace (memory, Redis, PostgreSQL, MySQL or SQLite), seeded
with a job of its own in each state (``job-<state>``), an occurrence of the
beat entry :data:`NIGHTLY` and a range of its skipped slots; the Celery app on
it (the store URL of PostgreSQL carries the password :data:`SECRET`, the
broker URL :data:`BROKER_SECRET`: no page may show either); and
:meth:`Site.client`, Starlette's test client on
:func:`celery_exactonce.web.create_app`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_exactonce import runtime
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores import InMemoryStore, store_from_url
from celery_exactonce.stores.base import StateStore
from celery_exactonce.web import Auth
from tests import services
from tests.support import backends, helpers
from tests.support.helpers import NODE, move

pytest.importorskip("starlette", reason="the web extra is not installed")

#: The password the PostgreSQL store URL carries (trust authentication ignores it).
SECRET = "s3cret-pw"
#: The password of the broker URL (never connected: no page reads the broker).
BROKER_SECRET = "br0ker-pw"
BROKER_URL = f"amqp://guest:{BROKER_SECRET}@127.0.0.1:1//"
#: The beat entry of the seeded occurrence, and its slot.
NIGHTLY = "nightly-billing"
FIRE = datetime(2026, 5, 1, 3, tzinfo=timezone.utc)
#: Where the web tests run: the memory store, a SQLite file, and the servers of
#: tests/services.py.
WEB_BACKENDS = ("memory", "redis", "postgres", "mysql", "sqlite")


def store_url(backend: str, tmp_path: Path | None = None) -> str:
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        assert tmp_path is not None
        return f"sqlite:///{tmp_path / 'web.db'}"
    if backend == "postgres":
        return services.POSTGRES_URL.replace("postgres@", f"postgres:{SECRET}@", 1)
    return services.SERVICE_URLS[backend]


def make_app(url: str, namespace: str) -> Celery:
    """A Celery app on the store ``url`` and a broker it never connects to."""
    app = Celery(f"web-{namespace}", set_as_current=False)
    app.conf.update(
        broker_url=BROKER_URL,
        result_backend=None,
        task_ignore_result=True,
        timezone="UTC",
        exactonce_store_url=url,
        exactonce_namespace=namespace,
        beat_schedule={
            NIGHTLY: {"task": "web.bill", "schedule": crontab(minute="0", hour="3")},
        },
    )
    return app


def jobs_in_every_state(store: StateStore, prefix: str = "job") -> dict[State, Job]:
    """A submitted job of its own in each state, ``<prefix>-<state>``, of the task
    ``web.<state>`` (:func:`tests.support.helpers.jobs_in_every_state`)."""
    return helpers.jobs_in_every_state(store, prefix, task_prefix="web")


class Site:
    """One namespace of ``backend``, seeded, the app on it, and clients of its dashboard."""

    def __init__(self, backend: str, tmp_path: Path | None = None) -> None:
        self.backend = backend
        self.url = store_url(backend, tmp_path)
        self.namespace = f"web{uuid.uuid4().hex[:10]}"
        self.app = make_app(self.url, self.namespace)
        self.store: StateStore
        if backend == "memory":
            self.store = InMemoryStore(namespace=self.namespace)
            self.store.setup()
            runtime.install(self.app, self.store)
        else:
            self.store = store_from_url(self.url, namespace=self.namespace, retention=86_400)
            self.store.setup()
        self.jobs: dict[State, Job] = {}
        self.occurrence = JobRef.occurrence(occurrence_id(self.namespace, NIGHTLY, FIRE))

    def seed(self) -> Site:
        """A job in each state (``job-<state>``), the occurrence, and skipped slots."""
        self.jobs = jobs_in_every_state(self.store)
        new = NewJob(
            self.occurrence, "web.bill", State.SCHEDULED, node=NODE, entry=NIGHTLY, fire_time=FIRE
        )
        made = self.store.create(new).job
        assert made is not None
        move(self.store, made, State.DISPATCHED)
        self.store.note_skipped(
            [
                SkippedSlots(
                    NIGHTLY, "catchup", FIRE - timedelta(days=3), FIRE - timedelta(days=1), 3, NODE
                )
            ]
        )
        return self

    def client(
        self,
        *,
        actions: bool = False,
        auth: Auth | None = None,
        allowed_hosts: list[str] | None = None,
    ) -> Any:
        from starlette.testclient import TestClient

        from celery_exactonce.web import create_app

        web = create_app(self.app, actions=actions, auth=auth, allowed_hosts=allowed_hosts)
        return TestClient(web, raise_server_exceptions=False, follow_redirects=True)

    def close(self) -> None:
        runtime.reset(self.app)
        backends.discard(self.store)


@pytest.fixture(params=WEB_BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    if request.param not in ("memory", "sqlite"):
        services.need(request.param)
    made = Site(request.param, tmp_path)
    yield made.seed()
    made.close()


@pytest.fixture
def memory_site() -> Iterator[Site]:
    made = Site("memory")
    yield made.seed()
    made.close()


def form_of(page: str, action: str) -> dict[str, str]:
    """The hidden fields of the form on ``page`` that posts to a URL ending in ``action``."""
    import re

    for form in re.findall(r"<form[^>]*>.*?</form>", page, re.DOTALL):
        target = re.search(r'action="([^"]*)"', form)
        if target and target.group(1).endswith(action):
            return dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form))
    raise AssertionError(f"no form posting to {action} on the page")
