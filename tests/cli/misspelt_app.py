"""A Celery app whose settings misspell ``exactonce_tick_interval``, in either form.

``EXACTONCE_S79_FORM`` picks where the typo is written:

``plain``   ``app.conf.exactonce_tick_intervall`` below, as a Celery app sets it
``django``  ``CELERY_EXACTONCE_TICK_INTERVALL`` in ``tests/cli/misspelt_settings.py``,
            read with ``config_from_object("django.conf:settings", namespace="CELERY")``

The store and the broker are in memory: beat starts and ``check`` runs with
no service.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("misspelt")
if os.environ.get("EXACTONCE_S79_FORM") == "django":
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.cli.misspelt_settings")
    django.setup()
    app.config_from_object("django.conf:settings", namespace="CELERY")
else:
    app.conf.update(broker_url="memory://", exactonce_store_url="memory://")
    app.conf.exactonce_tick_intervall = 2  # the typo: exactonce_tick_interval
