"""What a record keeps once terminal, and for how long: :class:`Compaction`.

Three settings say it: ``exactonce_terminal_history`` and
``exactonce_terminal_payload`` (what a terminal record keeps), and
``exactonce_occurrence_retention`` (how long a terminal beat occurrence is
kept, when that is shorter than ``exactonce_retention``). Every store is
given one :class:`Compaction` and applies it as
:func:`~celery_exactonce.core.jobs.compact_terminal` and
:meth:`Compaction.retention_of` say.

Why an occurrence may go sooner (docs/design/protocol.md, "Expiry"): past
the look-back horizon (``window_lookback + tick_interval + max_skew``) no
beat node claims its slot, the entry's watermark refuses a create of it
whatever is stored, a node's re-check of its own recent claims reads only
claims within its look-back, and a late delivery of its message carries
the package's headers, so a gate that finds no record refuses it.
"""

from __future__ import annotations

import dataclasses

from celery_exactonce.core.refs import JobRef, Space

#: What a terminal record may keep of its history (``exactonce_terminal_history``).
TERMINAL_HISTORY = ("full", "last", "none")


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What a record keeps once terminal, and how long an occurrence's is kept.

    ``history``: ``"full"`` (the capped history, as a live record keeps it),
    ``"last"`` (the transition that ended the job) or ``"none"``; ``payload``:
    whether args, kwargs, options and the signature stay. The record's own
    fields (state, reason, node, rev, run id, attempt, dispatches, task, entry
    and every time) always stay: they are what operators read.
    ``occurrence_retention``: seconds a terminal beat occurrence is kept
    (``None``: the store's retention, as every other record).
    """

    history: str = "full"
    payload: bool = True
    occurrence_retention: float | None = None

    def __post_init__(self) -> None:
        if self.history not in TERMINAL_HISTORY:
            raise ValueError(f"history must be one of {TERMINAL_HISTORY}, got {self.history!r}")
        if self.occurrence_retention is not None and not self.occurrence_retention > 0:
            raise ValueError(f"occurrence_retention must be > 0, got {self.occurrence_retention}")

    @property
    def compacts(self) -> bool:
        """Whether a terminal record loses anything."""
        return self.history != "full" or not self.payload

    def retention_of(self, ref: JobRef, retention: float) -> float:
        """How long the terminal record of ``ref`` is kept, given the store's ``retention``."""
        if self.occurrence_retention is None or ref.space is not Space.OCCURRENCE:
            return retention
        return min(retention, self.occurrence_retention)


#: Everything kept, as long as the retention says: the default.
KEEP = Compaction()
