"""Issue #12: what a new user and an attacker found at the edges, each against real processes.

Real ``toolproxy run`` subprocesses (tests/support/proxyproc.py) where the log
output or the process's own start-up matters, in-process stacks elsewhere;
always real OPA and Redis, and a small hostile tool backend defined here
(deeply nested answers, a write that fails after being sent, status
endpoints declared with ``{key}``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import Config, ConfigError, describe, load_config
from tests.support.metrics import sample, samples
from tests.support.modes import all_redis_modes
from tests.support.proxyproc import ProxyProcess, fleet_key_env
from tests.support.stack import DEMO_REGISTRY, UNLOCKED_COUNTER, assert_envelope, extra_tools, running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until
from tests.support.audit import fingerprinted

REPO = Path(__file__).resolve().parent.parent
DEEP = "[" * 50000 + "]" * 50000  # about 100 KB: under the body limit, far over any nesting limit
EMAIL = {"to": "a@example.com", "subject": "Hello", "body": "Your order shipped."}


# --------------------------------------------------------------------------- a hostile backend

class Hostile:
    """Tool backend under the test's control: what it answers, and what it saw."""

    def __init__(self) -> None:
        self.status_answer: Any = "deep"
        self.seen: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/deep", self.deep)
        app.router.add_post("/write", self.write)
        app.router.add_get("/status/{key}", self.status)
        app.router.add_get("/status", self.status)
        return app

    async def deep(self, request: web.Request) -> web.Response:
        return web.Response(text=DEEP, content_type="application/json")

    async def write(self, request: web.Request) -> web.Response:
        self.seen.append({"kind": "call", "idempotency_key": request.headers.get("Idempotency-Key")})
        return web.json_response({"error": {"code": "boom"}}, status=500)  # sent: the outcome is unknown

    async def status(self, request: web.Request) -> web.Response:
        self.seen.append({"kind": "status", "path_key": request.match_info.get("key"),
                          "query_key": request.query.get("idempotency_key"),
                          "header_key": request.headers.get("Idempotency-Key")})
        if self.status_answer == "deep":
            return web.Response(text=DEEP, content_type="application/json")
        return web.json_response(self.status_answer)


HOSTILE_TOOLS = """
tools:
  - name: deep_read
    version: "1.0.0"
    description: A read whose backend answers 50,000 nested arrays.
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, properties: {}}
    outputSchema: {type: object}
    timeout_ms: 5000
    backend: {type: http, url: "BASE/deep"}
STATUS_TOOLS
  - name: provision_accounts
    version: "1.0.0"
    description: Destructive (always approved); credentials nested in an array of objects.
    mode: write
    risk: destructive
    inputSchema:
      type: object
      additionalProperties: false
      required: [accounts]
      properties:
        accounts:
          type: array
          items:
            type: object
            additionalProperties: false
            required: [user, password]
            properties: {user: {type: string}, password: {type: string}}
    outputSchema: {type: object}
    timeout_ms: 5000
    backend: {type: http, url: "BASE/write"}
"""


# A write that fails after being sent; STATUS says where its status endpoint wants the key.
STATUS_TOOL = """
  - name: NAME
    version: "1.0.0"
    description: A write whose status endpoint is declared as STATUS.
    mode: write
    risk: write
    inputSchema: {type: object, additionalProperties: false, required: [n], properties: {n: {type: integer}}}
    outputSchema: {type: object, additionalProperties: false, required: [done], properties: {done: {type: boolean}}}
    timeout_ms: 5000
    backend: {type: http, url: "BASE/write"}
    status_endpoint: {url: "BASESTATUS"}
"""
STATUS_TOOLS = "".join(STATUS_TOOL.replace("NAME", name).replace("STATUS", where)
                       for name, where in (("status_by_path", "/status/{key}"),
                                           ("status_by_query", "/status?idempotency_key={key}")))


