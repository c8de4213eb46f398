"""The Redis store's reads for people (filtered listings, a lease's holder) and stored entries.

Helpers of :class:`~celery_exactonce.stores.redis.store.RedisStore` that answer the
CLI's questions, none of them on a hot path:

* **a filtered listing** (:func:`filtered`): the state's index walked page by
  page with the ``list_stale`` script, the task and the entry matched here on
  the records read (the index knows neither), until a page is full or the
  index ends;
* **a lease** (:meth:`RedisReads._lease`): its token and ``PTTL`` with the
  server's ``TIME``, in one ``MULTI``;
* **ids by prefix** (:meth:`RedisReads.find_ids`): every record is a member
  of exactly one state index, so ``ZSCAN … MATCH <space>:<prefix>*`` over the
  state indexes finds them, the server's other keys never walked.
* **stored beat entries** (:meth:`RedisReads.read_entries` and the writes):
  one hash, ``base:entries``, each entry's definition under its name, and the
  revision under the empty name (no entry has it), moved by every write in the
  same script (``entry_write``: compare, write, count; with ``min_replicas``
  a counted write, as a job's).

Not here: the operations themselves, the counts per state among them (one
``count_states`` script, :mod:`~celery_exactonce.stores.redis.store`), the key
layout (:mod:`~celery_exactonce.stores.redis.keys`).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Protocol

from celery_exactonce.core import refs, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import UNCHECKED, Unchecked, check_entry_name
from celery_exactonce.stores.redis.base import RedisCore
from celery_exactonce.stores.redis.codec import as_text

#: Records read per ``list_stale`` call while a filtered listing looks for matches.
FILTER_PAGE = 500
#: Index members a ``ZSCAN`` step of :meth:`RedisReads.find_ids` walks.
SCAN_COUNT = 1000
#: The field of the entries hash that holds their revision (no entry is named so).
REVISION_FIELD = ""
#: What a glob pattern (``MATCH``) reads as more than itself.
_GLOB = re.compile(r"([*?\[\]\\^])")


class Lister(Protocol):
    """``list_stale`` as the store defines it."""

    def __call__(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]: ...


class RedisReads(RedisCore):
    """Filtered listings and lease holders, read for the CLI; the stored beat entries."""

    def entries_revision(self) -> int:
        with self._wrap("entries_revision"):
            found = self._client.hget(self._key("entries"), REVISION_FIELD)
        return 0 if found is None else int(found)

    def read_entries(self) -> tuple[int, dict[str, str]]:
        with self._wrap("read_entries"):
            found = self._client.hgetall(self._key("entries"))
        definitions = {as_text(k): as_text(v) for k, v in found.items()}
        return int(definitions.pop(REVISION_FIELD, 0)), definitions

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        check_entry_name(name)
        checked = not isinstance(expect, Unchecked)
        args = [
            name,
            definition or "",
            "del" if definition is None else "put",
            "1" if checked else "0",
            expect if isinstance(expect, str) else "",
            "1" if checked and expect is None else "0",
        ]
        with self._wrap("write_entry"):
            revision = self._run("entry_write", [self._key("entries")], args)
        return None if revision is None else int(revision)

    def _lease(self, name: str) -> tuple[str, datetime] | None:
        key = self._key("lease", name)
        with self._wrap("lease"):
            pipe = self._node(key).pipeline(transaction=True)
            pipe.time()
            pipe.get(key)
            pipe.pttl(key)
            (seconds, micros), token, ttl = pipe.execute()
        if token is None or int(ttl) <= 0:  # absent, or (-1) no expiry: never written so
            return None
        now = int(seconds) * 1_000_000 + int(micros)
        return as_text(token), times.from_micros(now + int(ttl) * 1000)

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        """The refs whose id starts with ``prefix``: the state indexes scanned until ``limit``."""
        refs.validate_identifier(prefix, "job id prefix", refs.MAX_ID_LENGTH)
        self._check_open()
        pattern = "?:" + _GLOB.sub(r"\\\1", prefix) + "*"
        found: set[str] = set()
        with self._wrap("find_ids"):
            for state in State:
                key = self._state_key(state)
                cursor: int = 0
                while True:
                    cursor, page = self._node(key).zscan(
                        key, cursor, match=pattern, count=SCAN_COUNT
                    )
                    found.update(as_text(member) for member, _ in page)
                    if int(cursor) == 0 or len(found) > limit:
                        break
        return sorted((JobRef.parse(m) for m in found), key=str)[: max(limit, 0)]


def filtered(
    list_stale: Lister,
    state: State,
    limit: int,
    after: tuple[datetime, JobRef] | None,
    older_than: float,
    task: str | None,
    entry: str | None,
) -> list[Job]:
    """Up to ``limit`` jobs of ``list_stale``'s order that match ``task`` and ``entry``.

    Pages of :data:`FILTER_PAGE` records from ``after`` on, until ``limit``
    matched or a short page (the end of the index).
    """
    found: list[Job] = []
    cursor = after
    while len(found) < limit:
        page = list_stale(state, older_than, FILTER_PAGE, after=cursor)
        found.extend(
            job
            for job in page
            if (task is None or job.task == task) and (entry is None or job.entry == entry)
        )
        if len(page) < FILTER_PAGE:
            break
        cursor = (page[-1].touched_at, page[-1].ref)
    return found[:limit]
