"""The Grafana dashboards in the chart: rendered for the sidecar, every query parses, and every series and
label it names is in a live proxy's /metrics after a scenario that exercises them (real OPA, Redis, backend)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.browser import chromium_page, needs_chromium, screenshot
from tests.support.dashboard_render import evaluate, legend, page, series
from tests.support.helm import CHART, MINIMAL_VALUES, helm
from tests.support.metrics import exported_names, scrape_text
from tests.support.promql import label_names, metric_names
from tests.support.stack import running_stack
from tests.support.tokens import jwt_overrides
from tests.test_alert_rules import _promtool, needs_promtool

DASHBOARDS = sorted((CHART / "files" / "dashboards").glob("*.json"))
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL with Grafana's macros replaced by durations) of every panel target."""
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for macro, value in GRAFANA_MACROS.items():
                expr = expr.replace(macro, value)
            assert "$" not in expr, (panel["title"], expr)  # no dashboard variable stands in for a label
            out.append((f'{panel["title"]} / {target["refId"]}', expr))
    return out


def test_there_is_an_sre_and_a_security_dashboard_covering_what_they_watch():
    boards = {p.stem: dashboard(p) for p in DASHBOARDS}
    assert set(boards) == {"toolproxy-sre", "toolproxy-security"}
    used = {name: set().union(*(metric_names(e) for _, e in queries(b))) for name, b in boards.items()}
    assert {"toolproxy_stage_duration_seconds_bucket", "toolproxy_calls_total", "toolproxy_unknown_outcomes_total",
            "toolproxy_open_unknowns", "toolproxy_takeovers_total", "toolproxy_dependency_up",
            "toolproxy_opa_request_duration_seconds_bucket"} <= used["toolproxy-sre"]
    assert {"toolproxy_policy_decisions_total", "toolproxy_policy_denials_total", "toolproxy_pending_approvals",
            "toolproxy_approvals_total"} <= used["toolproxy-security"]
    for board in boards.values():
        assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
        assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"] for t in p["targets"])


def _render(*args: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", "t", str(CHART), "-f", str(MINIMAL_VALUES), *args).stdout)
            if d]


def test_the_chart_ships_them_as_configmaps_for_the_grafana_sidecar_only_when_asked():
    assert not [m for m in _render() if "grafana_dashboard" in m["metadata"].get("labels", {})]
    maps = [m for m in _render("-n", "shop", "--set", "grafanaDashboards.enabled=true")
            if m["kind"] == "ConfigMap" and "grafana_dashboard" in m["metadata"]["labels"]]
    assert sorted(m["metadata"]["name"] for m in maps) == ["t-toolproxy-security", "t-toolproxy-sre"]
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert m["metadata"]["namespace"] == "shop"
        [(filename, text)] = m["data"].items()
        assert json.loads(text) == dashboard(CHART / "files" / "dashboards" / filename)
    moved = [m for m in _render("--set", "grafanaDashboards.enabled=true", "--set", "grafanaDashboards.namespace=mon",
                                "--set", "grafanaDashboards.label=dash", "--set", "grafanaDashboards.folder=Proxy")
             if m["kind"] == "ConfigMap" and "dash" in m["metadata"]["labels"]]
    assert len(moved) == 2 and all(m["metadata"]["namespace"] == "mon" and
                                   m["metadata"]["annotations"] == {"grafana_folder": "Proxy"} for m in moved)


@needs_promtool
def test_promtool_parses_every_panel_query(tmp_path):
    """Each query becomes a recording rule: promtool parses it with Prometheus's own PromQL parser."""
    rules = [{"record": f"dashboard:{p.stem.replace('-', '_')}:q{i}", "expr": expr}
             for p in DASHBOARDS for i, (_, expr) in enumerate(queries(dashboard(p)))]
    path = tmp_path / "dashboard-queries.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout + result.stderr


