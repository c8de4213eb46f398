"""Integrations with other packages, each imported only by who uses it.

* :mod:`celery_exactonce.contrib.django_celery_beat`: beat on django-celery-beat's
  ``PeriodicTask`` rows, with the guarantee of ``beat_schedule`` entries
  (``celery beat -S exactonce-django``).

The library never imports this package.
"""
