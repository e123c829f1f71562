"""The alert rules SREs load: they parse, and every metric they use is one the proxy exports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.metrics import exported_names, scrape_text
from tests.support.promql import PromQLError, metric_names
from tests.support.stack import running_stack

RULES = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "toolproxy" / "files" / "prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).resolve().parent / "prometheus" / "alert-rules.test.yaml"
REQUIRED_ALERTS = {"ToolproxyUnknownOutcomeRateHigh", "ToolproxyUnknownsOpenTooLong", "ToolproxyTakeoverRaised",
                   "ToolproxyOpaUnavailable", "ToolproxyRedisUnavailable", "ToolproxyApprovalBacklog",
                   "ToolproxyBreakerStuckOpen", "ToolproxyRedisEvictedKeys", "ToolproxyRedisMayEvict",
                   "ToolproxyContractDrift", "ToolproxyToolsQuarantined", "ToolproxyPinsUnverified",
                   "ToolproxyResourceFrozenTooLong", "ToolproxyFrozenWritesRefused"}


def rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_rule_file_has_the_alerts_sres_need_with_severity_and_summary():
    found = rules()
    assert REQUIRED_ALERTS <= {r["alert"] for r in found}
    for rule in found:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_every_expression_parses_and_selects_only_toolproxy_metrics():
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert all(n.startswith("toolproxy_") for n in names), (rule["alert"], names)


@pytest.mark.parametrize("bad", ["sum(rate(toolproxy_calls_total[5m])", "rat(toolproxy_calls_total[5m])",
                                 "toolproxy_calls_total[5x]", "toolproxy_calls_total @@ 1"])
def test_the_checker_rejects_broken_expressions(bad):
    with pytest.raises(PromQLError):
        metric_names(bad)


def test_the_checker_ignores_grouping_labels_and_matchers():
    names = metric_names('sum by (tool, pod) (rate(a_total{x="toolproxy_y"}[5m])) / on (pod) b')
    assert names == {"a_total", "b"}


def _promtool() -> str | None:
    candidate = Path(sys.prefix) / "bin" / "promtool"
    return str(candidate) if candidate.exists() else shutil.which("promtool")


needs_promtool = pytest.mark.skipif(_promtool() is None, reason="promtool not installed (scripts/setup.sh "
                                    "builds it with go install when Go is present)")


@needs_promtool
def test_promtool_accepts_the_rule_file():
    result = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout + result.stderr


@needs_promtool
def test_alerts_fire_when_they_should_and_not_before():
    """promtool unit tests: each alert on synthetic series, before and after its ``for`` window."""
    result = subprocess.run([_promtool(), "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
    covered = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert covered == {r["alert"] for r in rules()}


async def test_every_metric_in_the_rules_is_exported_by_a_live_proxy(redis_url):
    async with running_stack({"redis.url": redis_url}) as stack:
        exported = exported_names(await scrape_text(stack))
    used = set().union(*(metric_names(rule["expr"]) for rule in rules()))
    missing = sorted(used - exported)
    assert not missing, f"alert rules use metrics the proxy does not export: {missing}"
