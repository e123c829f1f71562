"""The operator console in a real headless Chromium, against real processes.

The dev-stack tests run ``toolproxy dev`` (real OPA, Redis, demo backend and
proxy processes) and sign in with the token its banner prints; the JWT tests
run ``toolproxy run`` with real signed tokens for agents and admins. Every
click goes through the page's own script and the admin JSON API.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping

import aiohttp
import pytest

from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from tests.support.audit import audit_records, fingerprinted
from tests.support.browser import REPO, chromium_page, needs_chromium, screenshot
from tests.support.devproc import DevStack
from tests.support.proxyproc import ProxyProcess
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until

pytestmark = needs_chromium

REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "duplicate charge"}  # over acme's 50.00 threshold


@pytest.fixture(scope="module")
def dev():
    stack = DevStack().start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def agent_call(http: aiohttp.ClientSession, base: str, tool: str, arguments: Any,
                     headers: Mapping[str, str] | None = None, call_id: str = "c1") -> tuple[int, dict[str, Any]]:
    async with http.post(base + "/v1/tool-calls", json={"call_id": call_id, "tool": tool, "arguments": arguments},
                         headers=dict(headers or {})) as response:
        return response.status, await response.json()


async def admin_get(http: aiohttp.ClientSession, base: str, path: str, token: str) -> tuple[int, dict[str, Any]]:
    async with http.get(base + path, headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, await response.json()


async def effects(http: aiohttp.ClientSession, dev: DevStack) -> dict[str, int]:
    async with http.get(dev.backend_url + "/_control/state") as response:
        return (await response.json())["effects_by_tool"]


async def sign_in(page: Any, url: str, token: str) -> None:
    await page.goto(url)
    await page.fill("#token", token)
    await page.click("#sign-in-button")


async def signed_in(page: Any, url: str, token: str) -> None:
    await sign_in(page, url, token)
    await page.locator("#who").wait_for(state="visible", timeout=10000)
    await page.locator("body[data-loaded]").wait_for(state="attached", timeout=10000)


async def refreshed(page: Any, *, keep_focus: bool = False) -> None:
    """Click Refresh and wait until the panels were re-read from the admin API.

    With ``keep_focus`` the click is dispatched to the button without moving the focus, as the
    console's own timer refreshes while someone is typing."""
    # (wait_for_function would evaluate a string in the page, which the console's CSP rightly forbids)
    before = await page.get_attribute("body", "data-loaded")
    if keep_focus:
        await page.dispatch_event("#refresh", "click")
    else:
        await page.click("#refresh")

    async def reloaded() -> bool:
        return await page.get_attribute("body", "data-loaded") != before
    await wait_until(reloaded, timeout=10, what="the console to re-read its panels")


async def test_a_refund_over_the_threshold_is_approved_by_clicking_and_the_resent_call_runs_once(dev, http):
    key = {"Idempotency-Key": "console-refund-1"}
    status, envelope = await agent_call(http, dev.agent_url, "refund_order", REFUND, key)
    assert (status, envelope["error"]["code"]) == (403, "approval_required")
    approval_id = envelope["error"]["details"]["approval_id"]
    before = await effects(http, dev)

    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        assert "dev-approver" in await page.inner_text("#who-text")
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        await row.wait_for()
        text = await row.inner_text()
        for shown in ("dev-user", "tenant acme", "refund_order 1.0.0", "financial", "amount_over_threshold",
                      '"amount": 6000', '"reason": "[redacted hmac-sha256:', "order:ord_1001",
                      "key console-refund-1", "(Idempotency-Key)", envelope["request_id"]):
            assert shown in text, shown
        arguments = await row.locator('td[data-label="arguments (masked)"] pre').inner_text()
        assert "duplicate charge" not in arguments  # a sensitive field stays masked in the arguments
        money = await row.locator(".money").inner_text()  # the contract's approval_view: cents of USD
        assert "USD" in money and "60.00" in money and "6000 cents" in money, money
        await row.locator("td.related dl").wait_for()  # the order, read as the approver
        await screenshot(page, "console-pending-approval", doc=True, locator=row)

        await row.locator("input.reason").fill("customer called, duplicate charge confirmed")
        await row.locator("button.approve").click()
        await page.locator("#status.ok").wait_for()
        assert approval_id in await page.inner_text("#status")
        decided = page.locator(f'#decided tr[data-approval-id="{approval_id}"]')
        await decided.wait_for()
        decided_text = await decided.inner_text()
        assert "approved" in decided_text and "dev-approver" in decided_text
        assert "customer called, duplicate charge confirmed" in decided_text
        assert await row.count() == 0
        await screenshot(page, "console-decided-approval")

    status, envelope = await agent_call(http, dev.agent_url, "refund_order", REFUND,
                                        {**key, "X-Approval-Id": approval_id}, call_id="c2")
    assert (status, envelope["outcome"]) == (200, "succeeded"), envelope
    status, again = await agent_call(http, dev.agent_url, "refund_order", REFUND,
                                     {**key, "X-Approval-Id": approval_id}, call_id="c3")
    assert (status, again["replayed"]) == (200, True)
    after = await effects(http, dev)
    assert after.get("refund_order", 0) - before.get("refund_order", 0) == 1


