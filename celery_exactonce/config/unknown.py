"""Unknown ``exactonce_*`` settings: most often a typo, named with the setting meant.

A setting this version does not know (``exactonce_tick_intervall``) is
ignored, so the default stays in force without a word unless someone says
so. :func:`find` names each one as the app spells it, with the known
setting it most resembles spelled the same way (``CELERY_EXACTONCE_TICK_INTERVAL``
for Django's ``CELERY_`` namespace). A worker and beat warn
(:func:`warn`) at the file the app's settings come from, which
:func:`source_of` finds, never at library code; ``celery exactonce check``
fails on one.

Not here: the known settings themselves (:mod:`celery_exactonce.config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import sys
import types
import warnings
from collections.abc import Collection, Iterable
from typing import Any

#: How alike a known name must be to an unknown one to be suggested (difflib's ratio).
CUTOFF = 0.6


class UnknownSettingWarning(UserWarning):
    """An ``exactonce_*`` setting that this version does not know (a typo?)."""


@dataclasses.dataclass(frozen=True)
class Unknown:
    """One unknown setting, as the app spells it, and the known one it resembles."""

    key: str
    suggestion: str | None

    @property
    def message(self) -> str:
        hint = f"did you mean {self.suggestion!r}?" if self.suggestion else "no setting is like it"
        return f"unknown setting {self.key!r} ignored (its default applies): {hint}"


def find(keys: Iterable[str], known: Collection[str], prefix: str) -> list[Unknown]:
    """The keys whose name after ``prefix`` (any case; a key without it: all of it) is
    not in ``known``."""
    found = []
    for key in keys:
        start = key.lower().find(prefix)
        start = 0 if start < 0 else start + len(prefix)  # no prefix at all: the whole key
        name = key[start:].lower()
        if name in known:
            continue
        match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=CUTOFF)
        suggestion = None
        if match:
            spelled = match[0].upper() if key[start:].isupper() else match[0]
            suggestion = key[:start] + spelled if start else prefix + spelled
        found.append(Unknown(key, suggestion))
    return found


def warn(app: Any, unknown: Iterable[Unknown]) -> None:
    """One :class:`UnknownSettingWarning` per setting, located where ``app``'s settings are."""
    for item in unknown:
        filename, lineno = source_of(app, item.key)
        warnings.warn_explicit(item.message, UnknownSettingWarning, filename, lineno)


def source_of(app: Any, key: str) -> tuple[str, int]:
    """The file ``app``'s settings come from, and the line that spells ``key`` (0: none).

    The object given to ``app.config_from_object`` (a module, a module's
    name, or Django's settings: the project's settings module), else the
    module that made the app (``Celery("proj")``) or that holds it. The line is
    the first that sets ``key`` literally (``key = …``, ``"key": …``), else the
    first that names it, else 0.
    """
    path = _source_file(app)
    if path is None:
        return f"<the settings of Celery app {getattr(app, 'main', None)!r}>", 0
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return path, 0
    setting = re.compile(rf"\b{re.escape(key)}\b[\"']?\s*[=:]", re.IGNORECASE)
    for pattern in (setting, re.compile(rf"\b{re.escape(key)}\b", re.IGNORECASE)):
        for number, line in enumerate(lines, 1):  # where it is set, else where it is named
            if pattern.search(line):
                return path, number
    return path, 0


def _source_file(app: Any) -> str | None:
    source = getattr(app, "_config_source", None)
    module: object = None
    if isinstance(source, str):
        module = _module(source.partition(":")[0])
    elif isinstance(source, types.ModuleType):
        module = source
    elif source is not None:
        module = source if inspect.isclass(source) else type(source)
    path = _file_of(module)
    if path is not None:
        return path
    module = sys.modules.get(str(getattr(app, "main", "") or ""))
    if module is None:  # the module that holds the app (``celery -A pkg.module``)
        module = next(
            (
                m
                for name, m in list(sys.modules.items())
                if not name.startswith(("celery", "kombu"))
                and any(value is app for value in list(getattr(m, "__dict__", {}).values()))
            ),
            None,
        )
    return _file_of(module)


def _module(name: str) -> object:
    if name == "django.conf":  # Django's settings: the project's module holds them
        name = os.environ.get("DJANGO_SETTINGS_MODULE", name)
    return sys.modules.get(name)


def _file_of(thing: object) -> str | None:
    if thing is None:
        return None
    if getattr(thing, "__module__", None) == "django.conf":  # LazySettings
        thing = _module("django.conf")
    try:
        path = inspect.getsourcefile(thing)  # type: ignore[arg-type]
    except TypeError:
        return None
    return os.path.abspath(path) if path else None
