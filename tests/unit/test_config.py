"""ExactOnceConfig: types, consistency rules, unknown keys, Django spelling, redaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceConfig, open_store
from celery_exactonce.config import UnknownSettingWarning
from celery_exactonce.core.jobs import KEEP, Compaction
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores import InMemoryStore, redact_url, store_from_url


def app_with(**settings: Any) -> Celery:
    app = Celery("test-config", set_as_current=False)
    app.conf.update({"exactonce_store_url": "memory://", **settings})
    return app


def test_defaults_are_consistent() -> None:
    config = ExactOnceConfig.from_app(app_with())
    assert config.namespace == "default" and config.catchup == "latest"
    assert config.retention >= config.window_lookback + config.tick_interval + config.max_skew


@pytest.mark.parametrize(
    ("settings", "culprit"),
    [
        ({"exactonce_tick_interval": "1"}, "exactonce_tick_interval"),
        ({"exactonce_tick_interval": True}, "exactonce_tick_interval"),
        ({"exactonce_retention": float("inf")}, "exactonce_retention"),
        ({"exactonce_catchup_limit": 1.5}, "exactonce_catchup_limit"),
        ({"exactonce_namespace": 7}, "exactonce_namespace"),
        ({"exactonce_namespace": "has space"}, "exactonce_namespace"),
        ({"exactonce_namespace": ""}, "exactonce_namespace"),
        ({"exactonce_catchup": "sometimes"}, "exactonce_catchup"),
        ({"exactonce_reconcile_on": "cron"}, "exactonce_reconcile_on"),
        ({"exactonce_occurrence_retention": 60}, "exactonce_occurrence_retention"),
        ({"exactonce_occurrence_retention": 10**7}, "exactonce_occurrence_retention"),
        ({"exactonce_occurrence_retention": "1h"}, "exactonce_occurrence_retention"),
        ({"exactonce_terminal_history": "some"}, "exactonce_terminal_history"),
        ({"exactonce_terminal_history": 3}, "exactonce_terminal_history"),
        ({"exactonce_terminal_payload": "no"}, "exactonce_terminal_payload"),
        ({"exactonce_terminal_payload": 0}, "exactonce_terminal_payload"),
        ({"exactonce_window_lookback": 0}, "exactonce_window_lookback"),
        ({"exactonce_max_skew": -1}, "exactonce_max_skew"),
        ({"exactonce_retention": 100}, "exactonce_retention"),
        ({"exactonce_replay_age": 10}, "exactonce_replay_age"),
        ({"exactonce_dispatch_timeout": 60}, "exactonce_dispatch_timeout"),
        ({"exactonce_dispatch_deadline": 200}, "exactonce_dispatch_deadline"),
        ({"exactonce_running_timeout": 60}, "exactonce_running_timeout"),
        ({"exactonce_lease_ttl": 1}, "exactonce_lease_ttl"),
        ({"exactonce_key_prefix": "a b"}, "exactonce_key_prefix"),
        ({"exactonce_table_prefix": "x;drop"}, "exactonce_table_prefix"),
        ({"exactonce_signing_key": "short"}, "exactonce_signing_key"),
        ({"exactonce_store_url": "ftp://host/x"}, "exactonce_store_url"),
        ({"exactonce_store_url": "not a url"}, "exactonce_store_url"),
        ({"exactonce_store_url": None}, "exactonce_store_url"),
    ],
)
def test_bad_settings_name_the_culprit(settings: dict[str, Any], culprit: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        ExactOnceConfig.from_app(app_with(**settings))
    assert info.value.setting == culprit
    assert culprit in str(info.value)


@pytest.mark.parametrize(
    "node_id",
    ["node\x07one", "line\nbreak", "tab\there", "n" * 256, ""],
    ids=["bell", "newline", "tab", "256-characters", "empty"],
)
def test_node_id_is_checked_as_the_stores_check_it(node_id: str) -> None:
    """A node id every store write would refuse is refused at start-up, naming the setting.

    Fails on the code before the fix: ``exactonce_node_id`` was accepted, then
    every write of the node failed at run time.
    """
    with pytest.raises(ConfigurationError) as info:
        ExactOnceConfig.from_app(app_with(exactonce_node_id=node_id))
    assert info.value.setting == "exactonce_node_id"
    assert "exactonce_node_id" in str(info.value)
    assert ExactOnceConfig.from_app(app_with(exactonce_node_id="n" * 255)).node_id == "n" * 255


def test_retention_rule_is_inclusive() -> None:
    config = ExactOnceConfig.from_app(
        app_with(exactonce_retention=306, exactonce_window_lookback=300, exactonce_max_skew=5)
    )
    assert config.retention == 306


def test_unknown_setting_warns_and_is_ignored() -> None:
    with pytest.warns(UnknownSettingWarning, match="exactonce_retenton"):
        config = ExactOnceConfig.from_app(app_with(exactonce_retenton=1))
    assert config.retention == 7 * 86_400


def test_django_style_namespace() -> None:
    class Settings:
        CELERY_EXACTONCE_STORE_URL = "memory://"
        CELERY_EXACTONCE_NAMESPACE = "shop"
        CELERY_EXACTONCE_TICK_INTERVAL = 2.0

    app = Celery("django-style", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    config = ExactOnceConfig.from_app(app)
    assert (config.namespace, config.tick_interval) == ("shop", 2.0)


def test_scenario_79_a_misspelt_django_setting_warns_at_its_line_with_the_one_meant() -> None:
    """Before the fix, the warning listed every known setting and pointed at library code."""

    class Settings:
        CELERY_EXACTONCE_STORE_URL = "memory://"
        CELERY_EXACTONCE_TICK_INTERVALL = 2.0

    app = Celery("django-style", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.warns(UnknownSettingWarning) as caught:
        config = ExactOnceConfig.from_app(app)
    assert config.tick_interval == 1.0  # ignored: the default applies
    (warning,) = caught.list
    assert "'CELERY_EXACTONCE_TICK_INTERVALL' ignored" in str(warning.message)
    assert "did you mean 'CELERY_EXACTONCE_TICK_INTERVAL'?" in str(warning.message)
    assert warning.filename == __file__
    assert (
        "CELERY_EXACTONCE_TICK_INTERVALL = 2.0"
        in Path(__file__).read_text().splitlines()[warning.lineno - 1]
    )


def test_scenario_79_the_metrics_address_defaults_to_one_that_binds() -> None:
    """Before the fix, the default was ``""``, which prometheus-client cannot bind."""
    every = "0.0.0.0"  # noqa: S104  (every interface is what the test asks of the default)
    assert ExactOnceConfig.from_app(app_with()).metrics_addr == every
    assert ExactOnceConfig.from_app(app_with(exactonce_metrics_addr="")).metrics_addr == every
    chosen = ExactOnceConfig.from_app(app_with(exactonce_metrics_addr="::"))
    assert chosen.metrics_addr == "::"


def test_credentials_never_show() -> None:
    url = "redis://user:s3cret@cache.internal:6380/0"
    config = ExactOnceConfig.from_app(
        app_with(exactonce_store_url=url, exactonce_signing_key="k" * 32)
    )
    text = repr(config.redacted())
    assert "s3cret" not in text and "k" * 32 not in text
    assert redact_url(url) == "redis://user:***@cache.internal:6380/0"
    assert redact_url("postgresql://u:p%40ss@[::1]:5432/db") == "postgresql://u:***@[::1]:5432/db"
    assert redact_url("sqlite:///tmp/x.db") == "sqlite:///tmp/x.db"
    with pytest.raises(ConfigurationError) as info:
        ExactOnceConfig.from_app(app_with(exactonce_store_url="ftp://u:s3cret@h/x"))
    assert "s3cret" not in str(info.value)


def test_store_from_url_memory_and_bad_scheme() -> None:
    assert isinstance(store_from_url("memory://", namespace="n"), InMemoryStore)
    with pytest.raises(ConfigurationError, match="has an unknown scheme"):
        store_from_url("mongodb://u:pw@h/x")
    with pytest.raises(ConfigurationError, match="exactonce_namespace"):
        store_from_url("memory://", namespace="bad ns")


def test_open_store_sets_up_the_configured_store() -> None:
    config = ExactOnceConfig.from_app(app_with(exactonce_namespace="app1"))
    store = open_store(config)
    assert isinstance(store, InMemoryStore)
    assert store.namespace == "app1" and store.retention == config.retention


def test_the_terminal_settings_reach_the_store() -> None:
    # Given settings that compact terminal records
    config = ExactOnceConfig.from_app(
        app_with(exactonce_terminal_history="last", exactonce_terminal_payload=False)
    )
    assert config.compaction == Compaction(history="last", payload=False)
    store = open_store(config)
    # When a job ends on the store they open
    new = NewJob(JobRef.submitted("t1"), "tasks.add", State.SCHEDULED, node="n", args=[1])
    store.create(new)
    done = store.transition(
        new.ref,
        Transition(State.CANCELLED, frozenset({State.SCHEDULED}), node="n", reason="revoked"),
    ).job
    # Then its record keeps what they ask
    assert (
        done is not None and done.args == [] and [h.dst for h in done.history] == [State.CANCELLED]
    )
    # And by default, everything
    assert ExactOnceConfig.from_app(app_with()).compaction == KEEP