@pytest.fixture
async def hostile(tmp_path):
    backend = Hostile()
    runner = web.AppRunner(backend.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    registry = tmp_path / "hostile.yaml"
    registry.write_text(HOSTILE_TOOLS.replace("STATUS_TOOLS", STATUS_TOOLS.strip("\n")).replace("BASE", base))
    backend.registry = registry  # type: ignore[attr-defined]
    try:
        yield backend
    finally:
        await runner.cleanup()


def process_settings(proxy_deps: dict[str, Any], demo_url: str, registry: Path, issuers: Any, **extra: Any
                     ) -> dict[str, Any]:
    _, admin = issuers
    return {"redis.url": proxy_deps["redis.url"], "opa.url": proxy_deps["opa.url"], "opa.token_file": proxy_deps["opa.token_file"],
            "backends.services": {"demo": demo_url}, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
            "admin_identity.jwt.issuer": admin.issuer, "admin_identity.jwt.audience": "toolproxy-admin",
            "admin_identity.jwt.jwks_file": str(admin.jwks_file),
            "reconcile.scan_interval_ms": 100, "reconcile.backoff_initial_ms": 50,
            "reconcile.backoff_max_ms": 200, **extra}


def operator_token(issuers: Any, tenant: str | None = None) -> str:
    cross = ["cross-tenant"] if tenant is None else []  # a tenant-less admin token needs the cross-tenant role
    return issuers[1].token("olga", audience="toolproxy-admin", roles=["operator", *cross], tenant=tenant, scope="")


async def post_raw(session: aiohttp.ClientSession, url: str, body: bytes | str,
                   headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
                            ) as response:
        return response.status, await response.json(content_type=None)


# --------------------------------------------------------------------------- 1. nesting

async def test_deeply_nested_json_is_invalid_json_everywhere_and_never_a_traceback(
        proxy_deps, demo_backend, hostile, issuers, http_session):
    proxy = ProxyProcess(process_settings(proxy_deps, demo_backend[0], hostile.registry, issuers)).start()
    try:
        await proxy.ready()
        url = proxy.url
        # The JSON API: arguments as nested arrays, in a batch, and as a JSON string holding them.
        status, env = await post_raw(http_session, url + "/v1/tool-calls",
                                     '{"call_id":"c1","tool":"get_order","arguments":' + DEEP + "}")
        assert (status, env["error"]["code"]) == (400, "invalid_json"), env
        assert env["error"]["details"]["max_depth"] == 64
        status, env = await post_raw(http_session, url + "/v1/tool-calls:batch",
                                     '{"calls":[{"call_id":"c1","tool":"get_order","arguments":' + DEEP + "}]}")
        assert (status, env["error"]["code"]) == (400, "invalid_json"), env
        status, env = await post_raw(http_session, url + "/v1/tool-calls",
                                     json.dumps({"call_id": "c2", "tool": "get_order", "arguments": DEEP}))
        assert (status, env["error"]["code"], env["error"]["phase"]) == (400, "invalid_json", "decode"), env
        assert_envelope(env)
        # MCP: a parse error.
        status, body = await post_raw(
            http_session, url + "/mcp", '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get_order",'
            '"arguments":' + DEEP + "}}", headers={"Accept": "application/json, text/event-stream"})
        assert status == 400 and body["error"]["code"] == -32700, body
        # OpenAI shapes: the call's own envelope says invalid_json.
        status, body = await post_raw(http_session, url + "/v1/openai/tool-calls", json.dumps(
            {"tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_order", "arguments": DEEP}}]}))
        assert status == 200, body
        assert json.loads(body["messages"][0]["content"])["error"]["code"] == "invalid_json"
        # The admin listener.
        status, env = await post_raw(
            http_session, f"http://127.0.0.1:{proxy.admin_port}/v1/operations/ik_{'0' * 64}/resolve",
            '{"outcome":"committed","evidence":' + DEEP[:20000] + "}",
            headers={"Authorization": f"Bearer {operator_token(issuers)}"})
        assert (status, env["error"]["code"]) == (400, "invalid_json"), env
        # A backend's answer: the tool's output is invalid, nothing else.
        status, env = await post_raw(http_session, url + "/v1/tool-calls",
                                     json.dumps({"call_id": "c3", "tool": "deep_read", "arguments": {}}))
        assert (status, env["error"]["code"]) == (502, "output_invalid"), env
        # A status endpoint's answer: evidence invalid_answer, the operation stays open.
        status, env = await post_raw(http_session, url + "/v1/tool-calls",
                                     json.dumps({"call_id": "c4", "tool": "status_by_path", "arguments": {"n": 1}}),
                                     headers={"Idempotency-Key": f"deep-{uuid.uuid4().hex}"})  # a write needs a key
        assert env["outcome"] == "unknown", env
        key = env["idempotency_key"]

        async def checked_once() -> bool:
            async with http_session.get(f"{url}/v1/operations/{key}") as response:
                view = await response.json()
            return (view.get("evidence") or {}).get("observed") == "invalid_answer"
        await wait_until(checked_once, timeout=20, what="a status query answered with deep JSON")
        async with http_session.get(f"http://127.0.0.1:{proxy.ops_port}/readyz") as response:
            assert response.status == 200  # still serving
    finally:
        proxy.stop()
    log = proxy.log(limit=200000)
    assert "Traceback" not in log and "RecursionError" not in log
    assert '"level":"error"' not in log, log[-3000:]


