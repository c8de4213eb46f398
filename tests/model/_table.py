"""The one place the model imports ``celery_exactonce``: the job states and their table.

Every other module of the model takes ``State`` and ``states`` from here, so
a move of ``celery_exactonce.core.states`` changes one line. ``states`` is the
module itself: ``CREATABLE``, ``ALLOWED`` and ``NEXT_ATTEMPT_EDGES`` are read
from it when the comparison runs (a test may patch them).
"""

from __future__ import annotations

from celery_exactonce.core import states
from celery_exactonce.core.states import State

__all__ = ["State", "states"]
