"""OPA outages fail closed and heal without a proxy restart; Rego edits apply live."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.support.servers import OpaServer, free_port
from tests.support.stack import REPO, running_stack

POLICIES = REPO / "policies"
DEMO_OPA_DATA = REPO / "examples" / "opa"
ORDER = {"order_id": "ord_1001"}


def errors(stack, reason: str) -> float:
    return stack.runtime.metrics.registry.get_sample_value("toolproxy_opa_errors_total", {"reason": reason}) or 0.0


async def test_opa_stopped_fails_closed_then_heals_without_restart(proxy_deps):
    with OpaServer([POLICIES, DEMO_OPA_DATA]) as opa:
        async with running_stack({**proxy_deps, **opa.settings, "opa.timeout_ms": 300}) as stack:
            assert (await stack.call("get_order", ORDER))[0] == 200
            opa.stop()
            started = time.monotonic()
            status, env = await stack.call("get_order", ORDER)
            assert time.monotonic() - started < 0.3 + 0.2
            assert status == 503 and env["error"]["code"] == "policy_unavailable"
            assert env["error"]["retryable"] is True
            assert env["side_effect"] == {"attempted": False, "committed": False}
            assert len(stack.backend.requests) == 1
            assert stack.runtime.metrics.registry.get_sample_value(
                "toolproxy_dependency_up", {"dependency": "opa"}) == 0
            opa.start()  # a new OPA process: the catalog the proxy pushed is gone and is pushed again
            status, env = await stack.call("get_order", ORDER)
            assert status == 200, env
            assert stack.runtime.metrics.registry.get_sample_value(
                "toolproxy_dependency_up", {"dependency": "opa"}) == 1


async def test_slow_opa_fails_closed_within_its_timeout(proxy_deps):
    connections: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_stack({**proxy_deps, "opa.url": f"http://127.0.0.1:{port}",
                                  "opa.timeout_ms": 200}) as stack:
            started = time.monotonic()
            status, env = await stack.call("refund_order", {**ORDER, "amount": 100, "reason": "dup"},
                                           headers={"Idempotency-Key": "slow-opa-1"})
            elapsed = time.monotonic() - started
            assert env["error"]["code"] == "policy_unavailable"
            assert elapsed < 0.2 + 0.2
            assert stack.backend.requests == []
            assert errors(stack, "timeout") == 1
            async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
                assert response.status == 503  # discovery fails closed too
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("path, code, reason", [
    ("toolproxy/no_such_rule", "policy_unavailable", "undefined"),
    ("toolproxy/policy_revision", "forbidden", "bad_decision"),  # a string, not a decision document
])
async def test_undefined_or_malformed_decisions_never_allow(proxy_deps, path, code, reason):
    # OPA admits the proxy's token on its decision path only: this OPA's is the one under test.
    with OpaServer([POLICIES, DEMO_OPA_DATA], decision_path=path) as opa:
        async with running_stack({**proxy_deps, **opa.settings, "opa.decision_path": path}) as stack:
            status, env = await stack.call("get_order", ORDER)
            assert env["error"]["code"] == code
            assert stack.backend.requests == []
            assert errors(stack, reason) == 1


# ----------------------------------------------------------------------------- the dev stack


async def _poll(url: str, body: dict, until, timeout_s: float, headers: dict | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    last = None
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url, json=body, headers=headers) as response:
                    last = await response.json(content_type=None)
                    if until(last):
                        return last
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"condition not reached within {timeout_s}s; last answer {last}")


async def test_rego_edit_flips_a_decision_in_the_running_dev_stack(tmp_path):
    policies = tmp_path / "policies"
    shutil.copytree(POLICIES, policies)
    ports = {name: free_port() for name in ("proxy", "admin", "ops", "redis", "backend")}
    log = open(tmp_path / "dev.log", "w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "dev", "--policies", str(policies),
         *[arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['proxy']}/v1/tool-calls"
    body = {"call_id": "c1", "tool": "get_order", "arguments": ORDER}
    try:
        env = await _poll(url, body, lambda e: e.get("outcome") == "succeeded", 60)
        assert env["data"]["order_id"] == "ord_1001"

        # The demo approval flow works end to end with the approver token the banner prints.
        refund = {"call_id": "c2", "tool": "refund_order",
                  "arguments": {"order_id": "ord_1001", "amount": 6000, "reason": "dup"}}
        key = {"Idempotency-Key": "dev-refund-1"}  # one operation, before and after the approval
        env = await _poll(url, refund, lambda e: e.get("error") is not None, 10, headers=key)
        assert env["error"]["code"] == "approval_required"
        approval_id = env["error"]["details"]["approval_id"]
        log.seek(0)
        token = re.search(rb"export APPROVER='([^']+)'", log.read()).group(1).decode()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{ports['admin']}/v1/approvals/{approval_id}/approve",
                                    headers={"Authorization": f"Bearer {token}"}) as response:
                assert response.status == 200, await response.text()
            async with session.post(url, json=refund, headers={**key, "X-Approval-Id": approval_id}) as response:
                assert response.status == 200, await response.text()

        with open(policies / "limits.rego", "a") as rego:
            rego.write('\ndeny contains "maintenance_window" if {\n\tinput.action == "call"\n'
                       '\tinput.tool.name == "get_order"\n}\n')
        env = await _poll(url, body, lambda e: (e.get("error") or {}).get("code") == "forbidden", 15)
        assert "maintenance" not in str(env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()
