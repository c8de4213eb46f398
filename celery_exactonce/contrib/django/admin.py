"""The store's read-only admin: jobs (by state, task, age, namespace), beat entries, skipped slots.

Nothing here writes: jobs change only through the store's protocol (a
dispatch, the gate, the reconciler, ``cancel()``), never through a form. The
detail page of a job shows its record as the store reads it: arguments,
options, history, and the idempotency key its messages carry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.contrib import admin
from django.utils.html import format_html, format_html_join

from celery_exactonce.contrib.django.models import Job, SkippedSlots, Watermark, instant

_F = TypeVar("_F", bound=Callable[..., Any])


def display(description: str, ordering: str | None = None) -> Callable[[_F], _F]:
    """Django's ``admin.display``, typed."""

    def mark(fn: _F) -> _F:
        return cast(_F, admin.display(description=description, ordering=ordering)(fn))

    return mark


#: The age filter's choices: (value, label, seconds).
AGES = (
    ("hour", "in the last hour", 3600),
    ("day", "in the last day", 86_400),
    ("week", "in the last week", 7 * 86_400),
)


class AgeFilter(admin.SimpleListFilter):  # type: ignore[misc]  # django is untyped here
    """Jobs by when they were created: the last hour, day or week, or before."""

    title = "created"
    parameter_name = "age"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, label, _ in AGES] + [("older", "more than a week ago")]

    def queryset(self, request: Any, queryset: Any) -> Any:
        now = int(time.time() * 1_000_000)
        for value, _, seconds in AGES:
            if self.value() == value:
                return queryset.filter(created_at__gte=now - seconds * 1_000_000)
        if self.value() == "older":
            return queryset.filter(created_at__lt=now - AGES[-1][2] * 1_000_000)
        return queryset


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[misc]  # django is untyped here
    """An admin that shows and never changes."""

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("job_id", "task", "state", "attempt", "entry", "fire", "created", "touched")
    list_filter = ("state", "task", AgeFilter, "namespace")
    search_fields = ("job_id", "entry", "task")
    fields = (
        "namespace",
        "job_id",
        "task",
        "state",
        "attempt",
        "idempotency",
        "entry",
        "fire",
        "due",
        "expires",
        "created",
        "touched",
        "heartbeat",
        "ended",
        "dispatches",
        "node",
        "reason",
        "run_id",
        "arguments",
        "options",
        "history_table",
    )
    readonly_fields = fields
    list_per_page = 50

    @display(description="fire time", ordering="fire_time")
    def fire(self, obj: Job) -> Any:
        return instant(obj.fire_time)

    @display(description="created", ordering="created_at")
    def created(self, obj: Job) -> Any:
        return instant(obj.created_at)

    @display(description="last change", ordering="touched_at")
    def touched(self, obj: Job) -> Any:
        return instant(obj.touched_at)

    @display(description="due (eta)")
    def due(self, obj: Job) -> Any:
        return instant(obj.run_at)

    @display(description="publish deadline")
    def expires(self, obj: Job) -> Any:
        return instant(obj.deadline)

    @display(description="last heartbeat")
    def heartbeat(self, obj: Job) -> Any:
        return instant(obj.heartbeat_at)

    @display(description="ended")
    def ended(self, obj: Job) -> Any:
        return instant(obj.terminal_at)

    @display(description="idempotency key")
    def idempotency(self, obj: Job) -> str:
        return obj.idempotency_key()

    @display(description="args, kwargs")
    def arguments(self, obj: Job) -> Any:
        record = obj.record()
        return format_html("<code>{}</code>", _json({"args": record.args, "kwargs": record.kwargs}))

    @display(description="options")
    def options(self, obj: Job) -> Any:
        return format_html("<code>{}</code>", _json(obj.record().options))

    @display(description="history")
    def history_table(self, obj: Job) -> Any:
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{} → {}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    entry.at.isoformat(),
                    entry.src.value if entry.src else "",
                    entry.dst.value,
                    entry.node,
                    entry.reason,
                )
                for entry in obj.record().history
            ),
        )
        return format_html(
            "<table><tr><th>at</th><th>transition</th><th>node</th><th>reason</th></tr>{}</table>",
            rows,
        )


@admin.register(Watermark)
class WatermarkAdmin(ReadOnlyAdmin):
    list_display = ("entry", "last_claimed", "namespace")
    list_filter = ("namespace",)
    search_fields = ("entry",)
    fields = ("namespace", "entry", "last_claimed")
    readonly_fields = fields

    @display(description="last slot claimed", ordering="fire_time")
    def last_claimed(self, obj: Watermark) -> Any:
        return instant(obj.fire_time)


def _json(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, default=str, ensure_ascii=False)


#: What makes two records of skipped slots one range: every beat node plans every
#: entry, so a range all of them skipped is noted once per node.
_SAME_RANGE = ("namespace", "entry", "reason", "first_slot", "last_slot", "slots")


@admin.register(SkippedSlots)
class SkippedSlotsAdmin(ReadOnlyAdmin):
    """One row per range of skipped slots, however many nodes noted it (as ``status`` shows)."""

    list_display = ("entry", "reason", "slots", "first", "last", "nodes", "noted")
    list_filter = ("reason", "entry", "namespace")
    search_fields = ("entry",)
    fields = ("namespace", "entry", "reason", "slots", "first", "last", "nodes", "noted")
    readonly_fields = fields

    def get_queryset(self, request: Any) -> Any:
        """The newest record of each range: the others say the same of other nodes."""
        from django.db.models import Max

        newest = SkippedSlots.objects.values(*_SAME_RANGE).annotate(seq_max=Max("seq"))
        return super().get_queryset(request).filter(seq__in=newest.values("seq_max"))

    @display(description="nodes")
    def nodes(self, obj: SkippedSlots) -> str:
        """Every node that noted this range, the newest first."""
        same = SkippedSlots.objects.filter(**{f: getattr(obj, f) for f in _SAME_RANGE})
        noted = same.order_by("-seq").values_list("node", flat=True)
        return ", ".join(dict.fromkeys(noted))

    @display(description="first slot", ordering="first_slot")
    def first(self, obj: SkippedSlots) -> Any:
        return instant(obj.first_slot)

    @display(description="last slot", ordering="last_slot")
    def last(self, obj: SkippedSlots) -> Any:
        return instant(obj.last_slot)

    @display(description="noted", ordering="noted_at")
    def noted(self, obj: SkippedSlots) -> Any:
        return instant(obj.noted_at)
