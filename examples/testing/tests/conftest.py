"""The plugin's fixtures run this project's app: ``exactonce_celery_app`` returns it."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def exactonce_celery_app() -> Any:
    from billing.tasks import app

    return app
