"""The Grafana dashboard in examples/grafana: valid JSON, on the metrics the package exports."""

from __future__ import annotations

import json
import re
from datetime import timezone
from pathlib import Path
from typing import Any

from prometheus_client.registry import REGISTRY

from celery_exactonce.observe import metrics, prometheus
from celery_exactonce.observe.entry_health import EntryHealthReader
from celery_exactonce.observe.gauges import BeatGauges, StoreGauges
from celery_exactonce.stores import InMemoryStore

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "celery-exactonce.json"


def exported() -> set[str]:
    """Every sample name the package exports: beat's gauges, the counter, the last pass."""
    metrics.ensure_prometheus()
    store = InMemoryStore()
    health = EntryHealthReader(store, dict, tz=timezone.utc, periods=2)
    collector = prometheus.BeatCollector(BeatGauges("n"), StoreGauges(store, health=health))
    families = [*collector.describe(), *REGISTRY.collect()]
    names = set()
    for family in families:
        if family.name.startswith("exactonce_"):
            names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return found


def test_every_expression_names_only_metrics_we_export_and_every_gauge_is_shown() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    known = exported()
    assert {"exactonce_events_total", "exactonce_jobs", "exactonce_due_jobs"} <= known
    shown: set[str] = set()
    exprs = [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        named = set(re.findall(r"\bexactonce_[a-z_]+\b", expr))
        assert named, f"{expr!r} names no metric of ours"
        assert named <= known, f"{expr!r} names {sorted(named - known)}, not exported"
        shown |= named
    assert shown == known, f"exported but on no panel: {sorted(known - shown)}"


def test_every_panel_has_a_title_and_a_unique_id() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    assert all(panel["title"] and panel["targets"] for panel in panels(dashboard))
    assert dashboard["uid"] == "celery-exactonce"
