"""Start-up checks of a worker that runs gated tasks."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceTask, runtime
from celery_exactonce.startup import check_broker, check_worker


def make_app(**conf: Any) -> Celery:
    app = Celery("startup", set_as_current=False)
    app.conf.update({"exactonce_store_url": "memory://", **conf})
    return app


def test_amqp_without_publisher_confirms_is_refused() -> None:
    app = make_app(broker_url="amqp://guest:guest@localhost//")
    with pytest.raises(ConfigurationError, match="confirm_publish") as info:
        check_broker(app)
    assert info.value.setting == "broker_transport_options"
    app.conf.broker_transport_options = {"confirm_publish": True}
    check_broker(app)
    check_broker(make_app(broker_url="redis://localhost/0"))


def test_worker_check_validates_every_gated_task() -> None:
    app = make_app(broker_url="memory://")

    @app.task(base=ExactOnceTask, shared=False, name="s.ok")
    def ok() -> None: ...

    check_worker(app)
    assert runtime.runtime_for(app).store.namespace == "default"

    @app.task(base=ExactOnceTask, shared=False, name="s.bad", reject_on_worker_lost=True)
    def bad() -> None: ...

    with pytest.raises(ConfigurationError, match=r"s\.bad"):
        check_worker(app)
    runtime.reset(app)


def test_worker_without_gated_tasks_needs_no_store_setting() -> None:
    app = Celery("plain", set_as_current=False)
    check_worker(app)  # no exactonce_store_url, no gated task: nothing to check


def test_per_task_timeouts_are_checked_like_the_settings() -> None:
    app = make_app(broker_url="memory://", exactonce_replay_age=60)

    @app.task(base=ExactOnceTask, shared=False, name="s.slow", exactonce_running_timeout=7200)
    def slow() -> None: ...

    @app.task(base=ExactOnceTask, shared=False, name="s.hasty", exactonce_dispatch_timeout=30)
    def hasty() -> None: ...

    # dispatch_timeout must stay above replay_age: the error names the task and the setting
    with pytest.raises(ConfigurationError, match=r"s\.hasty.*dispatch_timeout") as info:
        check_worker(app)
    assert info.value.setting == "exactonce_dispatch_timeout"
    app.tasks["s.hasty"].exactonce_dispatch_timeout = 120
    check_worker(app)  # a longer running_timeout is fine
    runtime.reset(app)
