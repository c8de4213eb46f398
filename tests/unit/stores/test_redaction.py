"""Credentials never printed: every URL shape, store errors, reprs and banners.

Issue 11, hole 17: ``redact_url`` blanked only the user-info password, so a
``?password=`` (accepted by redis-py and libpq) showed in clear in the beat
banner, ``RedisStore._where``, SQL ``StoreError`` messages and the config's
repr. Each test here fails on the code before the fix.
"""

from __future__ import annotations

import pytest

from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions
from celery_exactonce.stores import redact_message, redact_url, store_from_url, url_secrets

# (url, redacted form, the secrets it holds)
SHAPES = [
    ("redis://user:S3cretPw1@cache:6380/0", "redis://user:***@cache:6380/0", ["S3cretPw1"]),
    ("redis://:S3cretPw1@cache:6379/0", "redis://:***@cache:6379/0", ["S3cretPw1"]),
    (
        "rediss://:S3cretPw1@cache/0?ssl_cert_reqs=none",
        "rediss://:***@cache/0?ssl_cert_reqs=none",
        ["S3cretPw1"],
    ),
    (
        "redis://cache:6379/0?password=S3cretPw1&db=1",
        "redis://cache:6379/0?password=***&db=1",
        ["S3cretPw1"],
    ),
    (
        "unix://:S3cretPw1@/var/run/redis.sock?db=0&password=S3cretPw2",
        "unix://:***@/var/run/redis.sock?db=0&password=***",
        ["S3cretPw1", "S3cretPw2"],
    ),
    (
        "postgresql://u:S3cretPw1@db/app?password=S3cretPw2&sslpassword=S3cretPw3",
        "postgresql://u:***@db/app?password=***&sslpassword=***",
        ["S3cretPw1", "S3cretPw2", "S3cretPw3"],
    ),
    (
        "postgresql://u@/app?host=/tmp&password=S3cretPw1",
        "postgresql://u@/app?host=/tmp&password=***",
        ["S3cretPw1"],
    ),
    (
        "postgresql+psycopg://u@db/app?options=password%3DS3cretPw1",
        "postgresql+psycopg://u@db/app?options=***",
        ["S3cretPw1"],
    ),
    (
        "postgresql://u@db/app?dsn=host%3Ddb%20password%3DS3cretPw1",
        "postgresql://u@db/app?dsn=***",
        ["S3cretPw1"],
    ),
    (
        "mysql://root:S3cretPw1@127.0.0.1:3306/test?charset=utf8mb4",
        "mysql://root:***@127.0.0.1:3306/test?charset=utf8mb4",
        ["S3cretPw1"],
    ),
    ("mariadb://root@db/test?PASSWD=S3cretPw1", "mariadb://root@db/test?PASSWD=***", ["S3cretPw1"]),
    (
        "postgresql://u:p%40S3cret@[::1]:5432/db?Password=S3cretPw2",
        "postgresql://u:***@[::1]:5432/db?Password=***",
        ["p@S3cret", "p%40S3cret", "S3cretPw2"],
    ),
    (
        "redis://[fe80::1%25eth0]:6379/0?pwd=S3cretPw1",
        "redis://[fe80::1%25eth0]:6379/0?pwd=***",
        ["S3cretPw1"],
    ),
    (
        "redis://h/0?pass=S3cretPw1&secret=S3cretPw2&token=S3cretPw3&auth=S3cretPw4",
        "redis://h/0?pass=***&secret=***&token=***&auth=***",
        ["S3cretPw1", "S3cretPw2", "S3cretPw3", "S3cretPw4"],
    ),
    ("redis://h/0#password=S3cretPw1", "redis://h/0#password=***", ["S3cretPw1"]),
    ("redis://user@cache:6379/0", "redis://user@cache:6379/0", []),
    ("sqlite:///tmp/jobs.db", "sqlite:///tmp/jobs.db", []),
    ("memory://", "memory://", []),
    # Malformed: replaced whole (a parser could miss where the password sits).
    ("redis://[::1:6379/0?password=S3cretPw1", "<unparsable url>", ["S3cretPw1"]),
    ("redis://u:S3cretPw1@h:port/0", "<unparsable url>", ["S3cretPw1"]),
    ("redis://u:12/S3cretPw1@h/0", "<unparsable url>", ["12/S3cretPw1"]),
    ("redis://:S3cret@Pw/1@cache:6379/0", "<unparsable url>", ["S3cret@Pw/1"]),
    ("redis://:12?S3cret@cache:6379/0", "<unparsable url>", ["12?S3cret"]),
    ("redis://u:12#S3cret@cache/0", "<unparsable url>", ["12#S3cret"]),
    # Not a URL: a bare conninfo keeps its harmless pairs.
    ("host=/tmp password=S3cretPw1", "host=/tmp password=***", ["S3cretPw1"]),
]


