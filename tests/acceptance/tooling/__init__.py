"""Tests of the acceptance harness itself (real workers, plain Celery tasks), kept apart from
the tests of the product: a failure here is a broken harness, not a broken promise."""