# --------------------------------------------------------------------------- 2. writes and Redis

@pytest.fixture
async def stack(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as s:
        yield s


BUMP = {"counter": "ctr_demo", "delta": 1}  # bump_counter: a write whose contract needs no key, no resources


async def test_no_write_is_sent_while_the_state_store_is_down(stack, redis_server):
    redis_server.stop()
    try:
        status, env = await stack.call("bump_counter", BUMP, call_id="no-key-no-redis")
    finally:
        redis_server.start()
    assert (status, env["error"]["code"]) == (503, "dependency_unavailable"), env
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert stack.backend.effect_counts().get("adjust_counter", 0) == 0
    assert stack.backend.requests == []


async def test_a_write_without_a_key_gets_a_per_request_record_that_never_replays(stack):
    first = await stack.call("bump_counter", BUMP, call_id="e1")
    second = await stack.call("bump_counter", BUMP, call_id="e2")
    keys = [env["idempotency_key"] for _, env in (first, second)]
    assert all(key and key.startswith("ik_") for key in keys) and keys[0] != keys[1]
    assert not second[1].get("replayed") and stack.backend.effect_counts()["adjust_counter"] == 2
    status, view = await stack.get(f"/v1/operations/{keys[0]}")
    assert status == 200 and view["state"] == "SUCCEEDED"
    # The backend can deduplicate transport retries on it.
    assert [r["headers"]["Idempotency-Key"] for r in stack.backend.requests] == keys


# --------------------------------------------------------------------------- 3. parser errors

MALFORMED = {
    "bare CR": b"GET /v1/tools HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
    "NUL in a header": b"GET /v1/tools HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "100 KB header": b"GET /v1/tools HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n",
    "2,000 headers": b"GET /v1/tools HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(2000))
                     + b"\r\n",
    "duplicate Content-Length": b"POST /v1/tool-calls HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                b"Content-Length: 3\r\n\r\n{}",
}


async def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=15)  # the proxy closes after a refusal
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def test_requests_the_http_parser_refuses_get_the_envelope_and_are_counted(proxy_deps, http_session):
    proxy = ProxyProcess({"redis.url": proxy_deps["redis.url"], "opa.url": proxy_deps["opa.url"], "opa.token_file": proxy_deps["opa.token_file"],
                          "registry.paths": [str(DEMO_REGISTRY)]}).start()
    try:
        await proxy.ready()
        for name, data in MALFORMED.items():
            status, headers, body = await raw_exchange(proxy.port, data)
            assert status == 400 and headers["content-type"].startswith("application/json"), (name, body[:200])
            env = json.loads(body)
            assert_envelope(env)
            assert env["error"]["code"] == "invalid_request" and env["request_id"] == headers["x-request-id"], name
        async with http_session.get(f"http://127.0.0.1:{proxy.ops_port}/metrics") as response:
            counted = samples(await response.text())
        assert counted[sample("toolproxy_request_errors_total", code="invalid_request")] == len(MALFORMED)
    finally:
        proxy.stop()
    assert "Traceback" not in proxy.log(limit=200000)


# --------------------------------------------------------------------------- 4. one redaction

