"""Every model to the database the running test picked (in-process tests only)."""

from __future__ import annotations

from typing import Any

#: The alias every query goes to: ``default`` (SQLite) or ``postgres``.
ALIAS = "default"


class Router:
    def db_for_read(self, model: Any, **hints: Any) -> str:
        return ALIAS

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return ALIAS

    def allow_relation(self, *args: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, *args: Any, **hints: Any) -> bool:
        return True
