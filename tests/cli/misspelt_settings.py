"""A Django project's settings with a misspelt celery-exactonce setting (``misspelt_app``).

The typo below is the one ``tests/cli/test_setting_names.py`` expects the
warning to point at (this file, this line) and ``check`` to fail on.
"""

from __future__ import annotations

SECRET_KEY = "tests-only"
INSTALLED_APPS: list[str] = []
CELERY_BROKER_URL = "memory://"
CELERY_EXACTONCE_STORE_URL = "memory://"
CELERY_EXACTONCE_TICK_INTERVALL = 2  # the typo: CELERY_EXACTONCE_TICK_INTERVAL
