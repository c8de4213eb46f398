"""The alert rules shipped in examples/prometheus: valid, tested, on metrics we export.

``promtool check rules`` parses them; ``promtool test rules`` runs their tests
(alerts_test.yml: for each alert, series that fire it and a near miss that
does not). Every metric a rule names is one the package exports.
"""

from __future__ import annotations

import re

from tests.support import promtool
from tests.unit.test_dashboard import exported


def test_the_rules_parse() -> None:
    result = promtool.run("check", "rules", promtool.RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 9 rules found" in result.stdout, result.stdout


def test_each_alert_fires_on_its_series_and_not_on_the_near_miss() -> None:
    result = promtool.run("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_test_and_names_only_metrics_we_export() -> None:
    rules = promtool.RULES.read_text(encoding="utf-8")
    tests = (promtool.RULES_DIR / "alerts_test.yml").read_text(encoding="utf-8")
    alerts = re.findall(r"^\s+- alert: (\w+)$", rules, flags=re.MULTILINE)
    assert len(alerts) == 9
    tested = set(re.findall(r"^\s+alertname: (\w+)$", tests, flags=re.MULTILINE))
    assert tested == set(alerts)
    exprs = re.findall(r"^\s+expr: (.+)$", rules, flags=re.MULTILINE)
    assert len(exprs) == len(alerts)
    named = {name for expr in exprs for name in re.findall(r"\bexactonce_[a-z_]+\b", expr)}
    assert named and named <= exported(), sorted(named - exported())
