"""Start-up checks of a worker that runs gated tasks, and of beat."""

from __future__ import annotations

from typing import Any

import celery._state
import pytest
from celery import Celery, signals

from celery_exactonce import ConfigurationError, ExactOnceTask, StoreUnavailable, runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.startup import (
    EXIT_STATUS,
    StartupRefused,
    check_broker,
    check_worker,
    gated_tasks,
    redelivery_horizon,
    refusal_line,
)


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


def test_worker_without_gated_tasks_needs_no_store_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An app finalizes with every shared task defined so far in this process, gated
    # ones of other tests included (``@app.task`` is shared by default): this app
    # must know none of them, whatever ran before it.
    monkeypatch.setattr(celery._state, "_on_app_finalizers", set())
    app = Celery("plain", set_as_current=False)
    assert not gated_tasks(app)
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


def gated_app(**conf: Any) -> Celery:
    app = make_app(**conf)

    @app.task(base=ExactOnceTask, shared=False, name="s.gated")
    def gated() -> None: ...

    return app


@pytest.mark.parametrize(
    ("broker_url", "options", "horizon"),
    [
        ("redis://localhost/0", {}, 3600.0),  # kombu's default visibility timeout
        ("rediss://localhost/0", {"visibility_timeout": 43_200}, 43_200.0),
        ("sentinel://h1:26379;sentinel://h2:26379", {"visibility_timeout": 7200}, 7200.0),
        ("sqs://", {}, 1800.0),
        ("amqp://guest@localhost//", {"confirm_publish": True}, None),
        ("memory://", {}, None),
    ],
)
def test_redelivery_horizon_of_the_broker(
    broker_url: str, options: dict[str, Any], horizon: float | None
) -> None:
    app = make_app(broker_url=broker_url, broker_transport_options=options)
    assert redelivery_horizon(app) == horizon


def test_retention_below_the_visibility_timeout_is_refused_on_a_gated_worker() -> None:
    """Adoption past retention: refused at start-up, naming both settings.

    Fails on the code before the fix: ``retention=900`` with a 43,200 s
    visibility timeout was accepted, and an adopted message redelivered after
    its record was purged ran again.
    """
    app = gated_app(
        broker_url="redis://localhost/0",
        broker_transport_options={"visibility_timeout": 43_200},
        exactonce_retention=900,
    )
    with pytest.raises(ConfigurationError, match=r"visibility_timeout \(43200 s\)") as info:
        check_worker(app)
    assert info.value.setting == "exactonce_retention"
    assert "exactonce_retention (900 s)" in str(info.value)
    # Redis's default horizon (3600 s) applies when the option is not set
    with pytest.raises(ConfigurationError, match=r"\(3600 s\)"):
        check_worker(gated_app(broker_url="redis://localhost/0", exactonce_retention=1800))
    # ... and a retention that covers it passes
    app = gated_app(broker_url="redis://localhost/0", exactonce_retention=3600)
    check_worker(app)
    runtime.reset(app)


def test_an_occurrence_retention_below_the_visibility_timeout_is_refused() -> None:
    # A gated occurrence's message redelivered after its record went would find none
    app = gated_app(
        broker_url="redis://localhost/0",
        broker_transport_options={"visibility_timeout": 900},
        exactonce_occurrence_retention=600,
    )
    with pytest.raises(ConfigurationError, match=r"visibility_timeout \(900 s\)") as info:
        check_worker(app)
    assert info.value.setting == "exactonce_occurrence_retention"
    app = gated_app(
        broker_url="redis://localhost/0",
        broker_transport_options={"visibility_timeout": 900},
        exactonce_occurrence_retention=900,
    )
    check_worker(app)
    runtime.reset(app)


def test_retention_is_not_compared_on_a_broker_without_a_redelivery_horizon() -> None:
    """AMQP redelivers only when the consumer's connection is gone: nothing to compare."""
    app = gated_app(
        broker_url="amqp://guest@localhost//",
        broker_transport_options={"confirm_publish": True},
        exactonce_retention=900,
    )
    check_worker(app)
    runtime.reset(app)


def test_a_visibility_timeout_that_is_not_a_number_is_refused() -> None:
    app = gated_app(broker_url="redis://", broker_transport_options={"visibility_timeout": "1h"})
    with pytest.raises(ConfigurationError, match="visibility_timeout") as info:
        check_worker(app)
    assert info.value.setting == "broker_transport_options"


def test_confirm_publish_is_checked_on_the_publishing_url() -> None:
    app = make_app(broker_url="redis://localhost/0", broker_write_url="amqp://guest@rabbit//")
    with pytest.raises(ConfigurationError, match="confirm_publish"):
        check_broker(app)


class FakeWorker:
    """What Celery's ``worker_init`` sends: the WorkController, of which we read ``app``."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def test_worker_init_ends_the_process_with_one_line_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SCENARIOS 68: Celery swallows a receiver's exception; the refusal is a SystemExit.

    Fails on the code before the fix: ``worker_init.send`` logged the
    ConfigurationError and returned, and the worker went on to report ready.
    """
    app = gated_app(broker_url="memory://")
    del app.conf["exactonce_store_url"]
    with pytest.raises(SystemExit) as info:
        signals.worker_init.send(sender=FakeWorker(app))
    assert info.value.code == EXIT_STATUS != 0
    assert isinstance(info.value, StartupRefused) and info.value.role == "worker"
    assert isinstance(info.value.error, ConfigurationError)
    assert info.value.error.setting == "exactonce_store_url"
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "celery-exactonce: worker refused to start: exactonce_store_url is required "
        "(e.g. redis://localhost:6379/0)"
    ]


def test_beat_refuses_before_its_first_tick() -> None:
    """SCENARIOS 68: the scheduler's constructor runs the checks and ends beat on a refusal.

    Fails on the code before the fix: beat did not check confirm_publish at all.
    """
    app = make_app(broker_url="amqp://guest@localhost//", beat_schedule={})
    with pytest.raises(StartupRefused) as info:
        ExactOnceScheduler(app)
    assert info.value.role == "beat" and info.value.code == EXIT_STATUS
    assert getattr(info.value.error, "setting", None) == "broker_transport_options"
    runtime.reset(app)


def test_refusal_line_is_one_line_naming_the_setting() -> None:
    error = ConfigurationError("s.x: a message\nover two lines", setting="reject_on_worker_lost")
    assert refusal_line("beat", error) == (
        "celery-exactonce: beat refused to start: s.x: a message over two lines "
        "(setting reject_on_worker_lost)"
    )
    line = refusal_line("worker", StoreUnavailable("redis://:***@h:6379/0 does not answer"))
    assert "exactonce_store_url" in line and "\n" not in line