async def test_a_password_nested_in_an_array_is_masked_wherever_a_person_reads_it(
        proxy_deps, hostile, issuers, capsys, caplog):
    secret = "hunter2-in-an-array"
    agent, admin = issuers
    approver = admin.token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")
    operator = operator_token(issuers)
    arguments = {"accounts": [{"user": "ann", "password": secret}]}
    overrides = {**proxy_deps, **jwt_overrides(agent, admin), "reconcile.scan_interval_ms": 50,
                 "reconcile.backoff_initial_ms": 20, "registry.paths": [str(DEMO_REGISTRY), str(hostile.registry)]}
    async with running_stack(overrides) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        key_header = {"Idempotency-Key": "provision-1"}
        status, env = await stack.call("provision_accounts", arguments, headers=key_header)
        assert env["error"]["code"] == "approval_required", env
        approval_id = env["error"]["details"]["approval_id"]
        status, listing = await stack.admin("GET", "/v1/approvals", approver)  # what the approver reads
        assert status == 200 and secret not in json.dumps(listing)
        [shown] = [a for a in listing["approvals"] if a["id"] == approval_id]
        assert shown["arguments"]["accounts"][0]["user"] == "ann"
        assert shown["arguments"]["accounts"][0]["password"].startswith("[redacted hmac-sha256:")  # a per-field hash
        status, single = await stack.admin("GET", f"/v1/approvals/{approval_id}", approver)
        assert status == 200 and secret not in json.dumps(single)
        assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
        status, env = await stack.call("provision_accounts", arguments,
                                       headers={**key_header, "X-Approval-Id": approval_id})
        assert env["outcome"] == "unknown", env  # the backend failed after receiving it
        key = env["idempotency_key"]

        async def taken_over() -> bool:  # no status endpoint: handed to a human, with the target shown
            status, view = await stack.admin("GET", f"/v1/operations/{key}", operator)
            return view.get("state") == "NEEDS_TAKEOVER"
        await wait_until(taken_over, timeout=15, what="the takeover record")
        status, view = await stack.admin("GET", f"/v1/operations/{key}", operator)
        assert fingerprinted(view["takeover"]["target"]["arguments"]["accounts"][0]["password"])
        status, takeovers = await stack.admin("GET", "/v1/takeovers", operator)
        assert status == 200 and takeovers["takeovers"] and secret not in json.dumps(takeovers)
        assert secret not in json.dumps(view)
    captured = capsys.readouterr()
    assert secret not in captured.out and secret not in captured.err  # audit records (stdout), logs
    assert secret not in caplog.text


# --------------------------------------------------------------------------- 5. identity before the body

@pytest.mark.parametrize("listener, path", [
    ("agent", "/mcp"), ("agent", "/v1/tool-calls"), ("agent", "/v1/tool-calls:batch"),
    ("agent", "/v1/openai/tool-calls"), ("admin", f"/v1/operations/ik_{'0' * 64}/resolve"),
    ("admin", "/v1/unknown-calls/settle")])
async def test_an_unauthenticated_body_is_refused_without_being_read(proxy_deps, issuers, listener, path):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin)}) as stack:
        base = stack.proxy_url if listener == "agent" else stack.admin_url
        port = int(base.rsplit(":", 1)[1])
        announced = 1024 * 1024
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Accept: application/json, text/event-stream\r\nContent-Length: {announced}\r\n\r\n").encode()
        # Only the first 16 KB of the announced megabyte is ever sent: an answer can only come from a proxy
        # that decided without reading the body.
        status, _, body = await raw_exchange_partial(port, head + b" " * 16384)
        assert status == 401, body[:300]


async def raw_exchange_partial(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=15)
    finally:
        writer.close()
    status_line = head.decode("latin-1").split("\r\n")[0]
    return int(status_line.split()[1]), {}, head


# --------------------------------------------------------------------------- 6. bad settings, one line

def run_proxy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY),
                                           "TOOLPROXY_IDENTITY_MODE": "static", **fleet_key_env(), **env})


def test_an_enumerated_setting_with_a_bad_value_stops_toolproxy_run_with_one_line():
    result = run_proxy({"TOOLPROXY_MCP_UPSTREAM_MODE": "sometimes"})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "mcp.upstream_mode" in result.stderr and "'sometimes'" in result.stderr
    assert "auto, legacy" in result.stderr and "Traceback" not in result.stderr


