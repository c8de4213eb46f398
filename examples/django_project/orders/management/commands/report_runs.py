"""``python manage.py report_runs``: did the report run, once per occurrence?

Prints one JSON line: the runs, the occurrences that ran more than once, and
what the admin shows (the row's ``total_run_count``). Exit status 1 if an
occurrence ran twice or the count differs from the runs.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django_celery_beat.models import PeriodicTask

from orders.models import ReportRun


class Command(BaseCommand):
    help = "Check that each occurrence of the report ran once, and that the admin counts them."

    def handle(self, *args: Any, **options: Any) -> None:
        runs = Counter(ReportRun.objects.values_list("key", "fire_time"))
        twice = sorted(f"{key}@{fire}" for (key, fire), n in runs.items() if n > 1)
        row = PeriodicTask.objects.get(name="orders-report")
        summary = {
            "runs": sum(runs.values()),
            "occurrences": len(runs),
            "ran_twice": twice,
            "total_run_count": row.total_run_count,
        }
        self.stdout.write(json.dumps(summary))
        if twice or row.total_run_count != summary["runs"]:
            raise CommandError("an occurrence ran twice, or the count is not the runs")