async def test_the_order_a_refund_applies_to_and_the_agents_reason_are_shown_beside_it(dev, http):
    refunded = {"order_id": "ord_1003", "amount": 6000, "reason": "customer says the charge came twice"}
    status, envelope = await agent_call(http, dev.agent_url, "refund_order", refunded,
                                        {"Idempotency-Key": "console-refunded-order"}, call_id="refund-call-9")
    assert (status, envelope["error"]["code"]) == (403, "approval_required")
    assert refunded["reason"] not in json.dumps(envelope)  # the model's answer keeps it masked
    approval_id = envelope["error"]["details"]["approval_id"]
    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        read = row.locator("td.related")
        await read.locator("dl").wait_for()
        names = await read.locator("dt").all_inner_texts()
        order = dict(zip(names, await read.locator("dd").all_inner_texts()))
        assert (order["order_id"], order["status"], order["refundable"]) == ("ord_1003", "refunded", "0")
        assert "get_order 1.0.0" in await read.inner_text() and "as dev-approver" in await read.inner_text()
        shown = await row.locator(".revealed").inner_text()  # the contract's approver_may_read
        assert "Shown to approvers only" in shown and "reason: customer says the charge came twice" in shown
        text = await row.inner_text()
        assert "key console-refunded-order" in text and "call refund-call-9" in text
        assert envelope["idempotency_key"][:15] in text  # the operation key, shortened beside the agent's
        await screenshot(page, "console-related-read", doc=True, locator=row)
        await row.locator("input.reason").fill("order ord_1003 is already refunded")
        await row.locator("button.deny").click()
        await page.locator(f'#decided tr[data-approval-id="{approval_id}"]').wait_for()

    log = dev.log(limit=1_000_000)
    assert refunded["reason"] not in log  # no audit record, decision record or log line holds it
    records = [r for r in audit_records(log) if r.get("approval_id") == approval_id or
               (r["kind"] == "tool_call" and r.get("request_id") == envelope["request_id"])]
    assert records and all("reason" not in r.get("arguments", {}) or fingerprinted(r["arguments"]["reason"])
                           for r in records)
    reads = [r for r in audit_records(log) if r["kind"] == "tool_call" and r.get("agent") == "toolproxy-console"]
    assert reads and all((r["tool"], r["subject"]) == ("get_order", "dev-approver") for r in reads)


async def test_a_refresh_while_typing_keeps_the_text_and_the_focus(dev, http):
    arguments = {**REFUND, "order_id": "ord_1001", "amount": 6100}
    _, envelope = await agent_call(http, dev.agent_url, "refund_order", arguments, {"Idempotency-Key": "console-typing"})
    approval_id = envelope["error"]["details"]["approval_id"]
    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        field = row.locator("input.reason")
        await field.fill("checked the ticket")
        await field.press("Tab")  # to Approve, as an approver does
        assert await page.evaluate("document.activeElement.className") == "approve"
        await page.evaluate("document.activeElement.dataset.marker = 'same-node'")
        for _ in range(2):
            await refreshed(page, keep_focus=True)
        assert await field.input_value() == "checked the ticket"
        focused = await page.evaluate("[document.activeElement.className, document.activeElement.dataset.marker,"
                                      " document.activeElement.getAttribute('aria-label')]")
        assert focused == ["approve", "same-node", f"Approve refund_order {approval_id}"]
        label = await page.locator(f'label[for="reason-{approval_id}"]').inner_text()
        assert approval_id in label
        # a row nobody is working in is rebuilt (its times move on); this one kept its node
        await row.locator("button.deny").click()
        await page.locator(f'#decided tr[data-approval-id="{approval_id}"]').wait_for()