@pytest.mark.parametrize(("url", "shown", "secrets"), SHAPES, ids=[s[0] for s in SHAPES])
def test_every_credential_form_is_redacted(url: str, shown: str, secrets: list[str]) -> None:
    """Fails before the fix: query, fragment, conninfo and malformed forms kept the secret."""
    assert redact_url(url) == shown
    for secret in secrets:
        assert secret not in redact_url(url)
        assert secret in url_secrets(url)


@pytest.mark.parametrize(("url", "shown", "secrets"), SHAPES, ids=[s[0] for s in SHAPES])
def test_redact_message_blanks_each_secret_as_written_and_decoded(
    url: str, shown: str, secrets: list[str]
) -> None:
    """A driver may echo the URL, the raw secret or its percent-decoded form."""
    echoed = f"failed to connect to {url} with " + " and ".join(secrets)
    redacted = redact_message(echoed, url)
    for secret in secrets:
        assert secret not in redacted
    assert "S3cret" not in redacted


def test_redact_message_blanks_a_secret_the_driver_echoes_percent_encoded() -> None:
    url = "redis://:S3cret@Pw/1@cache:6379/0"  # '@' and '/' left raw in the password
    message = "AUTH failed for S3cret%40Pw%2F1 (S3cret@Pw/1)"
    assert "S3cret" not in redact_message(message, url)


def test_redact_message_blanks_credentials_the_url_never_held() -> None:
    """Conninfo pairs and user-info a driver prints of its own are blanked too."""
    message = "connect failed: host=db password='S3cret Pw1' sslpassword=S3cretPw2 via mysql://u:S3cretPw3@h"
    redacted = redact_message(message, "postgresql://u@db/app")
    assert "S3cret" not in redacted
    assert "host=db" in redacted


def test_config_repr_hides_store_url_secret_and_signing_key() -> None:
    """Fails before the fix: the frozen dataclass repr printed both in clear."""
    config = ExactOnceConfig(
        store_url="redis://:S3cretPw1@cache/0?password=S3cretPw2",
        signing_key="S3cretSigningKey-0123456789",
    )
    for text in (repr(config), str(config), repr(config.redacted())):
        assert "S3cret" not in text
        assert "redis://:***@cache/0?password=***" in text


def test_redis_store_where_repr_and_errors_hide_a_query_password() -> None:
    """Fails before the fix: ``_where`` and every StoreError showed ``?password=`` in clear."""
    url = "redis://127.0.0.1:1/0?password=S3cretPw1"  # nothing listens on port 1
    store = store_from_url(url, namespace="redaction", socket_timeout=2)
    try:
        assert "S3cret" not in repr(store)
        assert "S3cret" not in store._where  # what every message of the store names
        with pytest.raises(exceptions.StoreUnavailable) as caught:
            store.now()
        assert "S3cret" not in str(caught.value)
        assert "password=***" in str(caught.value)
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:1/test?password=S3cretPw1&sslpassword=S3cretPw2",
        "postgresql://postgres:S3cretPw1@127.0.0.1:1/test?connect_timeout=2",
        "mysql://root:S3cretPw1@127.0.0.1:1/test",
        "postgresql://postgres:S3cretPw1@/test?host=127.0.0.1:1&host=127.0.0.1:2",
    ],
)
def test_sql_store_errors_and_repr_hide_every_password(url: str) -> None:
    """Fails before the fix for the query form: the error named the URL with its password."""
    store = store_from_url(url, namespace="redaction")
    try:
        assert "S3cret" not in repr(store)
        with pytest.raises(exceptions.StoreError) as caught:
            store.now()
        assert "S3cret" not in str(caught.value)
        assert "***" in str(caught.value)
    finally:
        store.close()


def test_a_bad_store_url_error_never_shows_its_secret() -> None:
    """The configuration errors built from a URL show it redacted."""
    with pytest.raises(exceptions.ConfigurationError) as caught:
        ExactOnceConfig(store_url="nosuch://u:S3cretPw1@h/0?password=S3cretPw2")
    assert "S3cret" not in str(caught.value)
    with pytest.raises(exceptions.ConfigurationError) as caught:
        store_from_url("redis://h:notaport/0?password=S3cretPw1", namespace="x")
    assert "S3cret" not in str(caught.value)


def test_a_multi_host_sql_store_names_its_hosts_as_written() -> None:
    """A libpq multi-host URL: each ``host=H:P`` shown with its colon, not ``%3A``."""
    url = (
        "postgresql://postgres:S3cretPw1@/test?host=127.0.0.1:1&host=127.0.0.1:2"
        "&target_session_attrs=read-write"
    )
    store = store_from_url(url, namespace="redaction")
    try:
        shown = "postgresql+psycopg://postgres:***@/test?host=127.0.0.1:1&host=127.0.0.1:2"
        assert f"store {shown}&target_session_attrs=read-write," in repr(store)
        with pytest.raises(exceptions.StoreUnavailable) as caught:
            store.now()
        assert shown in str(caught.value)
        assert "S3cret" not in str(caught.value)
    finally:
        store.close()
