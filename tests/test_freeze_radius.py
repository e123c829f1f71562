"""A freeze's blast radius is visible and bounded, with real OPA, Redis and the demo backend.

An unknown outcome freezes the resources of its write (no other write runs there until the operation
settles). Operators see it: ``toolproxy_frozen_resources``, ``toolproxy_oldest_freeze_age_seconds``,
``toolproxy_frozen_refusals_total{tool}`` (no tenant, subject or resource label), ``GET /v1/freezes`` and the
console's panel; one command lifts it (``toolproxy resolve``, the operator resolution path). A production
registry refuses a write that declares no resources (it would freeze its whole service) unless the
contract states why (``service_wide_reason``).
"""

from __future__ import annotations

import asyncio

from proxy.cli import main as cli_main
from tests.support.metrics import samples, scrape_text
from tests.support.stack import DEMO_REGISTRY, UNLOCKED_COUNTER, running_stack
from tests.support.tokens import jwt_overrides

FROZEN = ("toolproxy_frozen_resources", frozenset())
OLDEST = ("toolproxy_oldest_freeze_age_seconds", frozenset())
REFUSED = ("toolproxy_frozen_refusals_total", frozenset({("tool", "adjust_counter")}))


async def test_a_deliberate_unknown_freezes_is_counted_listed_and_lifted_by_one_command(proxy_deps, issuers,
                                                                                      monkeypatch):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False}) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        operator = admin.token("olga", audience="toolproxy-admin", roles=["operator"], scope="")
        before = samples(await scrape_text(stack))
        assert before[FROZEN] == 0 and before[OLDEST] == 0
        refused_before = before.get(REFUSED, 0.0)

        await stack.fault("adjust_counter", "drop_after_commit", count=1)  # applied, the answer lost
        _, unknown = await stack.call("adjust_counter", {"counter": "ctr_radius", "delta": 5})
        assert unknown["error"]["code"] == "timeout_unknown"
        blocking = unknown["idempotency_key"]
        for delta in (1, 2, 3):
            status, frozen = await stack.call("adjust_counter", {"counter": "ctr_radius", "delta": delta})
            assert status == 409 and frozen["error"]["code"] == "operation_unknown"
            assert frozen["error"]["details"]["blocking_operation"] == blocking
        _, elsewhere = await stack.call("adjust_counter", {"counter": "ctr_elsewhere", "delta": 1})
        assert elsewhere["outcome"] == "succeeded"  # bounded: only the write's own resource is frozen

        during = samples(await scrape_text(stack))
        assert during[FROZEN] == 1
        assert during[REFUSED] - refused_before == 3
        assert during[OLDEST] >= 0
        for name, labels in during:  # the freeze series carry no tenant, subject or resource
            if "freeze" in name or "frozen" in name:
                assert {key for key, _ in labels} <= {"tool"}, (name, labels)

        status, listing = await stack.admin("GET", "/v1/freezes", operator)
        assert status == 200 and listing["frozen_resources"] == 1 and not listing["truncated"]
        [mark] = listing["freezes"]
        assert mark["resource"] == "counter:ctr_radius" and mark["operation"] == blocking
        assert mark["state"] == "UNKNOWN" and mark["tool"] == "adjust_counter" and mark["tenant"] == "acme"
        assert mark["resolve"] == f"/v1/operations/{blocking}/resolve"
        status, _ = await stack.admin("GET", "/v1/freezes", agent.token("alice"))
        assert status in (401, 403)  # the agent's token is no operator's

        monkeypatch.setenv("TOOLPROXY_ADMIN_TOKEN", operator)
        code = await asyncio.to_thread(cli_main, ["resolve", blocking, "--outcome", "committed", "--evidence",
                                                  "the counter shows 5", "--admin-url", stack.admin_url])
        assert code == 0
        _, record = await stack.get(f"/v1/operations/{blocking}")
        assert record["state"] == "SUCCEEDED"

        after = samples(await scrape_text(stack))
        assert after[FROZEN] == 0 and after[OLDEST] == 0
        assert after[REFUSED] - refused_before == 3
        status, listing = await stack.admin("GET", "/v1/freezes", operator)
        assert status == 200 and listing["freezes"] == [] and listing["frozen_resources"] == 0
        _, lifted = await stack.call("adjust_counter", {"counter": "ctr_radius", "delta": 1})
        assert lifted["outcome"] == "succeeded" and stack.backend.counters["ctr_radius"] == 6

        code = await asyncio.to_thread(cli_main, ["resolve", blocking, "--outcome", "committed", "--evidence",
                                                  "again", "--admin-url", stack.admin_url])
        assert code == 1  # settled already: operation_not_open, nothing changes


async def test_a_write_without_resources_freezes_its_whole_service_and_the_gauge_says_so(proxy_deps, tmp_path):
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "wide.yaml").write_text(UNLOCKED_COUNTER)
    overrides = {**proxy_deps, "reconcile.enabled": False,
                 "registry.paths": [str(DEMO_REGISTRY), str(tmp_path / "more" / "wide.yaml")]}
    async with running_stack(overrides) as stack:
        await stack.fault("adjust_counter", "drop_after_commit", count=1)
        _, unknown = await stack.call("bump_counter", {"counter": "ctr_a", "delta": 1},
                                      headers={"Idempotency-Key": "wide-1"})
        assert unknown["error"]["code"] == "timeout_unknown"
        _, refused = await stack.call("adjust_counter", {"counter": "ctr_unrelated", "delta": 1},
                                      headers={"Idempotency-Key": "wide-2"})
        assert refused["error"]["code"] == "operation_unknown"
        assert refused["error"]["details"]["resource"] == "@service:demo"
        during = samples(await scrape_text(stack))
        assert during[FROZEN] == 1




def test_check_registry_refuses_a_write_without_resources_unless_it_says_why(tmp_path, capsys):
    path = tmp_path / "wide.yaml"
    path.write_text(UNLOCKED_COUNTER)
    assert cli_main(["check-registry", str(path)]) == 1
    captured = capsys.readouterr()
    assert "error: bump_counter 1.0.0" in captured.err and "service_wide_reason" in captured.err
    assert "freezes every write there" in captured.err

    assert cli_main(["check-registry", "--dev", str(path)]) == 0  # a development registry: a warning
    assert "warning: bump_counter 1.0.0" in capsys.readouterr().out

    path.write_text(UNLOCKED_COUNTER.replace("    backend:", '    service_wide_reason: "one global counter store"\n    backend:'))
    assert cli_main(["check-registry", str(path)]) == 0
    out = capsys.readouterr().out
    assert "opt-out: bump_counter 1.0.0" in out and "one global counter store" in out

    assert cli_main(["check-registry", str(DEMO_REGISTRY)]) == 0  # the demo registry declares its resources
