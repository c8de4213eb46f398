"""Acceptance tests: real ``celery worker`` processes on real brokers and stores."""