async def test_a_deny_with_a_reason_is_recorded_and_the_agent_cannot_use_it(dev, http):
    arguments = {**REFUND, "order_id": "ord_1002", "amount": 7000}
    _, envelope = await agent_call(http, dev.agent_url, "refund_order", arguments, {"Idempotency-Key": "console-deny"})
    approval_id = envelope["error"]["details"]["approval_id"]
    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        await row.locator("input.reason").fill("amount does not match the ticket")
        await row.locator("button.deny").click()
        decided = page.locator(f'#decided tr[data-approval-id="{approval_id}"]')
        await decided.wait_for()
        assert "denied" in await decided.inner_text()

    status, view = await admin_get(http, dev.admin_url, f"/v1/approvals/{approval_id}", dev.token)
    assert (status, view["status"], view["approver"]) == (200, "denied", "dev-approver")
    assert view["decision_reason"] == "amount does not match the ticket"
    denied = [r for r in audit_records(dev.log(limit=1_000_000))
              if r["kind"] == "approval" and r.get("approval_id") == approval_id and r["details"]["state"] == "denied"]
    assert denied and denied[0]["details"]["reason"] == "amount does not match the ticket"
    _, refused = await agent_call(http, dev.agent_url, "refund_order", arguments,
                                  {"Idempotency-Key": "console-deny", "X-Approval-Id": approval_id})
    assert (refused["error"]["code"], refused["error"]["details"]["reason"]) == ("approval_mismatch", "denied")


XSS_SUBJECT = "<script>alert('subject')</script>"
XSS_TO = '"><img/src=x/onerror=alert(1)>@evil.test'


async def test_attacker_controlled_arguments_are_shown_as_text_and_run_nothing(dev, http):
    # This dev stack's OPA: external tools need an approval too, so send_email's arguments reach the console.
    settings = "/v1/data/toolproxy/settings/approval/always_for_risks"
    assert await dev.put_opa(settings, ["destructive", "external"]) == 204
    try:
        _, envelope = await agent_call(http, dev.agent_url, "send_email",
                                       {"to": XSS_TO, "subject": XSS_SUBJECT, "body": "hello"},
                                       {"Idempotency-Key": "console-xss"})
    finally:
        assert await dev.put_opa(settings, ["destructive"]) == 204
    assert envelope["error"]["code"] == "approval_required", envelope
    approval_id = envelope["error"]["details"]["approval_id"]

    async with chromium_page() as page:
        dialogs: list[str] = []
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        response = await page.goto(dev.console_url)
        headers = response.headers
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert "unsafe-inline" not in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY"
        await signed_in(page, dev.console_url, dev.token)
        cell = page.locator(f'#approvals tr[data-approval-id="{approval_id}"] pre')
        shown = json.loads(await cell.inner_text())
        assert {k: shown[k] for k in ("to", "subject")} == {"to": XSS_TO, "subject": XSS_SUBJECT}
        assert shown["body"].startswith("[redacted hmac-sha256:")
        assert await page.locator("#approvals img").count() == 0
        assert await page.locator("#approvals script").count() == 0
        assert await page.evaluate("document.querySelectorAll('img').length") == 0
        await screenshot(page, "console-xss-as-text")
        await refreshed(page)  # a second render, still inert
        assert dialogs == []


