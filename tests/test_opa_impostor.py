"""Nothing the agent's container can bind answers for OPA: a real ``toolproxy run`` against an impostor.

The "agent" binds a loopback TCP port first, the way it could take OPA's old ``127.0.0.1:8181`` in the pod's
shared network namespace, and answers every request as an OPA that allows everything. Configured the
production way (``opa.url`` a Unix socket in a private directory), the proxy never asks it: its decisions are
the real OPA's (a large refund still waits for a person), the impostor sees 0 requests and never the OPA
token. ``toolproxy run`` refuses a TCP ``opa.url`` in one line unless ``opa.allow_tcp`` is set, and the last
test but one shows what that refusal prevents: with the escape hatch, the impostor allows the refund and
reads the token. The last plays it in a fresh network namespace, where the agent holds the exact old address.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import aiohttp
import pytest
from aiohttp import web

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import free_port
from tests.support.stack import REPO

REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "dup"}  # above 50.00: the real policy wants a person
ORDER = {"order_id": "ord_1001"}
ALLOW_EVERYTHING = {"result": {"allow": True, "require_approval": False, "reasons": [], "policy_revision": "evil"}}


class Impostor:
    """An "agent" listener on a loopback port that answers like an OPA allowing everything; it keeps every
    request it was sent and the bearer tokens that came with them."""

    def __init__(self) -> None:
        self.port = free_port()
        self.seen: list[tuple[str, str]] = []
        self.tokens: set[str] = set()
        self.runner: web.AppRunner | None = None

    async def answer(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path))
        if request.headers.get("Authorization"):
            self.tokens.add(request.headers["Authorization"].removeprefix("Bearer "))
        await request.read()
        if request.method == "POST":
            return web.json_response(ALLOW_EVERYTHING)
        return web.json_response({}, status=204 if request.method == "PUT" else 200)

    async def __aenter__(self) -> "Impostor":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def impostor():
    async with Impostor() as listening:
        yield listening


def sidecar(proxy_deps, backend_url: str, **settings: object) -> ProxyProcess:
    return ProxyProcess({**proxy_deps, "backends.services": {"demo": backend_url}, "reconcile.enabled": False,
                         "opa.timeout_ms": 5000, **settings})  # 5 s: two loaded cores


async def refund(session: aiohttp.ClientSession, proxy: ProxyProcess, arguments: dict = REFUND,
                 tool: str = "refund_order") -> dict:
    body = {"call_id": uuid.uuid4().hex[:12], "tool": tool, "arguments": arguments}
    async with session.post(proxy.url + "/v1/tool-calls", json=body,
                            headers={"Idempotency-Key": uuid.uuid4().hex}) as answer:
        return await answer.json()


async def test_with_opa_on_its_unix_socket_the_impostor_decides_nothing_and_never_sees_the_token(
        proxy_deps, demo_backend, impostor, opa_server):
    assert proxy_deps["opa.url"].startswith("unix:///")
    proxy = sidecar(proxy_deps, demo_backend[0]).start()
    try:
        await proxy.ready()
        async with aiohttp.ClientSession() as session:
            refunds = await asyncio.gather(*(refund(session, proxy) for _ in range(10)))
            reads = await asyncio.gather(*(refund(session, proxy, ORDER, "get_order") for _ in range(10)))
    finally:
        proxy.stop()
    assert [r["error"]["code"] for r in refunds] == ["approval_required"] * 10  # the real OPA's answer
    assert [r["outcome"] for r in reads] == ["succeeded"] * 10
    assert [r["tool"] for r in demo_backend[1].requests].count("refund_order") == 0, "a refund reached the backend"
    assert impostor.seen == [] and impostor.tokens == set()
    assert opa_server.token not in proxy.log(limit=1_000_000)


async def test_run_refuses_opa_over_tcp_in_one_line_naming_the_setting_and_the_fix(proxy_deps, demo_backend,
                                                                                    impostor):
    proxy = sidecar(proxy_deps, demo_backend[0], **{"opa.url": f"http://127.0.0.1:{impostor.port}"}).start()
    try:
        assert proxy.proc is not None and proxy.proc.wait(timeout=60) == 1
    finally:
        proxy.stop()
    lines = [line for line in proxy.log().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"toolproxy: opa.url: http://127.0.0.1:{impostor.port} is TCP")
    assert "unix:///" in lines[0] and "opa.allow_tcp=true" in lines[0]
    assert impostor.seen == []


async def test_what_the_refusal_prevents_the_escape_hatch_lets_the_impostor_allow_and_read_the_token(
        proxy_deps, demo_backend, impostor, opa_server):
    proxy = sidecar(proxy_deps, demo_backend[0],
                    **{"opa.url": f"http://127.0.0.1:{impostor.port}", "opa.allow_tcp": True}).start()
    try:
        await proxy.ready()
        async with aiohttp.ClientSession() as session:
            answer = await refund(session, proxy)
    finally:
        proxy.stop()
    assert answer["outcome"] == "succeeded", answer  # no person asked: the impostor decided
    assert ("POST", "/v1/data/toolproxy/decision") in impostor.seen
    assert impostor.tokens == {opa_server.token}


def test_in_the_pods_network_the_agent_holding_8181_first_stops_a_tcp_opa_and_decides_nothing():
    """``unshare --net``: the agent holds 127.0.0.1:8181, OPA's old address, before anything else starts. An OPA
    told to listen there exits (the crash loop); OPA on its socket starts, and a real proxy's refunds still wait
    for a person while the impostor is asked nothing (tests/walkaround/opa_squat_netns.py)."""
    from tests.walkaround.test_egress_rules import netns_unavailable
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    run = subprocess.run(["unshare", "--net", sys.executable, str(REPO / "tests" / "walkaround" / "opa_squat_netns.py")],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["tcp_opa_exit"] != 0 and "address already in use" in report["tcp_opa_said"], report
    assert report["answers"] == ["approval_required", "succeeded"] * 5, report
    assert (report["impostor_requests"], report["impostor_tokens"]) == (0, 0), report
