"""The ledger app in a Django project: beats on django-celery-beat's rows.

``celery -A tests.acceptance.apps.django_app beat -S exactonce-django`` (or
stock django-celery-beat's scheduler, for the control run) reads the rows of
the database ``EXACTONCE_TEST_DJANGO_DB`` names (``sqlite:PATH`` or
``postgres:NAME``, :mod:`tests.django_tests.settings`). Every other setting is
the ledger app's (:mod:`tests.acceptance.apps.ledger_app`). Its workers also
run the tasks that retry, requeue or replace themselves inside their own
``transaction.atomic()`` (:mod:`tests.acceptance.apps.django_atomic`).
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_tests.settings")

import django

django.setup()

from tests.acceptance.apps import django_atomic  # noqa: E402
from tests.acceptance.apps.ledger_app import ExactOnceTask, make_app  # noqa: E402

#: The app ``celery -A tests.acceptance.apps.django_app beat`` runs.
app = make_app(os.environ)
if ExactOnceTask is not None:
    django_atomic.register(app, os.environ.get("EXACTONCE_ACC_LEDGER", ""))