async def test_a_takeover_from_the_fault_switches_is_resolved_from_the_page(dev, http):
    async with http.post(dev.backend_url + "/_control/faults",
                         json={"tool": "adjust_counter", "mode": "drop_after_commit", "count": 1}) as response:
        assert response.status == 200
    arguments = {"counter": "ctr_console", "delta": 3}  # adjust_counter has no status endpoint
    _, envelope = await agent_call(http, dev.agent_url, "adjust_counter", arguments, {"Idempotency-Key": "console-tk"})
    assert envelope["error"]["code"] == "timeout_unknown", envelope
    key = envelope["idempotency_key"]

    async def handed_over() -> bool:
        _, listing = await admin_get(http, dev.admin_url, "/v1/takeovers", dev.token)
        return any(t["idempotency_key"] == key for t in listing["takeovers"])
    await wait_until(handed_over, timeout=20, what="the dev stack's reconciler to raise the takeover")

    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#takeovers tr[data-key="{key}"]')
        text = await row.inner_text()
        for shown in ("adjust_counter 1.0.0", "no_status_endpoint", "timeout_unknown", '"counter": "ctr_console"'):
            assert shown in text, shown
        await screenshot(page, "console-takeover", doc=True, locator=row)
        await row.locator("select.outcome").select_option("committed")
        await row.locator("textarea.evidence").fill("counter ledger shows +3 at 20:15")
        await row.locator("textarea.result").fill('{"counter": "ctr_console", "value": 3}')
        await row.locator("button.resolve").click()
        await page.locator("#status.ok").wait_for()
        await row.wait_for(state="detached")

    status, view = await admin_get(http, dev.admin_url, f"/v1/operations/{key}", dev.token)
    assert (status, view["state"]) == (200, "SUCCEEDED"), view
    _, replay = await agent_call(http, dev.agent_url, "adjust_counter", arguments, {"Idempotency-Key": "console-tk"})
    assert (replay["outcome"], replay["replayed"], replay["data"]) == ("succeeded", True,
                                                                      {"counter": "ctr_console", "value": 3})


async def test_a_frozen_resource_is_listed_and_resolving_it_from_the_page_lifts_the_freeze(dev, http):
    async with http.post(dev.backend_url + "/_control/faults",
                         json={"tool": "adjust_counter", "mode": "drop_after_commit", "count": 1}) as response:
        assert response.status == 200
    arguments = {"counter": "ctr_console_frozen", "delta": 2}
    _, envelope = await agent_call(http, dev.agent_url, "adjust_counter", arguments, {"Idempotency-Key": "console-fz"})
    assert envelope["error"]["code"] == "timeout_unknown", envelope
    key = envelope["idempotency_key"]

    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#freezes tr[data-key="{key}"]')
        text = await row.inner_text()
        for shown in ("counter:ctr_console_frozen", "acme", "adjust_counter", key):
            assert shown in text, shown
        assert "frozen" in await page.locator("#freezes-hint").inner_text()
        await row.locator("select.outcome").select_option("committed")
        await row.locator("textarea.evidence").fill("counter ledger shows +2")
        await row.locator("button.resolve").click()
        await page.locator("#status.ok").wait_for()
        await row.wait_for(state="detached")

    _, after = await agent_call(http, dev.agent_url, "adjust_counter", {**arguments, "delta": 1},
                                {"Idempotency-Key": "console-fz-2"})
    assert after["outcome"] == "succeeded", after


async def test_recent_denials_are_shown_by_tool_and_reason(dev, http):
    for order in ("ord_2001", "ord_2001", "ord_9999"):  # globex's order, twice; an order nobody owns
        _, envelope = await agent_call(http, dev.agent_url, "get_order", {"order_id": order})
        assert envelope["error"]["code"] == "forbidden"
        assert "resource_not_owned" not in json.dumps(envelope)  # the model never sees the reasons
    _, denials = await admin_get(http, dev.admin_url, "/v1/denials", dev.token)
    [group] = [g for g in denials["by_tool_and_reason"] if g["tool"] == "get_order"]
    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator("#denials tbody tr", has_text="get_order")
        text = await row.inner_text()
        assert group["reason"] in text and str(group["count"]) in text
        assert all(example in text for example in group["examples"])
        kept = await page.inner_text("#denials-kept")
        assert f"Counted over {denials['counted']} denial" in kept and "latest 500" not in kept
        recent = denials["recent"][0]
        latest = page.locator("#denials-recent tbody tr").first
        latest_text = await latest.inner_text()
        assert recent["subject"] in latest_text and recent["request_id"] in latest_text
        widths = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], widths  # nothing, however long, scrolls the page sideways
        await screenshot(page, "console-overview", doc=True, full_page=False)
    assert group["count"] >= 3