async def live_scenario(proxy_deps, issuers, opa_server, redis_server) -> tuple[str, str, float]:
    """Drive a proxy through what the dashboards watch; its /metrics text before and after, and the seconds
    between the two scrapes."""
    agent, admin = issuers
    approver = admin.token("amy", audience="toolproxy-admin", roles=["approver"], scope="")
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False,
                              "reconcile.backoff_initial_ms": 0, "audit.sinks": ["stdout", "redis"]}) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        before, started = await scrape_text(stack), time.monotonic()
        opa_server.stop()  # OPA down: the call fails closed (opa_errors, dependency_up{opa} 0)
        try:
            assert (await stack.call("get_order", {"order_id": "ord_1001"}))[1]["error"]["code"] == \
                "policy_unavailable"
            await stack.runtime.health.readiness(use_cache=False)
        finally:
            opa_server.start()
        # Redis down (first, as it forgets everything): a read still runs; its audit record misses the redis sink.
        redis_server.stop()
        try:
            assert (await stack.call("get_order", {"order_id": "ord_1001"}))[0] == 200
        finally:
            redis_server.start()
        assert (await stack.call("get_order", {"order_id": "ord_1001"}))[0] == 200
        refund, key = {"order_id": "ord_1001", "amount": 6000, "reason": "dup"}, {"Idempotency-Key": "dash-1"}
        _, pending = await stack.call("refund_order", refund, headers=key)
        approval_id = pending["error"]["details"]["approval_id"]
        assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
        assert (await stack.call("refund_order", refund, headers={**key, "X-Approval-Id": approval_id}))[0] == 200
        for order, decision in (("ord_1002", "deny"), ("ord_1003", None)):  # one denied, one left pending
            _, pending = await stack.call("refund_order", {**refund, "order_id": order}, headers={"Idempotency-Key": order})
            if decision:
                assert (await stack.admin("POST", f"/v1/approvals/{pending['error']['details']['approval_id']}/deny",
                                          approver))[0] == 200
        assert (await stack.call("get_order", {"order_id": "ord_2001"}))[1]["error"]["code"] == "forbidden"
        await stack.fault("adjust_counter", "drop_after_commit", count=1)
        _, unknown = await stack.call("adjust_counter", {"counter": "ctr_dash", "delta": 1},
                                      headers={"Idempotency-Key": "dash-2"})
        assert unknown["outcome"] == "unknown"
        assert (await stack.runtime.reconciler.scan_once()).get("takeover") == 1
        assert (await stack.admin("GET", "/v1/approvals", None))[0] == 401  # request_errors{code}
        await stack.runtime.health.readiness(use_cache=False)
        return before, await scrape_text(stack), time.monotonic() - started


@pytest.fixture
async def live_metrics(proxy_deps, issuers, opa_server, redis_server):
    return await live_scenario(proxy_deps, issuers, opa_server, redis_server)


async def test_every_series_and_label_in_the_dashboards_is_in_a_live_metrics_scrape(live_metrics):
    live_metrics = live_metrics[1]
    exported = exported_names(live_metrics)
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(live_metrics):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    problems = []
    for path in DASHBOARDS:
        for where, expr in queries(dashboard(path)):
            names = metric_names(expr)
            problems += [f"{path.stem} {where}: series {n} is not exported" for n in sorted(names - exported)]
            seen = set().union(*(labels.get(n, set()) for n in names))
            for label in sorted(label_names(expr) - seen):
                problems.append(f"{path.stem} {where}: label {label} is on none of {sorted(names)} in the scrape")
    assert not problems, "\n".join(problems)


@needs_chromium
async def test_each_panel_set_renders_from_live_data(live_metrics):
    """Every query evaluates on the two scrapes (rates over the scenario); the panel sets are drawn in Chromium
    for docs/console.md (not Grafana: the same queries, one bar per series, values at the end of the scenario)."""
    before, after, seconds = series(live_metrics[0]), series(live_metrics[1]), live_metrics[2]
    shown: dict[str, dict[str, float]] = {}
    for path in DASHBOARDS:
        board = dashboard(path)
        values = {}
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for macro, value in GRAFANA_MACROS.items():
                    expr = expr.replace(macro, value)
                values[(panel["id"], target["refId"])] = evaluate(expr, before, after, seconds)
        shown[path.stem] = {panel["title"]: {legend(t["legendFormat"], labels): value for t in panel["targets"]
                                             for labels, value in values[(panel["id"], t["refId"])].items()}
                            for panel in board["panels"]}
        note = (f"Drawn by tests/support/dashboard_render.py from {path.name} and two live /metrics scrapes "
                f"{seconds:.1f} s apart around tests/test_dashboards.py's scenario (rates over that window); "
                "Grafana draws the same queries as time series.")
        async with chromium_page(viewport=(1600, 1000)) as browser_page:
            await browser_page.set_content(page(board, values, note))
            await screenshot(browser_page, f"dashboard-{path.stem.removeprefix('toolproxy-')}", doc=True)
    sre, security = shown["toolproxy-sre"], shown["toolproxy-security"]
    assert {"succeeded", "failed", "unknown"} <= set(sre["Calls per second by outcome"])
    assert {"resolve", "decode", "authorize", "execute", "commit"} <= set(sre["Stage latency p95 by stage"])
    assert sre["Takeovers raised (1 h) by tool"] == {"adjust_counter": 1.0}
    assert sre["Open unknowns"] == {"open": 1.0} and sre["Dependencies up (OPA, Redis)"] == {"opa": 1.0, "redis": 1.0}
    assert security["Denials (1 h) by reason"] == {"resource_not_owned": 1.0}
    assert {"created": 3.0, "approved": 1.0, "denied": 1.0, "consumed": 1.0}.items() <= \
        security["Approvals (1 h) by state"].items()
    assert security["Approvals pending"] == {"pending": 1.0}
