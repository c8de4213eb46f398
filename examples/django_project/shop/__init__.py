"""The example shop: a Django project whose periodic tasks run once on several beats."""

from __future__ import annotations

from shop.celery import app as celery_app

__all__ = ["celery_app"]