async def test_at_390_px_rows_are_cards_without_horizontal_scroll(dev, http):
    arguments = {**REFUND, "order_id": "ord_1001", "amount": 6200}
    _, envelope = await agent_call(http, dev.agent_url, "refund_order", arguments, {"Idempotency-Key": "console-phone"})
    approval_id = envelope["error"]["details"]["approval_id"]
    async with chromium_page(viewport=(390, 844)) as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        await row.wait_for()
        widths = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], widths
        box = await row.locator("button.approve").bounding_box()
        assert box is not None and box["x"] + box["width"] <= 390, box
        assert await row.locator('td[data-label="tool"]').count() == 1  # each cell names its column
        await screenshot(page, "console-phone", doc=True, locator=row)


AXE = REPO / ".tools" / "node" / "node_modules" / "axe-core" / "axe.min.js"


async def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core (pinned in tests/node/package-lock.json) run inside the page; serious and critical only."""
    await page.evaluate(AXE.read_text(encoding="utf-8"))  # through the driver: the page's CSP still holds
    found = await page.evaluate("axe.run(document, {resultTypes: ['violations']}).then((r) => r.violations.map("
                                "(v) => ({id: v.id, impact: v.impact, help: v.help,"
                                " nodes: v.nodes.slice(0, 3).map((n) => n.target.join(' '))})))")
    return [v for v in found if v["impact"] in {"serious", "critical"}]


@pytest.mark.skipif(not AXE.is_file(), reason="needs axe-core in .tools/node (scripts/setup.sh)")
async def test_axe_core_finds_no_serious_or_critical_violations(dev, http):
    arguments = {**REFUND, "order_id": "ord_1001", "amount": 6300}
    await agent_call(http, dev.agent_url, "refund_order", arguments, {"Idempotency-Key": "console-axe"})
    for viewport in ((1400, 900), (390, 844)):
        async with chromium_page(viewport=viewport) as page:
            await page.goto(dev.console_url)
            assert await axe_violations(page) == [], "sign-in page"
            await signed_in(page, dev.console_url, dev.token)
            assert await axe_violations(page) == [], viewport


async def test_the_dev_banner_prints_the_console_url_and_a_token_that_signs_in(dev, http):
    assert dev.console_url == f"{dev.admin_url}/ui"
    status, me = await admin_get(http, dev.admin_url, "/v1/whoami", dev.token)
    assert (status, me["roles"]) == (200, ["approver", "operator"])
    async with http.get(dev.agent_url + "/ui") as response:
        assert response.status == 404  # nothing of the console on the agent listener
    for icon in ("/favicon.ico", "/ui/favicon.svg"):  # no 404 in the browser's console
        async with http.get(dev.admin_url + icon) as response:
            assert (response.status, response.content_type) == (200, "image/svg+xml"), icon


# -- real JWTs: agents, approvers, operators ----------------------------------------------------------

@pytest.fixture
async def jwt_proxy(proxy_deps, issuers):
    runner, backend_url, _ = await start_demo_backend(keys=session_keys().jwks)
    agent, admin = issuers
    flat = {f"{section}.{name}": value for section, value in jwt_overrides(agent, admin).items()
            for name, value in (value.items() if isinstance(value, dict) else [("", value)])}
    settings = {**proxy_deps, **{k.rstrip("."): v for k, v in flat.items()},
                "backends.services": {"demo": backend_url}, "registry.paths": ["examples/registry"]}
    proc = ProxyProcess(settings).start()
    try:
        await proc.ready()
        yield proc
    finally:
        proc.stop()
        await runner.cleanup()


async def test_an_agent_token_cannot_open_the_console(jwt_proxy, issuers, http):
    agent, admin = issuers
    console = f"http://127.0.0.1:{jwt_proxy.admin_port}/ui"
    refused = {"agent": agent.token("alice"),
               "admin audience, no console role": admin.token("mallory", audience="toolproxy-admin",
                                                               roles=["viewer"], scope="")}
    async with chromium_page() as page:
        for what, token in refused.items():
            await sign_in(page, console, token)
            await page.locator("#status.error").wait_for()
            assert "cannot open the console" in await page.inner_text("#status"), what
            assert await page.locator("#panels").is_hidden(), what
            assert await page.locator("#approvals tbody tr").count() == 0, what
            assert await page.evaluate("sessionStorage.length") == 0, what  # the refused token is not kept
            assert token not in page.url
        await screenshot(page, "console-agent-token-refused")
    async with http.get(f"http://127.0.0.1:{jwt_proxy.port}/ui") as response:
        assert response.status == 404


async def test_a_failed_fetch_keeps_the_session_and_retries_while_a_401_signs_out(jwt_proxy, issuers):
    _, admin = issuers
    console = f"http://127.0.0.1:{jwt_proxy.admin_port}/ui"
    operator = admin.token("olivia", audience="toolproxy-admin", roles=["approver", "operator"], scope="")
    async with chromium_page() as page:
        await signed_in(page, console, operator)
        await page.route("**/v1/locks", lambda route: route.abort())  # the network drops one request
        await page.dispatch_event("#refresh", "click")
        notice = page.locator("#connection")
        await notice.wait_for(state="visible", timeout=10000)
        assert "Connection lost, retrying" in await notice.inner_text()
        assert await page.locator("#who").is_visible() and await page.locator("#panels").is_visible()
        assert await page.evaluate("sessionStorage.length") == 1  # the session is kept
        await screenshot(page, "console-connection-lost", doc=True, full_page=False)
        await page.unroute("**/v1/locks")
        await notice.wait_for(state="hidden", timeout=15000)  # the retry (after 2 s) succeeds
        assert await page.locator("#updated").inner_text() != ""

        # A token the API refuses (401) ends the session.
        await page.evaluate("sessionStorage.setItem('toolproxy-admin-token', 'not-a-token')")
        await page.dispatch_event("#refresh", "click")
        await page.locator("#sign-in").wait_for(state="visible", timeout=10000)
        assert "Signed out" in await page.inner_text("#status")
        assert await page.evaluate("sessionStorage.length") == 0


async def test_an_expired_token_is_named_and_a_pasted_bearer_prefix_is_stripped(jwt_proxy, issuers):
    _, admin = issuers
    console = f"http://127.0.0.1:{jwt_proxy.admin_port}/ui"
    expired = admin.token("olivia", audience="toolproxy-admin", roles=["approver"], scope="", ttl_s=-600)
    async with chromium_page() as page:
        await sign_in(page, console, expired)
        await page.locator("#status.error").wait_for()
        assert "expired" in await page.inner_text("#status")
        assert await page.evaluate("sessionStorage.length") == 0
        await screenshot(page, "console-token-expired", doc=True)

        soon = admin.token("olivia", audience="toolproxy-admin", roles=["approver"], scope="", ttl_s=120)
        await signed_in(page, console, "Bearer " + soon)
        assert "olivia" in await page.inner_text("#who-text")
        warning = page.locator("#expiry")
        assert await warning.is_visible()
        assert "expires at" in await warning.inner_text()


async def test_three_hundred_pending_approvals_are_counted_filtered_searched_and_paged(jwt_proxy, issuers, http):
    agent, admin = issuers
    # Five acme clerks: a subject may have approvals.max_pending_per_subject (50) waiting.
    tokens = {"globex": agent.token("bob", tenant="globex"), **{f"acme{c}": agent.token(f"clerk-{c}")
                                                               for c in range(5)}}
    gate = asyncio.Semaphore(6)

    async def ask(n: int, tenant: str) -> str:
        order = "ord_1001" if tenant == "acme" else "ord_2001"
        token = tokens["globex"] if tenant == "globex" else tokens[f"acme{n % 5}"]
        for _ in range(5):  # on a loaded machine OPA may answer late (policy_unavailable): the same call again
            async with gate:
                _, envelope = await agent_call(http, jwt_proxy.url, "refund_order",
                                               {**REFUND, "order_id": order, "amount": 6000 + n},
                                               {"Idempotency-Key": f"queue-{n}",
                                                "Authorization": f"Bearer {token}"}, call_id=f"q{n}")
            if envelope["error"]["code"] != "policy_unavailable":
                break
        assert envelope["error"]["code"] == "approval_required", envelope
        return envelope["error"]["details"]["approval_id"]
    # the first 50 (globex) are the oldest, so they are among the 200 the API lists
    globex = await asyncio.gather(*(ask(n, "globex") for n in range(50)))
    await asyncio.gather(*(ask(n, "acme") for n in range(50, 300)))

    approver = admin.token("olivia", audience="toolproxy-admin", roles=["approver", "cross-tenant"], scope="",
                           tenant=None,
                           ttl_s=3600)
    admin_url = f"http://127.0.0.1:{jwt_proxy.admin_port}"
    status, listing = await admin_get(http, admin_url, "/v1/approvals", approver)
    assert status == 200, listing
    assert (len(listing["approvals"]), listing["limit"], listing["total"]) == (200, 200, 300)
    async with chromium_page() as page:
        await signed_in(page, admin_url + "/ui", approver)
        assert await page.inner_text("#approvals-count") == "(300)"
        assert (await page.title()).startswith("(300) ")
        paging = await page.inner_text("#approvals-paging")
        assert "1–25 of 200" in paging and "200 of 300 pending" in paging, paging
        assert await page.locator("#approvals tbody tr").count() == 25
        await page.click("#page-next")
        assert "26–50 of 200" in await page.inner_text("#approvals-paging")

        await page.select_option("#filter-tenant", "globex")
        paging = await page.inner_text("#approvals-paging")
        assert "1–25 of 50 matching" in paging, paging
        assert await page.locator("#approvals tbody tr", has_text="tenant acme").count() == 0
        await page.select_option("#filter-tenant", "")
        await page.select_option("#filter-tool", "refund_order")
        await page.select_option("#filter-risk", "financial")
        assert "1–25 of 200" in await page.inner_text("#approvals-paging")

        await page.fill("#filter-search", globex[7])
        assert "1–1 of 1 matching" in await page.inner_text("#approvals-paging")
        assert await page.locator(f'#approvals tr[data-approval-id="{globex[7]}"]').count() == 1
        await screenshot(page, "console-queue", doc=True, full_page=False)


async def test_an_approver_cannot_approve_their_own_request_from_the_page(jwt_proxy, issuers, http):
    agent, admin = issuers
    _, envelope = await agent_call(http, jwt_proxy.url, "refund_order", REFUND,
                                   {"Idempotency-Key": "self", "Authorization": f"Bearer {agent.token('alice')}"})
    approval_id = envelope["error"]["details"]["approval_id"]
    alice_approver = admin.token("alice", audience="toolproxy-admin", roles=["approver"], scope="")
    async with chromium_page() as page:
        await signed_in(page, f"http://127.0.0.1:{jwt_proxy.admin_port}/ui", alice_approver)
        assert await page.locator("#panel-takeovers").is_hidden()  # an approver only: no operator panels
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        await row.locator("button.approve").click()  # no reason: the console asks first
        assert "No reason given" in await page.inner_text("#status")
        assert await row.locator("button.approve").inner_text() == "Approve without a reason?"
        await row.locator("button.approve").click()
        await page.locator("#status.error", has_text="cannot decide").wait_for()
        assert "cannot decide on their own request" in await page.inner_text("#status")
        await row.wait_for()  # still pending
    status, view = await admin_get(http, f"http://127.0.0.1:{jwt_proxy.admin_port}", f"/v1/approvals/{approval_id}",
                                   alice_approver)
    assert (status, view["status"], view["approver"]) == (200, "pending", None)


async def test_a_related_read_the_policy_denies_shows_as_not_permitted(jwt_proxy, issuers, http):
    agent, admin = issuers
    _, envelope = await agent_call(http, jwt_proxy.url, "refund_order", REFUND,
                                   {"Idempotency-Key": "no-read", "Authorization": f"Bearer {agent.token('alice')}"})
    approval_id = envelope["error"]["details"]["approval_id"]
    # an approver whose token carries no read scope: OPA denies the read (scope_insufficient)
    approver = admin.token("olivia", audience="toolproxy-admin", roles=["approver"], scope="")
    async with chromium_page() as page:
        await signed_in(page, f"http://127.0.0.1:{jwt_proxy.admin_port}/ui", approver)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        denied = row.locator("td.related .not-permitted")
        await denied.wait_for()
        assert "Not permitted" in await denied.inner_text()
        assert await row.locator("td.related dl").count() == 0
        assert await page.locator("#connection").is_hidden()  # the page carries on: no lost connection, no sign-out
        await refreshed(page)
        assert await row.locator("button.approve").is_enabled()
        await screenshot(page, "console-related-read-denied", locator=row)


async def test_a_held_lock_is_shown_with_its_holder_and_lease(dev, http):
    async with http.post(dev.backend_url + "/_control/faults",
                         json={"tool": "adjust_counter", "mode": "slow", "delay_ms": 4000, "count": 1}) as response:
        assert response.status == 200
    arguments = {"counter": "ctr_console_lock", "delta": 1}
    # Signed in before the write starts: the lock lives only until the tool's 3 s timeout, and a browser
    # starting on a loaded machine can take longer than that.
    async with chromium_page() as page:
        await signed_in(page, dev.console_url, dev.token)
        slow = asyncio.ensure_future(agent_call(http, dev.agent_url, "adjust_counter", arguments,
                                                {"Idempotency-Key": "console-lock"}))
        try:
            async def held() -> bool:
                _, listing = await admin_get(http, dev.admin_url, "/v1/locks", dev.token)
                return any("ctr_console_lock" in lock["resource"] for lock in listing["locks"])
            await wait_until(held, timeout=10, what="the slow write to hold its lock")
            await refreshed(page)
            row = page.locator("#locks tbody tr", has_text="ctr_console_lock")
            text = await row.inner_text()
            for shown in ("exclusive", "adjust_counter", "acme"):
                assert shown in text, shown
            assert "lease" in await page.locator("#locks-hint").inner_text()
        finally:
            status, envelope = await slow
    # 4 s is past the tool's own timeout, so the write ends unknown; either way its lock is released.
    assert envelope["outcome"] in {"succeeded", "unknown"}, (status, envelope)
    _, listing = await admin_get(http, dev.admin_url, "/v1/locks", dev.token)
    assert not any("ctr_console_lock" in lock["resource"] for lock in listing["locks"])


NUMBER_ON_ONE_LINE = """([root, text]) => {
  // every occurrence of text inside root, each laid out on one line box (never split across lines)
  const found = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    let at = node.data.indexOf(text);
    while (at >= 0) {
      const range = document.createRange();
      range.setStart(node, at);
      range.setEnd(node, at + text.length);
      const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
      found.push([tops.size, node.parentElement.tagName + "." + node.parentElement.className]);
      at = node.data.indexOf(text, at + 1);
    }
  }
  return found;
}"""


@pytest.mark.parametrize("viewport", [(1400, 900), (390, 844)], ids=["1400px", "390px"])
async def test_amounts_and_ids_never_wrap_inside_a_number(dev, http, viewport):
    arguments = {**REFUND, "order_id": "ord_1001", "amount": 60000}
    _, envelope = await agent_call(http, dev.agent_url, "refund_order", arguments,
                                   {"Idempotency-Key": f"console-wrap-{viewport[0]}"})
    approval_id = envelope["error"]["details"]["approval_id"]
    async with chromium_page(viewport=viewport) as page:
        await signed_in(page, dev.console_url, dev.token)
        row = page.locator(f'#approvals tr[data-approval-id="{approval_id}"]')
        await row.wait_for()
        await row.locator("td.related dl").wait_for()
        handle = await row.element_handle()
        for text in ("60000", "600.00", approval_id, envelope["request_id"]):
            lines = await page.evaluate(NUMBER_ON_ONE_LINE, [handle, text])
            assert lines and all(n == 1 for n, _ in lines), (text, lines)
        widths = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], widths
        await screenshot(page, f"console-amounts-{viewport[0]}px", locator=row)
