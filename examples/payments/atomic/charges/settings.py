"""Settings of the atomic payments example.

What differs between machines comes from the environment:

``PAYMENTS_DATABASE``   the PostgreSQL database, as a URL (default
                        ``postgresql://postgres@localhost:5432/payments``): the
                        app's tables and the job store (``django://default``)
``PAYMENTS_BROKER_URL`` the broker (default ``redis://localhost:6379/0``)
``PAYMENTS_NAMESPACE``  the store namespace and the queue (default ``payments``)
``PAYMENTS_VARIANT``    how ``charges.charge`` runs: ``atomic`` (the default),
                        ``gated`` or ``plain`` (``charges/tasks.py``)
``PAYMENTS_PAUSE``      the longest pause between two steps of a charge, in
                        seconds (default ``0.1``)
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = os.environ.get("PAYMENTS_SECRET_KEY", "example-only-not-secret")
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "celery_exactonce.contrib.django",  # the job store's tables (migrate)
    "charges",
]

_db = urlsplit(os.environ.get("PAYMENTS_DATABASE", "postgresql://postgres@localhost:5432/payments"))
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": unquote(_db.username or ""),
        "PASSWORD": unquote(_db.password or ""),
        "HOST": _db.hostname or "localhost",
        "PORT": str(_db.port or 5432),
    }
}

NAMESPACE = os.environ.get("PAYMENTS_NAMESPACE", "payments")
VARIANT = os.environ.get("PAYMENTS_VARIANT", "atomic")
if VARIANT not in ("atomic", "gated", "plain"):
    raise ValueError(f"PAYMENTS_VARIANT={VARIANT!r}: atomic, gated or plain")

# Celery, read by charges/celery.py (namespace "CELERY").
CELERY_BROKER_URL = os.environ.get("PAYMENTS_BROKER_URL", "redis://localhost:6379/0")
# A message a worker took but did not ack comes back after 10 s (a killed worker's).
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 10}
CELERY_TASK_DEFAULT_QUEUE = NAMESPACE
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULER = "exactonce"  # beat runs the reconciler
CELERY_EXACTONCE_STORE_URL = "django://default"
CELERY_EXACTONCE_NAMESPACE = NAMESPACE
# The reconciler, quick enough for a demo: an atomic job whose run died before it
# committed is dispatched again about 10 s later (then 20, 40...).
CELERY_EXACTONCE_RECONCILE_INTERVAL = 2
CELERY_EXACTONCE_TICK_INTERVAL = 1
CELERY_EXACTONCE_PUBLISH_TIMEOUT = 1
CELERY_EXACTONCE_STORE_TIMEOUT = 2
CELERY_EXACTONCE_REPLAY_AGE = 8
CELERY_EXACTONCE_DISPATCH_TIMEOUT = 10
CELERY_EXACTONCE_LEASE_TTL = 5