def test_run_without_the_fleet_keys_stops_with_one_line_naming_both_and_why():
    for missing in ({"TOOLPROXY_INTEGRITY_MAC_KEY_FILE": ""}, {"TOOLPROXY_CALL_TOKENS_SIGNING_KEY_FILE": ""}):
        result = run_proxy(missing)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "integrity.mac_key_file" in result.stderr and "call_tokens.signing_key_file" in result.stderr
        assert "a restart or a second replica could not read" in result.stderr and "Traceback" not in result.stderr


def test_a_failure_while_opening_the_runtime_is_one_line_and_closes_what_was_opened(tmp_path):
    key_file = tmp_path / "key.pem"
    key_file.write_text("not used: no algorithm can use it")
    result = run_proxy({"TOOLPROXY_IDENTITY_MODE": "jwt", "TOOLPROXY_IDENTITY_AGENT_ID": "agent-x",
                        "TOOLPROXY_IDENTITY_JWT_PUBLIC_KEY_FILE": str(key_file),
                        "TOOLPROXY_IDENTITY_JWT_ALGORITHMS": "HS256", "TOOLPROXY_OPA_PUSH_CATALOG": "false"})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "identity.jwt.algorithms" in result.stderr
    assert "Unclosed" not in result.stderr and "Traceback" not in result.stderr


def enumerated_settings() -> list[tuple[str, tuple[str, ...]]]:
    import dataclasses

    def walk(cls: type, prefix: str) -> list[tuple[str, tuple[str, ...]]]:
        found = []
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            if dataclasses.is_dataclass(default):
                found += walk(type(default), f"{prefix}{f.name}.")
            elif f.metadata.get("choices"):
                found.append((f"{prefix}{f.name}", f.metadata["choices"]))
        return found
    return walk(Config, "")


def test_every_enumerated_setting_is_checked_by_the_loader():
    settings = enumerated_settings()
    assert {"identity.mode", "admin_identity.mode", "mcp.upstream_mode", "idempotency.read_policy", "locks.scope",
            "log.level", "log.format", "audit.sinks", "audit.on_failure_write", "audit.on_failure_read",
            "identity.jwt.algorithms"} <= {key for key, _ in settings}
    for key, choices in settings:
        default = dict((k, d) for k, _, d, _ in describe())[key]
        bogus: Any = ["bogus"] if isinstance(default, list) else "bogus"
        with pytest.raises(ConfigError) as refused:
            load_config(env={}, overrides={key: bogus})
        message = str(refused.value)
        assert key in message and "'bogus'" in message and ", ".join(choices) in message


# --------------------------------------------------------------------------- 7. status endpoints

@pytest.mark.parametrize("tool, where", [("status_by_path", "path_key"), ("status_by_query", "query_key")])
async def test_a_status_endpoint_gets_the_derived_key_where_it_declares_it(proxy_deps, hostile, tool, where):
    hostile.status_answer = {"state": "committed", "result": {"done": True}}
    overrides = {**proxy_deps, "reconcile.scan_interval_ms": 50, "reconcile.backoff_initial_ms": 20,
                 "registry.paths": [str(DEMO_REGISTRY), str(hostile.registry)]}
    async with running_stack(overrides) as stack:
        status, env = await stack.call(tool, {"n": 1}, headers={"Idempotency-Key": "caller-chosen-1"})
        assert env["outcome"] == "unknown", env
        key = env["idempotency_key"]

        async def settled() -> bool:
            return (await stack.get(f"/v1/operations/{key}"))[1].get("state") == "SUCCEEDED"
        await wait_until(settled, timeout=15, what="reconciliation through the declared status endpoint")
        status, again = await stack.call(tool, {"n": 1}, headers={"Idempotency-Key": "caller-chosen-1"})
        assert again["replayed"] is True and again["data"] == {"done": True}
    [call] = [s for s in hostile.seen if s["kind"] == "call"]
    query = next(s for s in hostile.seen if s["kind"] == "status")
    # The backend got the derived ik_ key (not the caller's header value) on the call and the status query.
    assert call["idempotency_key"] == key != "caller-chosen-1"
    assert query[where] == key and query["header_key"] == key


