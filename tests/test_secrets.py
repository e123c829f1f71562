"""Secrets never reach audit output or logs.

A real ``toolproxy run`` process (debug logging, audit to stdout and a Redis
Stream) serves calls that carry a bearer token, a secret-looking header and
a ``password`` argument the contract marks sensitive, through success,
schema violation, invalid JSON, backend 500, backend echoing the password
(which the contract's output filter keeps from the model) and an unknown outcome. Then every byte the process wrote (stdout, stderr) and
every entry of the audit stream is scanned for the secret values.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as redis_async
from aiohttp import web

from tests.support.audit import audit_records, fingerprinted
from tests.support.proxyproc import fleet_key_env
from tests.support.servers import free_port
from tests.support.tokens import Issuer

REPO = Path(__file__).resolve().parent.parent
HEADER_SECRET = "hdr-91b2c3d4e5f60718-apikey"
COOKIE_SECRET = "cookie-5a6b7c8d9e0f1a2b"
PASSWORD = "pw-Zq8!mT3#vL6@rN1"

REGISTRY = """
tools:
  - name: set_password
    version: "1.0.0"
    description: Set a service account's password.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [account, password]
      properties:
        account: {type: string, pattern: "^acct_[a-z0-9]+$"}
        password: {type: string, minLength: 8, maxLength: 64}
    outputSchema:
      type: object
      additionalProperties: false
      required: [account]
      properties:
        account: {type: string}
        echo: {type: string}
    resources: [{template: "account:{account}", access: exclusive}]
    timeout_ms: 2000
    backend: {type: http, service: creds, path: /set_password}
    sensitive_fields: [password]
    output_filter: {redact: [/echo]}   # whatever the backend echoes, the model never sees it
