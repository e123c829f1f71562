"""The independent check after a write (``verify_read``), against the real demo backend lying about a commit.

A contract names a read tool and what its result must show after the write commits. The read runs under
the write's locks, right after the backend's answer; a difference is never a success: the call answers
``verification_mismatch`` (outcome unknown), the operation goes straight to a takeover whose evidence holds
the read's value beside the write's, its resource stays frozen, and an operator's resolution lifts it.
"""

from __future__ import annotations

import pytest

from proxy.registry import RegistryError, load_registry
from tests.support.stack import DEMO_REGISTRY, extra_tools, running_stack
from tests.support.tokens import jwt_overrides

COUNTER_IN = """
      type: object
      additionalProperties: false
      required: [counter, delta]
      properties:
        counter: {type: string, pattern: "^ctr_[A-Za-z0-9_]+$"}
        delta: {type: integer, minimum: -1000, maximum: 1000}"""
COUNTER_OUT = """
      type: object
      additionalProperties: false
      required: [counter, value]
      properties:
        counter: {type: string}
        value: {type: integer}"""

CHECKED = f"""
tools:
  - name: adjust_counter_checked
    version: "1.0.0"
    description: adjust_counter, its commit checked by reading the counter back.
    mode: write
    risk: write
    inputSchema:{COUNTER_IN}
    outputSchema:{COUNTER_OUT}
    resources: [{{template: "counter:{{counter}}"}}]
    idempotency: {{required: true}}
    verify_read:
      tool: get_counter
      version: "1.0.0"
      arguments: {{counter: /arguments/counter}}
      expect: {{/value: /result/value}}
    backend: {{type: http, service: demo, path: /tools/adjust_counter}}
"""


async def test_a_backend_that_lies_about_its_commit_is_caught_and_handed_to_an_operator(proxy_deps, issuers,
                                                                                      tmp_path):
    agent, admin = issuers
    overrides = {**proxy_deps, **jwt_overrides(agent, admin), **extra_tools(tmp_path, CHECKED),
                 "reconcile.enabled": False}
    async with running_stack(overrides) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        operator = admin.token("olga", audience="toolproxy-admin", roles=["operator"], scope="")
        metrics = stack.runtime.metrics.registry
        takeovers_before = metrics.get_sample_value("toolproxy_takeovers_total",
                                                    {"tool": "adjust_counter_checked"}) or 0.0

        _, honest = await stack.call("adjust_counter_checked", {"counter": "ctr_checked", "delta": 2})
        assert honest["outcome"] == "succeeded" and honest["data"]["value"] == 2, honest
        reads = [r for r in stack.backend.requests if r["tool"] == "get_counter"]
        assert len(reads) == 1  # the check ran once, after the commit

        await stack.fault("adjust_counter", "lie_about_commit", count=1)  # answers 5, stores nothing
        status, lied = await stack.call("adjust_counter_checked", {"counter": "ctr_checked", "delta": 3})
        assert status == 409 and lied["outcome"] == "unknown", lied
        assert lied["error"]["code"] == "verification_mismatch"
        assert lied["side_effect"]["committed"] is None and lied.get("data") is None
        assert "5" not in str(lied["error"]["details"])  # the values go to the record, not to the model
        assert stack.backend.counters["ctr_checked"] == 2
        key = lied["idempotency_key"]

        status, takeovers = await stack.admin("GET", "/v1/takeovers", operator)
        assert status == 200
        [taken] = [t for t in takeovers["takeovers"] if t["idempotency_key"] == key]
        evidence = taken["last_evidence"]
        assert evidence["observed"] == "verify_read_mismatch" and evidence["verify_read"] == "get_counter@1.0.0"
        assert evidence["differences"] == [{"read": "/value", "observed": 2, "write": "/result/value",
                                            "claimed": 5}]
        assert metrics.get_sample_value("toolproxy_takeovers_total",
                                        {"tool": "adjust_counter_checked"}) - takeovers_before == 1

        _, again = await stack.call("adjust_counter_checked", {"counter": "ctr_checked", "delta": 3},
                                    headers={"Idempotency-Key": "checked-again"})
        assert again["error"]["code"] == "operation_unknown"  # its resource is frozen meanwhile
        assert again["error"]["details"]["state"] == "NEEDS_TAKEOVER"

        async with stack.session.post(f"{stack.admin_url}/v1/operations/{key}/resolve",
                                      json={"outcome": "not_applied", "evidence": "the counter still reads 2"},
                                      headers={"Authorization": f"Bearer {operator}"}) as response:
            assert response.status == 200, await response.text()
        _, after = await stack.call("adjust_counter_checked", {"counter": "ctr_checked", "delta": 3},
                                    headers={"Idempotency-Key": "checked-after"})
        assert after["outcome"] == "succeeded" and stack.backend.counters["ctr_checked"] == 5


def test_a_verify_read_must_be_a_read_that_fits_both_contracts(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(CHECKED.replace("tool: get_counter\n", "tool: adjust_counter_checked\n"))
    with pytest.raises(RegistryError, match="verify_read"):
        load_registry([str(DEMO_REGISTRY), str(path)])
    path.write_text(CHECKED.replace("{counter: /arguments/counter}", "{counter: /arguments/nope}"))
    with pytest.raises(RegistryError, match="verify_read"):
        load_registry([str(DEMO_REGISTRY), str(path)])
    path.write_text(CHECKED)
    assert load_registry([str(DEMO_REGISTRY), str(path)]).get("adjust_counter_checked", "1.0.0").verify_read
