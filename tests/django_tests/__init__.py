"""Tests of the Django integrations (django-celery-beat rows, the Django app)."""
