"""The ledger app in a Django project: beats on django-celery-beat's rows.

``celery -A tests.acceptance.apps.django_app beat -S exactonce-django`` (or
stock django-celery-beat's scheduler, for the control run) reads the rows of
the database ``EXACTONCE_TEST_DJANGO_DB`` names (``sqlite:PATH`` or
``postgres:NAME``, :mod:`tests.django_tests.settings`). Every other setting is
the ledger app's (:mod:`tests.acceptance.apps.ledger_app`).
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_tests.settings")

import django

django.setup()

from tests.acceptance.apps.ledger_app import make_app  # noqa: E402

#: The app ``celery -A tests.acceptance.apps.django_app beat`` runs.
app = make_app(os.environ)
