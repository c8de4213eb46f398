"""Celery apps the acceptance tests run in real worker processes."""
