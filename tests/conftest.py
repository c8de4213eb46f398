"""Settings every test process shares: Django's, for the tests of the Django integrations.

Configured here, not through ``DJANGO_SETTINGS_MODULE``: that variable would
make Celery install its Django fix-up in every app of every other test. And
once per run (not per xdist worker), the test PostgreSQL is vacuumed of the
rows earlier runs deleted (``services.vacuum_postgres``).
"""

from __future__ import annotations

import os
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from django.conf import settings

    from tests.django_tests.settings import STORE_SQLITE, in_process

    if STORE_SQLITE not in os.environ:  # xdist workers and spawned racers inherit it
        os.environ[STORE_SQLITE] = os.path.join(tempfile.mkdtemp(), "django-store.sqlite3")
    if not settings.configured:
        settings.configure(**in_process())


def pytest_sessionstart(session: pytest.Session) -> None:
    from tests import services

    if not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        services.vacuum_postgres()
