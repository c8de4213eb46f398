"""Format versions: what this version writes, and the newest it reads.

Each record the Redis store writes names the format of its fields
(``format``), and each message a dispatch sends names the format of our
headers (``exactonce_format``); on the SQL stores the schema version is the
format of the tables and their rows. A process reads every format up to its
own and refuses a newer one with one line naming both
(:class:`~celery_exactonce.core.exceptions.FormatTooNew`): it never guesses at
fields it does not know. A record or message without a format is of format 1
(written before formats were named).

A change of format that an older version could misread moves these numbers;
one that it reads correctly (a field it ignores) does not. Upgrading: workers
first, then beats and the processes that submit (docs/howto/upgrade.md).
"""

from __future__ import annotations

from celery_exactonce.core import exceptions

#: The format of the records this version writes, and the newest it reads.
RECORD_FORMAT = 1
#: The format of the headers of the messages this version sends, and the newest it reads.
MESSAGE_FORMAT = 1


def format_of(value: object) -> int:
    """A stored or sent format (``None``: 1, written before formats were named)."""
    if value is None or value == "":
        return 1
    try:
        return int(str(value))
    except ValueError:
        return 0  # not a format: the caller's own checks refuse what it cannot read


def refuse_newer(kind: str, found: object, what: str) -> None:
    """Raise :class:`~celery_exactonce.core.exceptions.FormatTooNew` if ``found`` (a ``kind``
    format: ``record`` or ``message``) is newer than this version reads."""
    reads = RECORD_FORMAT if kind == "record" else MESSAGE_FORMAT
    version = format_of(found)
    if version > reads:
        raise exceptions.FormatTooNew(
            f"{what} is a {kind} of format {version}; this celery-exactonce reads {kind} "
            f"formats up to {reads}: upgrade it (workers first, then beats)"
        )
