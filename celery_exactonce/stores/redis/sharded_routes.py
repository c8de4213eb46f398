"""How the sharded Redis store finds the shard of a job: by its id, its entry, or a search.

:class:`ShardRoutes` is the routing half of
:class:`~celery_exactonce.stores.redis.sharded.ShardedRedisStore` (the module
docs there say which shard holds what): a new job's home shard, the shard a
ref lives on (from itself, from what the store remembers, from the entry its
message names, or by reading each shard in turn), and the calls sent to the
hinted shard first, then again where a search finds the record when the hint
was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from celery_exactonce.core.jobs import Job, TransitionResult, TransitionStatus
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.redis.sharded_scans import ShardedScans
from celery_exactonce.stores.shards import shard_of

_A = TypeVar("_A")  # an answer of a store operation


class ShardRoutes(ShardedScans):
    """Which shard a job is created on, lives on, and a call on it goes to."""

    def _home(self, new: NewJob) -> int:
        """The shard a new job is created on (see the module docs)."""
        if new.ref.space is Space.OCCURRENCE and new.entry:
            return shard_of(new.entry, self._n)
        return shard_of(str(new.ref), self._n)

    def _locate(self, ref: JobRef) -> tuple[int, Job | None]:
        """The shard ``ref`` lives on, and its record when that had to be read to know."""
        if ref.space is not Space.OCCURRENCE:
            return shard_of(str(ref), self._n), None
        with self._lock:
            known = self._known.get(ref)
        if known is not None:
            return known, None
        return self._search(ref)

    def _search(self, ref: JobRef, skip: int | None = None) -> tuple[int, Job | None]:
        """Read ``ref`` on each shard but ``skip`` in turn, its hint's first, until found."""
        first = 0 if ref.entry_hint is None else shard_of(ref.entry_hint, self._n)
        for shard in (first, *range(first), *range(first + 1, self._n)):
            if shard == skip:
                continue
            job = self._parts[shard].get(ref)
            if job is not None:
                self._remember(ref, shard)
                return shard, job
        return shard_of(str(ref), self._n), None  # nowhere: any shard answers "not found"

    def _route(self, ref: JobRef) -> tuple[int, bool]:
        """The shard a write on ``ref`` goes to, and whether that is only its hint's, unread."""
        if ref.space is Space.OCCURRENCE and ref.entry_hint is not None:
            with self._lock:
                known = self._known.get(ref)
            if known is None:
                return shard_of(ref.entry_hint, self._n), True
            return known, False
        return self._locate(ref)[0], False

    def _routed(
        self,
        refs: Sequence[JobRef],
        run: Callable[[int, list[int]], Sequence[_A]],
        found: Callable[[_A], bool],
    ) -> list[_A]:
        """``run(shard, indexes)``: the answers for the ``refs`` at ``indexes``, all on ``shard``.

        A ref routed by its hint alone (:meth:`_route`) is checked by its answer:
        if it says the record is not there (not ``found``: no write applies where
        the record is not), the ref goes again to the shard a search finds it on;
        found nowhere else, the first answer stands.
        """
        routes = [self._route(ref) for ref in refs]
        answers: dict[int, _A] = {}
        self._run_on(run, {i: shard for i, (shard, _) in enumerate(routes)}, answers)
        again: dict[int, int] = {}
        for i, (shard, hinted) in enumerate(routes):
            if not hinted:
                continue
            if found(answers[i]):
                self._remember(refs[i], shard)
                continue
            home, job = self._search(refs[i], skip=shard)  # a wrong hint: elsewhere, if anywhere
            if job is not None:
                again[i] = home
        self._run_on(run, again, answers)
        return [answers[i] for i in range(len(refs))]

    def _run_on(
        self,
        run: Callable[[int, list[int]], Sequence[_A]],
        shards: dict[int, int],
        answers: dict[int, _A],
    ) -> None:
        """``run`` once per shard in ``shards`` (index to shard), its answers into ``answers``."""
        indexes = list(shards)
        for shard, positions in self._grouped(indexes, shards.__getitem__).items():
            group = [indexes[p] for p in positions]
            answers.update(zip(group, run(shard, group), strict=True))

    def _grouped(
        self, items: Sequence[Any], shard_of_item: Callable[[Any], int]
    ) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(shard_of_item(item), []).append(i)
        return groups


def found(result: TransitionResult) -> bool:
    """Whether a transition's answer says its record is on the shard that gave it."""
    return result.status is not TransitionStatus.NOT_FOUND
