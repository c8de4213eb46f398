"""One ``ExactOnceTask`` submitted inside ``transaction.atomic()`` with a row of the caller's.

``python -m tests.acceptance.apps.django_submit MODE TASK_ID`` (the ledger app's
environment, the store ``django://default``):

* ``commit``: a ``User`` named ``TASK_ID`` and the job ``TASK_ID`` of
  ``gated_record``, committed together;
* ``rollback``: the same, then the transaction is rolled back;
* ``kill``: the same, committed, and the process SIGKILLs itself in the first
  ``on_commit`` callback: after the commit, before the job's publish.
"""

from __future__ import annotations

import os
import signal
import sys

from tests.acceptance.apps.django_app import app  # sets Django up first


class Abort(Exception):
    pass


def main(mode: str, task_id: str) -> None:
    from django.contrib.auth.models import User
    from django.db import transaction

    try:
        with transaction.atomic():
            User.objects.create(username=task_id)
            if mode == "kill":  # registered first: it runs before the publish
                transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
            app.tasks["gated_record"].apply_async((task_id,), task_id=task_id)
            if mode == "rollback":
                raise Abort
    except Abort:
        pass


if __name__ == "__main__":
    main(*sys.argv[1:3])
