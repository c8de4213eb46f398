"""``celery -A APP exactonce …``: look at and act on an app's jobs from a shell.

A ``celery.commands`` entry point (``pyproject.toml``), so Celery loads it as
one of its own commands, after ``-A APP`` loaded the app. The subcommands:

========================  ==============================================================
``check``                 every start-up check of a worker and a beat node (exit 1: one failed)
``status``                jobs per state, oldest live jobs, entries, skipped slots, reconciler
``jobs``                  jobs filtered by state, task, entry key and age, a page at a time
``show TASK_ID``          one job and its history
``schedule``              each beat entry's next slots and last claimed occurrence;
                          ``schedule add|remove|pause|resume``: the stored entries
``reconcile``             one reconciler pass now, and its report
``cancel TASK_ID``        cancel a job not dispatched yet
``migrate``               create or upgrade the store's schema
``import redbeat``        RedBeat's entries moved into stored entries
``web``                   serve the jobs dashboard (the ``web`` extra; docs/howto/dashboard.md)
``probe beat|worker``     ask a beat or worker on this host whether it is live (``--ready``: ready)
========================  ==============================================================

Each but ``web`` takes ``--json``. Exit codes: 0 success, 1 a check or the command
failed, 2 bad usage (:mod:`celery_exactonce.cli.base`). docs/howto/cli.md
shows each with its output.
"""

from __future__ import annotations

import click

from celery_exactonce.cli.act import cancel, migrate, reconcile
from celery_exactonce.cli.check import check
from celery_exactonce.cli.imports import import_
from celery_exactonce.cli.inspect import jobs, show, status
from celery_exactonce.cli.probe import probe
from celery_exactonce.cli.schedule import schedule
from celery_exactonce.cli.web import web_command

__all__ = ["exactonce"]


@click.group()
def exactonce() -> None:
    """celery-exactonce: check the set-up, look at jobs and entries, act on them."""


_COMMANDS = (
    check,
    status,
    jobs,
    show,
    schedule,
    reconcile,
    cancel,
    migrate,
    import_,
    web_command,
    probe,
)
for _command in _COMMANDS:
    exactonce.add_command(_command)
