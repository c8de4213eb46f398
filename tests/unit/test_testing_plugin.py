"""The pytest plugin's fixtures in this suite, and the helpers under them.

* this suite uses the fixtures too (the plugin loads here), in both modes, and
  the app is put back after each test;
* the helpers: settings put back under every spelling, the namespace checked,
  the assertions' failures, the sweep's clock.

A user's suite run by pytest on the fixtures alone: tests/acceptance/test_testing_plugin.py.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceTask, idempotency_key, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.testing import ExactOnceJobs, FrozenClock, InMemoryStore, configured
from celery_exactonce.testing.apps import patched_settings
from celery_exactonce.testing.jobs import describe

# -- this suite, on the plugin's fixtures ------------------------------------------------------

APP = Celery("plugin-unit", set_as_current=False)
APP.conf.update(exactonce_namespace="plugin-unit", exactonce_store_url="redis://127.0.0.1:9/0")


@APP.task(base=ExactOnceTask, bind=True, name="plugin.key", shared=False)
def key(self: Any) -> str:
    return str(self.request.idempotency_key)


@pytest.fixture
def exactonce_celery_app() -> Celery:
    return APP


@pytest.mark.parametrize("exactonce_mode", ["eager", "worker"])
def test_this_suite_uses_the_fixtures_in_both_modes(
    exactonce_jobs: ExactOnceJobs, exactonce_store: InMemoryStore, exactonce_mode: str
) -> None:
    result = key.apply_async(task_id=f"fixed-{exactonce_mode}")
    job = exactonce_jobs.assert_ran_once(result)
    assert job.state is State.SUCCEEDED
    assert result.get(timeout=10) == exactonce_jobs.key_for(f"fixed-{exactonce_mode}")
    assert exactonce_store.namespace == "plugin-unit"
    assert APP.conf.task_always_eager is (exactonce_mode == "eager")
    assert runtime.runtime_for(APP).store is exactonce_store


def test_the_app_is_put_back_after_a_test() -> None:
    with configured(APP, InMemoryStore("plugin-unit"), eager=False):
        assert APP.conf.exactonce_store_url == "memory://"
        assert APP.conf.task_always_eager is False
        assert APP.conf.broker_url == "memory://"
        assert runtime.installed(APP) is not None
    assert APP.conf.exactonce_store_url == "redis://127.0.0.1:9/0"
    assert "task_always_eager" not in APP.conf.changes
    assert "broker_url" not in APP.conf.changes
    assert runtime.installed(APP) is None


# -- the helpers under the fixtures ------------------------------------------------------------


def test_settings_are_put_back_as_they_were_under_every_spelling() -> None:
    app = Celery("spelled", set_as_current=False, namespace="CELERY")
    app.conf.update(CELERY_EXACTONCE_STORE_URL="redis://prod/1", task_default_queue="q")
    with patched_settings(
        app, {"exactonce_store_url": "memory://", "task_default_queue": "t", "broker_url": "x"}
    ):
        assert app.conf["CELERY_EXACTONCE_STORE_URL"] == "memory://"
        assert "exactonce_store_url" not in app.conf.changes  # no second spelling to contradict
        assert (app.conf.task_default_queue, app.conf.broker_url) == ("t", "x")
    assert app.conf["CELERY_EXACTONCE_STORE_URL"] == "redis://prod/1"
    assert app.conf.task_default_queue == "q"
    assert "broker_url" not in app.conf.changes


def test_a_store_in_another_namespace_is_refused_naming_the_setting() -> None:
    app = Celery("other", set_as_current=False)
    app.conf.exactonce_namespace = "app-ns"
    with (
        pytest.raises(ConfigurationError, match="exactonce_namespace") as caught,
        configured(app, InMemoryStore("store-ns")),
    ):
        pass
    assert caught.value.setting == "exactonce_namespace"
    assert runtime.installed(app) is None


@pytest.fixture
def helpers() -> Any:
    app = Celery("helpers", set_as_current=False)

    @app.task(base=ExactOnceTask, shared=False, name="h.run")
    def run(x: int = 0) -> int:
        return x

    with configured(app, InMemoryStore(), eager=True):
        yield app, run, ExactOnceJobs(app, timeout=0.2)


def test_the_helpers_fail_with_what_they_found(helpers: Any) -> None:
    _app, run, jobs = helpers
    with pytest.raises(AssertionError, match="to run once; it ran 0 time"):
        jobs.assert_ran_once(run)
    with pytest.raises(AssertionError, match="no job 'missing'"):
        jobs.get("missing")
    run.apply_async((1,), task_id="one")
    jobs.assert_ran_once("one")
    with pytest.raises(AssertionError, match=r"expected job 'one' not to run; it ran 1 time"):
        jobs.assert_not_run("one")
    assert [job.ref.id for job in jobs.by_state("SUCCEEDED", State.FAILED)] == ["one"]
    assert jobs.by_state("PENDING") == []
    with pytest.raises(TypeError, match="a task id, a result or a task"):
        jobs.get(42)


def test_a_beat_occurrence_is_found_by_its_task_id(helpers: Any) -> None:
    app, _run, jobs = helpers
    fire = datetime(2026, 3, 1, tzinfo=timezone.utc)
    ref = JobRef.occurrence(f"nightly@{fire.isoformat()}")
    new = NewJob(ref, "h.run", State.SCHEDULED, node="n", entry="nightly", fire_time=fire)
    runtime.runtime_for(app).store.create(new)
    assert jobs.get(ref.id).ref == ref
    assert jobs.key_of(ref.id) == idempotency_key("nightly", fire, "default")
    assert jobs.by_task("h.run") == [jobs.get(ref.id)]


def test_wait_gives_up_naming_the_jobs_still_moving(helpers: Any) -> None:
    app, run, jobs = helpers
    app.conf.task_always_eager = False
    run.apply_async(task_id="stuck")  # published to a broker no worker reads
    with pytest.raises(AssertionError, match=r"still on their way after 0.2 s") as caught:
        jobs.wait("stuck")
    assert "stuck h.run: DISPATCHED at attempt 0" in str(caught.value)
    assert "- -> SCHEDULED: apply_async" in describe([jobs.get("stuck")])


def test_sweep_moves_only_a_frozen_clock_it_was_given(helpers: Any) -> None:
    app, _run, jobs = helpers
    with pytest.raises(ValueError, match="FrozenClock"):
        jobs.sweep(until=FrozenClock().now())
    assert jobs.sweep() == []  # nothing is due; the clock is not needed
    clock = FrozenClock()
    later = clock.advance(60)
    ExactOnceJobs(app, clock=clock).sweep(until=later - clock.now().resolution)  # not back
    assert clock.now() == later