"""


RELEASE = web.AppKey("release", asyncio.Event)


async def _backend(request: web.Request) -> web.Response:
    """A real HTTP tool backend whose behaviour depends on the account name."""
    body = await request.json()
    account = body["account"]
    if account == "acct_echo":  # a careless backend that echoes the secret back
        return web.json_response({"account": account, "echo": body["password"]})
    if account == "acct_boom":  # a failing backend whose error body carries the secret
        return web.json_response({"error": {"code": "boom", "message": f"bad {body['password']}"}}, status=500)
    if account == "acct_stall":  # answers only when the test is over (bounded)
        await asyncio.wait_for(request.app[RELEASE].wait(), 30)
    return web.json_response({"account": account})


async def _wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "toolproxy exited early"
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} not ready within {bound_s}s")


@pytest.fixture
async def creds_backend():
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/set_password", _backend)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    app[RELEASE].set()
    await runner.cleanup()


async def test_no_secret_reaches_audit_output_or_logs(tmp_path, redis_url, opa_server, creds_backend):
    (tmp_path / "tools.yaml").write_text(REGISTRY)
    # The bearer token is real: the proxy verifies it (jwt mode) and takes the caller from it.
    issuer = Issuer(tmp_path, issuer="https://platform.test", kid="agent-key")
    bearer = issuer.token("alice")
    (tmp_path / "forged").mkdir()
    forged = Issuer(tmp_path / "forged", issuer="https://platform.test", kid="agent-key").token("mallory")
    secrets = (bearer, bearer.split(".")[2], forged.split(".")[2], HEADER_SECRET, COOKIE_SECRET, PASSWORD)
    # OPA must know the new resource kind before it allows anything on it (unknown kinds are refused).
    opa_server.put_data("toolproxy/resource_kinds/account", {"ownership": "shared"})
    port, ops = free_port(), free_port()
    env = {**os.environ, "TOOLPROXY_LISTEN_PORT": str(port), "TOOLPROXY_OPS_PORT": str(ops),
           "TOOLPROXY_ADMIN_PORT": str(free_port()), "TOOLPROXY_REGISTRY_PATHS": str(tmp_path / "tools.yaml"),
           "TOOLPROXY_BACKENDS_SERVICES": f"creds={creds_backend}", "TOOLPROXY_LOG_LEVEL": "debug",
           "TOOLPROXY_AUDIT_SINKS": "stdout,redis", "TOOLPROXY_REDIS_URL": redis_url,
           "TOOLPROXY_OPA_URL": opa_server.url, "TOOLPROXY_OPA_TOKEN_FILE": opa_server.token_file, "TOOLPROXY_IDENTITY_MODE": "jwt",
           "TOOLPROXY_IDENTITY_AGENT_ID": "agent-under-test",
           "TOOLPROXY_IDENTITY_JWT_ISSUER": issuer.issuer, "TOOLPROXY_IDENTITY_JWT_JWKS_FILE": str(issuer.jwks_file),
           **fleet_key_env()}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, env=env, stdout=out,
                                stderr=err)
    headers = {"Authorization": f"Bearer {bearer}", "X-Api-Key": HEADER_SECRET,
               "Cookie": f"session={COOKIE_SECRET}", "Content-Type": "application/json"}
    request_ids = []
    try:
        async with aiohttp.ClientSession() as session:
            await _wait_ready(session, f"http://127.0.0.1:{ops}/healthz", proc, 20)

            async def call(arguments, timeout="5"):
                body = {"call_id": f"call_{len(request_ids)}", "tool": "set_password", "arguments": arguments}
                async with session.post(f"http://127.0.0.1:{port}/v1/tool-calls", json=body,
                                        headers={**headers, "Request-Timeout": timeout,  # a write needs a key
                                                 "Idempotency-Key": f"secrets-{uuid.uuid4().hex}"}) as response:
                    envelope = await response.json()
                request_ids.append(envelope["request_id"])
                return envelope

            ok = await call({"account": "acct_a", "password": PASSWORD})
            assert ok["outcome"] == "succeeded", ok
            echoed = await call({"account": "acct_echo", "password": PASSWORD})
            # The contract's output filter: the echoed password never reaches the model (seed 004 §6).
            assert echoed["outcome"] == "succeeded" and echoed["data"] == {"account": "acct_echo"}, echoed
            assert PASSWORD not in json.dumps(echoed)
            async with session.get(f"http://127.0.0.1:{port}/v1/operations/{echoed['idempotency_key']}",
                                   headers=headers) as response:
                view = await response.json()
            assert view["result"] == {"account": "acct_echo"} and PASSWORD not in json.dumps(view)
            assert (await call({"account": "acct_boom", "password": PASSWORD}))["outcome"] == "unknown"
            assert (await call({"account": "acct_stall", "password": PASSWORD}, timeout="0.5"))["outcome"] == \
                "unknown"
            bad = await call({"account": "acct_a", "password": PASSWORD, "token": bearer})
            assert bad["error"]["code"] == "schema_violation"
            broken = await call('{"account": "acct_a", "password": "' + PASSWORD + '"')
            assert broken["error"]["code"] == "invalid_json"
            async with session.post(f"http://127.0.0.1:{port}/v1/tool-calls",
                                    json={"call_id": "c_forged", "tool": "set_password",
                                          "arguments": {"account": "acct_a", "password": PASSWORD}},
                                    headers={**headers, "Authorization": f"Bearer {forged}"}) as response:
                assert response.status == 401  # a token signed by another key: refused, and not logged
            async with session.get(f"http://127.0.0.1:{ops}/metrics") as response:
                metrics_text = await response.text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    client = redis_async.Redis.from_url(redis_url)
    try:
        stream = await client.xrange("toolproxy:audit:{stream}")
    finally:
        await client.aclose()
    captured = {"stdout": stdout.read_bytes(), "stderr": stderr.read_bytes(),
                "audit stream": b"\n".join(fields[b"record"] for _, fields in stream),
                "metrics": metrics_text.encode()}
    for where, data in captured.items():
        for secret in secrets:
            assert secret.encode() not in data, f"{secret!r} leaked into {where}"

    # The scan is meaningful: the records and log lines are there, and name the requests.
    records = audit_records(captured["stdout"].decode())
    assert [r["kind"] for r in records].count("tool_call") == 6
    assert {r["request_id"] for r in records if r["kind"] == "tool_call"} == set(request_ids)
    assert any(fingerprinted(r.get("arguments", {}).get("password")) for r in records)
    assert len(stream) == len(records)
    assert {r["subject"] for r in records if r["kind"] == "tool_call"} == {"alice"}  # the token was used
    lines = [json.loads(line) for line in captured["stderr"].decode().splitlines() if line.strip()]
    finished = [line for line in lines if line["msg"].startswith("tool call finished")]
    assert [line["request_id"] for line in finished] == request_ids
    assert all(line.get("trace_id") for line in finished)
