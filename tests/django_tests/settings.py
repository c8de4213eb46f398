"""Django settings of the tests: the in-process tests and the beats and workers they start.

In-process (pytest-django, configured by ``tests/conftest.py``): two databases,
``default`` (SQLite) and ``postgres``, every model of the apps routed to the one
a test picks (:mod:`tests.django_tests.routing`); and ``mysql`` (MariaDB at
``REPEATABLE READ``, with mysqlclient), which only the tests that name it use.

As ``DJANGO_SETTINGS_MODULE`` of a ``celery beat`` or ``worker`` a test starts:
one database, ``default``, which ``EXACTONCE_TEST_DJANGO_DB`` names
(``sqlite:PATH``, ``postgres:NAME`` or ``mysql:NAME``).
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any
from urllib.parse import urlsplit

from tests.services import MYSQL_URL, POSTGRES_URL

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.django_tests.urls"
STATIC_URL = "/static/"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.admin",
    "django_celery_beat",
    "celery_exactonce.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def postgres(name: str | None = None) -> dict[str, Any]:
    """The test PostgreSQL, as a Django database."""
    parts = urlsplit(POSTGRES_URL)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name or parts.path.lstrip("/") or "test",
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }


def mysql(**options: Any) -> dict[str, Any]:
    """The test MySQL/MariaDB, as a Django database (``OPTIONS``: ``options``)."""
    parts = urlsplit(MYSQL_URL)
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": parts.path.lstrip("/") or "test",
        "USER": parts.username or "root",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 3306),
        "OPTIONS": options,
    }


def sqlite(path: str, *, immediate: bool = True) -> dict[str, Any]:
    # IMMEDIATE: several processes write (the django:// store requires it on SQLite).
    options: dict[str, Any] = {"timeout": 20}
    if immediate:
        options["transaction_mode"] = "IMMEDIATE"
    return {"ENGINE": "django.db.backends.sqlite3", "NAME": path, "OPTIONS": options}


def one_database(spec: str) -> dict[str, Any]:
    """``sqlite:PATH`` (``sqlite-deferred:PATH``: without ``IMMEDIATE``),
    ``postgres:NAME[:USER]`` or ``mysql:NAME``, as the one database of a process."""
    kind, _, where = spec.partition(":")
    if kind in ("sqlite", "sqlite-deferred"):
        return sqlite(where, immediate=kind == "sqlite")
    if kind == "mysql":
        _mysql_driver()
        return {**mysql(isolation_level="repeatable read"), "NAME": where}
    name, _, user = where.partition(":")
    database = postgres(name or None)
    if user:
        database["USER"] = user
    return database


#: The environment variable naming the ``store_sqlite`` file (set once per run, so
#: spawned processes and xdist workers share it; ``tests/conftest.py``).
STORE_SQLITE = "EXACTONCE_TEST_DJANGO_STORE_SQLITE"


def _mysql_driver() -> bool:
    """Whether Django's MySQL backend has a driver: mysqlclient, or PyMySQL standing in."""
    if importlib.util.find_spec("MySQLdb") is None:
        if importlib.util.find_spec("pymysql") is None:
            return False
        import pymysql

        pymysql.install_as_MySQLdb()
    return True


def _mysql_if_installed() -> dict[str, Any]:
    """``mysql``: Django's MySQL backend on mysqlclient where it is installed, else PyMySQL.

    PyMySQL (the SQL store's driver, in the ``mysql`` extra) stands in for
    mysqlclient as Django's ``MySQLdb``, so the tests that name this database
    run on a machine that cannot build mysqlclient, as CI's fresh install is.
    """
    if not _mysql_driver():
        return {}
    # Django reads MySQL at READ COMMITTED unless told: this one is told otherwise.
    database = mysql(isolation_level="repeatable read")
    database["TEST"] = {"NAME": f"test_exactonce_{uuid.uuid4().hex[:8]}", "DEPENDENCIES": []}
    return {"mysql": database}


def in_process() -> dict[str, Any]:
    """The settings ``tests/conftest.py`` configures for pytest-django."""
    names = {k: v for k, v in globals().items() if k.isupper()}
    return {
        **names,
        "DATABASES": {
            "default": sqlite(":memory:"),
            # A test database of this run's own: two runs on one server never clobber
            # each other's (pytest-django adds the xdist worker to the name).
            "postgres": {**postgres(), "TEST": {"NAME": f"test_exactonce_{uuid.uuid4().hex[:8]}"}},
            # The django:// stores of the contract suite (tests/support/backends.py): a
            # file every process of the run shares, and the test PostgreSQL.
            "store_sqlite": sqlite(os.environ[STORE_SQLITE]),
            "store_postgres": postgres(),
            **_mysql_if_installed(),
        },
        "DATABASE_ROUTERS": ["tests.django_tests.routing.Router"],
    }


DATABASES = {"default": one_database(os.environ.get("EXACTONCE_TEST_DJANGO_DB", "sqlite::memory:"))}
