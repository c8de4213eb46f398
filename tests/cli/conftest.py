"""One store namespace per test, seeded with jobs, and the real ``celery … exactonce`` command.

:class:`Deployment` runs ``python -m celery -A tests.cli.cli_app exactonce …``
in a subprocess (the ``celery.commands`` entry point, as a user runs it)
against a shared backend (Redis, PostgreSQL, MySQL, SQLite, and ``django``: the
command on ``django://default``, a Django project's database, which is the
SQLite file the test seeds through the SQL store), and checks that no output
ever holds the store's password (the PostgreSQL URL carries one; trust
authentication ignores it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores import store_from_url
from celery_exactonce.stores.base import StateStore
from tests import services
from tests.cli.cli_app import NIGHTLY
from tests.support import backends
from tests.support.backends import SHARED_BACKENDS
from tests.support.helpers import NODE, task_job, to, wait_store_past

REPO_ROOT = Path(__file__).resolve().parents[2]
APP = "tests.cli.cli_app"
#: A command is one process start and a few store reads.
COMMAND_TIMEOUT = 60.0
#: What the PostgreSQL URL carries as its password; no output may show it.
SECRET = "s3cret-pw"
#: The slot of the seeded occurrence of NIGHTLY (the entry's watermark).
FIRE = datetime(2026, 5, 1, 3, tzinfo=timezone.utc)

UTC = timezone.utc


#: The backends the commands run on: the shared ones, and a Django project's database.
CLI_BACKENDS = (*SHARED_BACKENDS, "django")


def _url(backend: str, tmp_path: Path) -> str:
    if backend in ("sqlite", "django"):
        return f"sqlite:///{tmp_path / 'cli-store.db'}"
    if backend == "postgres":
        return services.POSTGRES_URL.replace("postgres@", f"postgres:{SECRET}@", 1)
    return services.SERVICE_URLS[backend]


class Deployment:
    """A namespace of one backend, its store client, and the CLI on it."""

    def __init__(self, backend: str, url: str) -> None:
        self.backend = backend
        self.url = url
        #: The store URL the command is given, and what else its process needs.
        self.cli_url, self.cli_env = url, dict[str, str]()
        if backend == "django":  # the same file, as the project's ``default`` database
            self.cli_url = "django://default"
            self.cli_env = {
                "DJANGO_SETTINGS_MODULE": "tests.django_tests.settings",
                "EXACTONCE_TEST_DJANGO_DB": f"sqlite:{url.removeprefix('sqlite:///')}",
            }
        self.namespace = f"cli{uuid.uuid4().hex[:10]}"
        self.conf: dict[str, Any] = {}
        self.store: StateStore = store_from_url(url, namespace=self.namespace, retention=86_400)

    def run(self, *args: str, expect: int | None = 0) -> subprocess.CompletedProcess[str]:
        """``celery -A APP exactonce ARGS``; its exit status must be ``expect`` (unless None)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTONCE_CLI_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            EXACTONCE_CLI_STORE_URL=self.cli_url,
            EXACTONCE_CLI_NAMESPACE=self.namespace,
            EXACTONCE_CLI_CONF=json.dumps(self.conf),
            **self.cli_env,
        )
        argv = [sys.executable, "-m", "celery", "-A", APP, "exactonce", *args]
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
        output = done.stdout + done.stderr
        assert SECRET not in output, output
        if expect is not None:
            assert done.returncode == expect, (args, done.returncode, output)
        return done

    def json(self, *args: str, expect: int = 0) -> Any:
        return json.loads(self.run(*args, "--json", expect=expect).stdout)

    def seed(self) -> dict[str, JobRef]:
        """The jobs the tests look at (see the module's tests), created in order."""
        store = self.store
        store.setup()
        made: dict[str, JobRef] = {}

        def create(name: str, new: NewJob) -> None:
            result = store.create(new)
            assert result.created and result.job is not None
            made[name] = new.ref
            wait_store_past(store, result.job.touched_at)  # distinct touch times: one order

        create(
            "pending",
            task_job(
                "j-pending",
                State.PENDING,
                run_at=store.now() + timedelta(hours=1),
                task="cli_app.mail",
            ),
        )
        for i in range(3):
            create(f"bill{i}", task_job(f"j-bill{i}", task="cli_app.bill"))
        ref = JobRef.occurrence(occurrence_id(self.namespace, NIGHTLY, FIRE))
        create(
            "nightly",
            NewJob(ref, "cli_app.bill", State.SCHEDULED, node=NODE, entry=NIGHTLY, fire_time=FIRE),
        )
        assert store.transition(ref, to(State.DISPATCHED, State.SCHEDULED)).applied
        store.note_skipped(
            [
                SkippedSlots(
                    NIGHTLY, "catchup", FIRE - timedelta(days=3), FIRE - timedelta(days=1), 3, NODE
                )
            ]
        )
        return made

    def close(self) -> None:
        backends.discard(self.store)


@pytest.fixture(params=CLI_BACKENDS)
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    backend = request.param
    if backend not in ("sqlite", "django"):
        services.need(backend)
    made = Deployment(backend, _url(backend, tmp_path))
    yield made
    made.close()
