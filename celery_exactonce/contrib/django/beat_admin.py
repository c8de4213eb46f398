"""django-celery-beat's "Periodic tasks" page with ``CELERY_BEAT_SCHEDULER = "exactonce-django"``.

That page asks django-celery-beat's ``is_database_scheduler`` whether the
setting names its database scheduler, to warn ("won't be dispatched") when
not. It imports the setting as a module or ``module:Class`` path, so the
alias our how-to and migration guide write, a Celery ``celery.beat_schedulers``
entry point with a hyphen, made the page fail with HTTP 500; and our
scheduler, which reads the same rows, is not a subclass of theirs, so even
its full path got the warning.

:func:`install` (run by the app's ``ready()`` when django-celery-beat is
installed) replaces that function with :func:`is_database_scheduler`: an
alias is resolved as ``celery beat -S`` resolves it, and celery-exactonce's
scheduler counts as a database scheduler. A name that resolves to nothing
shows the warning, not an error page.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: The entry-point group of ``celery beat -S`` aliases (``exactonce``, ``exactonce-django``).
ALIASES = "celery.beat_schedulers"

#: The alias of celery-exactonce's scheduler of django-celery-beat's rows.
OURS = "exactonce-django"

#: django-celery-beat's own function (``"original"``), which :func:`is_database_scheduler`
#: falls back on.
_replaced: dict[str, Callable[[Any], bool]] = {}


def resolve(scheduler: Any) -> Any:
    """The scheduler class ``scheduler`` names (an alias, a path or a class); raises ImportError."""
    from celery.utils.imports import load_extension_class_names, symbol_by_name

    if not isinstance(scheduler, str):
        return scheduler
    aliases = dict(load_extension_class_names(ALIASES))
    return symbol_by_name(scheduler, aliases=aliases)


def is_database_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` runs django-celery-beat's rows: theirs, or ``exactonce-django``."""
    if not scheduler:
        return False
    try:
        found = resolve(scheduler)
        ours = resolve(OURS)  # by its alias: this admin module imports no scheduler
    except (ImportError, AttributeError, ValueError):
        return False  # a name that is nothing: the page's warning says what to set
    if isinstance(found, type) and issubclass(found, ours):
        return True
    original = _replaced.get("original")
    try:
        return original is not None and bool(original(found))
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def install() -> None:
    """Make django-celery-beat's admin use :func:`is_database_scheduler` (idempotent).

    Its ``utils`` module, and its ``admin`` module when imported already
    (which took the function by name).
    """
    from django_celery_beat import utils

    if utils.is_database_scheduler is not is_database_scheduler:
        _replaced["original"] = utils.is_database_scheduler
        utils.is_database_scheduler = is_database_scheduler
    admin = sys.modules.get("django_celery_beat.admin")
    if admin is not None:
        admin.is_database_scheduler = is_database_scheduler  # type: ignore[attr-defined]