# --------------------------------------------------------------------------- 8. what a backend owner needs

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_check_policy_data_validates_the_opa_data_document(tmp_path):
    result = cli("check-policy-data", "examples/opa/data.json")
    assert result.returncode == 0 and result.stdout.startswith("ok "), result.stderr
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["roles"]["agent"]["tools"] = "*"                       # must be a list
    data["toolproxy"]["subjects"]["acme"]["carol"]["roles"] = ["ghost"]        # no such role
    data["toolproxy"]["settings"]["approval"]["thresholds"]["refund_order"]["default"] = -1
    bad = tmp_path / "data.json"
    bad.write_text(json.dumps(data))
    result = cli("check-policy-data", str(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "toolproxy.roles.agent.tools" in result.stderr
    assert "refund_order.default" in result.stderr
    data["toolproxy"]["roles"]["agent"]["tools"] = ["*"]
    data["toolproxy"]["settings"]["approval"]["thresholds"]["refund_order"]["default"] = 5000
    bad.write_text(json.dumps(data))
    result = cli("check-policy-data", str(bad))
    assert result.returncode == 1 and "role 'ghost' is not defined" in result.stderr


def test_identity_agent_id_has_no_default_outside_the_dev_mode():
    assert load_config(env={}).identity.agent_id == ""
    result = run_proxy({"TOOLPROXY_IDENTITY_MODE": "headers"})
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "identity.agent_id" in result.stderr and "Traceback" not in result.stderr


async def test_a_request_timeout_above_the_maximum_is_clamped(proxy_deps):
    async with running_stack({**proxy_deps, "deadline.max_request_timeout_ms": 20000}) as stack:
        status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers={"Request-Timeout": "100000"})
        assert status == 200 and 0 < env["timing"]["deadline_ms"] <= 20000


async def test_operation_in_progress_answers_say_outcome_unknown(stack):
    await stack.fault("send_email", "slow", delay_ms=1500, count=1)
    headers = {"Idempotency-Key": "in-progress-1"}
    first = asyncio.ensure_future(stack.call("send_email", EMAIL, headers=headers))

    async def running() -> bool:
        return any(r["tool"] == "send_email" for r in stack.backend.requests)
    await wait_until(running, timeout=10, what="the first call at the backend")
    status, env = await stack.call("send_email", EMAIL, headers=headers)
    assert (status, env["error"]["code"], env["outcome"]) == (409, "operation_in_progress", "unknown")
    await first


# --------------------------------------------------------------------------- leftovers: locks

@all_redis_modes  # a Cluster pipeline has no TIME: the clock is read apart from the scan
async def test_operators_see_held_locks_of_their_tenant_only(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin)}) as stack:
        from proxy.deadline import Deadline
        from proxy.normalize import ResourceRef
        locks = stack.runtime.locks  # a call of another replica holding a resource
        lease = await locks.acquire((ResourceRef(id="counter:ctr_demo", access="exclusive"),),
                                    tenant="acme", tool="adjust_counter", is_write=True,
                                    deadline=Deadline(time.monotonic() + 5.0), operation="ik_" + "a" * 64,
                                    request_id="req-1")
        try:
            status, listing = await stack.admin("GET", "/v1/locks", operator_token(issuers))
            assert status == 200, listing
            [held] = listing["locks"]
            assert held == {"resource": "counter:ctr_demo", "tenant": "acme", "mode": "exclusive",
                            "tool": "adjust_counter", "operation": "ik_" + "a" * 64, "request_id": "req-1",
                            "fencing_token": lease.fencing_token,
                            "lease_remaining_ms": held["lease_remaining_ms"]}
            assert 0 < held["lease_remaining_ms"] <= listing["lease_ms"]
            assert listing["truncated"] is False and listing["scope"] == "tenant"
            status, other = await stack.admin("GET", "/v1/locks", operator_token(issuers, tenant="globex"))
            assert status == 200 and other["locks"] == []
            approver = admin.token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")
            assert (await stack.admin("GET", "/v1/locks", approver))[0] == 403
            assert (await stack.admin("GET", "/v1/locks", None))[0] == 401
        finally:
            await lease.release()
        status, listing = await stack.admin("GET", "/v1/locks", operator_token(issuers))
        assert listing["locks"] == []
