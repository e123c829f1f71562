"""``python -m proxy.authoring.mcp_auth_check [--config FILE] URL``: one tool call through toolproxy to an MCP
server behind OAuth, the way an agent's call goes.

Owns: starting a toolproxy in this process (its OPA and Redis from ``--config`` and the ``TOOLPROXY_*``
environment, as any toolproxy's) with ``URL`` as an MCP upstream behind one credential, playing the people
around it, and making one call of the upstream's tool through the proxy's JSON API:

- with a client that has a secret or a key and the client credentials grant (``--grant client_credentials``;
  the MCP conformance suite's ``client-credentials-*`` scenarios), the credential is ``mcp_client_credentials``:
  the proxy obtains its own token, unattended;
- otherwise it is ``mcp_authorization_code``: the command first connects the user's account as the console's
  connections page does (``POST /v1/connections/<name>/start`` with the user's identity, then the authorization
  server's page and its redirect back to ``/connect/callback``, followed as a browser follows them; the test
  authorization servers approve without asking), and when the call answers ``user_grant_required`` (a scope
  step-up) the user connects once more and the agent calls once more.

The client's id, secret or private key come from ``--client-id`` / ``--client-secret-file`` /
``--private-key-file``, or from the conformance suite (``MCP_CONFORMANCE_CONTEXT``); the authorization server
such a client belongs to (``issuer``) is read from the upstream's protected resource metadata, as an operator
would look it up. The MCP conformance suite runs it as its client:
``conformance client --suite auth --command "python -m proxy.authoring.mcp_auth_check --config FILE"``.

Prints the call's result envelope (never a secret or token) and exits 0 when the call succeeded, 1 when it
did not, 2 when the proxy could not start. Must never: be part of a serving proxy (it runs one for one call).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import secrets
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urljoin

CREDENTIAL = "upstream"
TOOL = "upstream_tool"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m proxy.authoring.mcp_auth_check", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("url", help="the MCP server's URL (its Streamable HTTP endpoint)")
    parser.add_argument("--config", help="toolproxy config file (OPA, Redis, identity); TOOLPROXY_* apply too")
    parser.add_argument("--tool", default="test-tool", help="the upstream's tool to call (default: test-tool)")
    parser.add_argument("--arguments", default="{}", help="the call's arguments as JSON (default: {})")
    parser.add_argument("--grant", choices=("client_credentials", "authorization_code"),
                        help="the credential's grant (default: client_credentials for the conformance suite's "
                             "client-credentials scenarios, else authorization_code)")
    parser.add_argument("--client-id", default="", help="a pre-registered client (default: dynamic registration)")
    parser.add_argument("--client-secret-file", default="", help="its secret (client_secret_basic)")
    parser.add_argument("--private-key-file", default="", help="its PEM key (private_key_jwt)")
    parser.add_argument("--private-key-alg", default="RS256", help="the key's algorithm (default: RS256)")
    parser.add_argument("--scope", default="", help="scopes to ask for (default: what the server names)")
    parser.add_argument("--then-revoke", action="store_true",
                        help="authorization_code: after the call, the user's access token is revoked (the upstream "
                             "refuses it from then on), then the user reconnects, then disconnects: a call after each")
    parser.add_argument("--calls", type=int, default=1, choices=range(1, 101), metavar="N",
                        help="make N calls at once (1 to 100; they share one token: default 1)")
    return parser


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _issuer(url: str) -> str:
    """The authorization server the upstream names first in its protected resource metadata (RFC 9728)."""
    import httpx2
    from mcp.client.auth.utils import (build_protected_resource_metadata_discovery_urls,
                                       extract_resource_metadata_from_www_auth, handle_protected_resource_response)
    async with httpx2.AsyncClient(timeout=10.0) as client:
        probe = await client.post(url, content=b'{"jsonrpc":"2.0","id":1,"method":"ping"}',
                                  headers={"Content-Type": "application/json",
                                           "Accept": "application/json, text/event-stream"})
        for candidate in build_protected_resource_metadata_discovery_urls(
                extract_resource_metadata_from_www_auth(probe), url):
            metadata = await handle_protected_resource_response(await client.get(candidate))
            if metadata is not None and metadata.authorization_servers:
                return str(metadata.authorization_servers[0])
    return ""


def _write(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return str(path)


async def _credential(args: argparse.Namespace, context: dict[str, Any], grant: str, work: Path,
                      redirect_uri: str) -> dict[str, Any]:
    client_id = args.client_id or context.get("client_id", "")
    # generous: the conformance suite starts a process per scenario, all at once, on what may be a small machine
    entry: dict[str, Any] = {"kind": f"mcp_{grant}", "client_id": client_id, "timeout_ms": 30000}
    if args.scope:
        entry["scope"] = args.scope
    key = Path(args.private_key_file).read_text(encoding="utf-8") if args.private_key_file else \
        context.get("private_key_pem", "")
    secret = Path(args.client_secret_file).read_text(encoding="utf-8").strip() if args.client_secret_file else \
        context.get("client_secret", "")
    if key:
        entry.update(client_auth="private_key_jwt", private_key_file=_write(work, "client.pem", key),
                     private_key_alg=context.get("signing_algorithm", args.private_key_alg))
    elif secret:
        entry.update(client_auth="client_secret_basic", client_secret_file=_write(work, "client-secret", secret))
    elif client_id:
        entry["client_auth"] = "none"
    if client_id:
        entry["issuer"] = await _issuer(args.url)
    if grant == "authorization_code":
        entry.update(resource=args.url, redirect_uri=redirect_uri,
                     grant_key_file=_write(work, "grant-key", base64.b64encode(secrets.token_bytes(32)).decode()))
    return entry


def _registry(url: str, tool: str) -> str:
    return f"""tools:
  - name: {TOOL}
    version: "1.0.0"
    description: The MCP server's tool {json.dumps(tool)}, called through toolproxy.
    mode: read
    risk: read
    strict: false
    inputSchema: {{type: object}}
    timeout_ms: 60000
    backend: {{type: mcp, url: {json.dumps(url)}, tool: {json.dumps(tool)}, auth: {CREDENTIAL}}}
"""


async def _follow(session: Any, url: str, until: str, hops: int = 10) -> tuple[int, str, str]:
    """A browser's way through redirects (the authorization server's page approves at once) up to ``until``:
    the last answer's status and page, and its URL."""
    for _ in range(hops):
        if url.startswith(until):
            break
        async with session.get(url, allow_redirects=False) as response:
            location = response.headers.get("Location")
            if location is None:
                return response.status, await response.text(), url
        url = urljoin(url, location)
    async with session.get(url, allow_redirects=False) as response:
        return response.status, await response.text(), url


async def _connect(session: Any, admin_url: str, elsewhere: Any = None) -> bool:
    """The user connects the account in the console (POST start, then the browser's redirects). With
    ``elsewhere`` (another browser), the authorization server's redirect is first followed there."""
    for page in ("/ui/connect", "/ui/connect.js"):  # what the browser loads first (under the console's CSP)
        async with session.get(admin_url + page) as response:
            if response.status != 200 or "script-src 'self'" not in response.headers.get("Content-Security-Policy",
                                                                                          ""):
                print(json.dumps({"connect": "page_unavailable", "reason": page}))
                return False
    async with session.post(f"{admin_url}/v1/connections/{CREDENTIAL}/start") as response:
        answer = await response.json()
    if response.status != 200:
        error = answer.get("error") or {}
        print(json.dumps({"connect": error.get("code"), "reason": (error.get("details") or {}).get("reason")}))
        return False
    callback = f"{admin_url}/connect/callback"
    url = answer["authorization_url"]
    if elsewhere is not None:
        status, page, url = await _follow(elsewhere, url, callback)
        print(json.dumps({"elsewhere": "connected" if 'data-connected="true"' in page else "not connected",
                          "page": re.sub(r"<[^>]+>", " ", page).strip()[:120]}))
    status, page, _ = await _follow(session, url, callback)
    connected = status == 200 and 'data-connected="true"' in page
    print(json.dumps({"connect": "connected" if connected else "not connected",
                      "page": re.sub(r"<[^>]+>", " ", page).strip()[:200]}))
    return connected


async def _call(session: Any, agent_url: str, arguments: Any, calls: int = 1) -> dict[str, Any]:
    """``calls`` calls at once; the first failed envelope, else the last (each is printed)."""
    async def one(index: int) -> dict[str, Any]:
        async with session.post(f"{agent_url}/v1/tool-calls", json={"call_id": f"call_{index}", "tool": TOOL,
                                                                     "arguments": arguments}) as response:
            envelope = await response.json()
        print(json.dumps(envelope))
        return envelope

    envelopes = await asyncio.gather(*(one(index) for index in range(1, calls + 1)))
    return next((e for e in envelopes if e.get("outcome") != "succeeded"), envelopes[-1])


async def _connected(session: Any, admin_url: str) -> bool:
    async with session.get(f"{admin_url}/v1/connections") as response:
        rows = (await response.json())["connections"]
    return any(row["credential"] == CREDENTIAL and row["connected"] for row in rows)


async def _revocations(runtime: Any, session: Any, admin_url: str, agent_url: str, arguments: Any) -> int:
    """The grant's ends: a revoked token (the upstream refuses it; no refresh token), a disconnection.
    Each is followed by a call, which must ask the user to connect; the grant must be gone."""
    import aiohttp

    from ..credentials.mcp_grants import Owner

    identity = runtime.config.identity
    owner = Owner(identity.static_tenant, identity.static_subject, CREDENTIAL)
    store = runtime.user_grants.store
    record = await store.get(owner)
    record["tokens"] = {**record["tokens"], "access_token": f"revoked-{secrets.token_hex(8)}"}
    record["tokens"].pop("refresh_token", None)
    await store.put(owner, record)
    runtime.user_grants.forget_sources()  # as after a restart: the next call reads the grant from Redis
    steps = {"revoked": (await _call(session, agent_url, arguments)).get("error", {}) or {}}
    steps["revoked"]["still_connected"] = await _connected(session, admin_url)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as elsewhere:
        # the authorization URL sent to someone else's browser cannot connect their account to this user
        if not await _connect(session, admin_url, elsewhere):
            return 1
    steps["reconnected"] = {"outcome": (await _call(session, agent_url, arguments)).get("outcome")}
    async with session.delete(f"{admin_url}/v1/connections/{CREDENTIAL}") as response:
        steps["disconnected"] = {"status": response.status}
    steps["disconnected"].update((await _call(session, agent_url, arguments)).get("error", {}) or {})
    print(json.dumps({"revocations": {step: {k: v for k, v in value.items() if k in (
        "code", "resolution", "still_connected", "outcome", "status")} for step, value in steps.items()}}))
    return 0


async def _drive(args: argparse.Namespace, runtime: Any, grant: str, admin_url: str, agent_url: str) -> int:
    """What the scenario asks of the running proxy: connect the user (authorization code), call, connect again
    when the agent is asked to, then (``--then-revoke``) the grant's ends. 0 when the calls succeeded."""
    import aiohttp

    # the browser keeps the connection's cookie (set for 127.0.0.1: an address, hence ``unsafe``)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        if grant == "authorization_code" and not await _connect(session, admin_url):
            return 1
        arguments = json.loads(args.arguments)
        envelope = await _call(session, agent_url, arguments, args.calls)
        code = (envelope.get("error") or {}).get("code")
        if code == "user_grant_required" and grant == "authorization_code":
            # the agent asks the user to connect (here: for the scope the upstream asked for), then calls again
            if not await _connect(session, admin_url):
                return 1
            envelope = await _call(session, agent_url, arguments)
        if envelope.get("outcome") == "succeeded" and args.then_revoke and grant == "authorization_code":
            return await _revocations(runtime, session, admin_url, agent_url, arguments)
        return 0 if envelope.get("outcome") == "succeeded" else 1


async def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from ..config import ConfigError, load_config
    from ..fronts.admin_api import admin_app
    from ..fronts.app import agent_app
    from ..process.runtime import create_runtime
    from ..telemetry.logs import configure as configure_logging

    configure_logging("warning", "json")
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    scenario = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
    grant = args.grant or ("client_credentials" if "client-credentials" in scenario else "authorization_code")
    agent_socket, admin_socket = _free_socket(), _free_socket()
    admin_url = f"http://127.0.0.1:{admin_socket.getsockname()[1]}"
    agent_url = f"http://127.0.0.1:{agent_socket.getsockname()[1]}"
    with tempfile.TemporaryDirectory(prefix="toolproxy-mcp-auth-") as tmp:
        work = Path(tmp)
        credential = await _credential(args, context, grant, work, f"{admin_url}/connect/callback")
        registry = _write(work, "registry.yaml", _registry(args.url, args.tool))
        try:
            config = load_config(args.config, overrides={
                "registry.paths": [registry], "identity.mode": "static", "registry.reload_interval_ms": 0,
                # its own keys: runs side by side on one Redis (the suite runs its scenarios at once) stay apart
                "redis.key_prefix": f"toolproxy-mcp-auth-check-{secrets.token_hex(6)}",
                "credentials": {CREDENTIAL: credential}})
            runtime = await create_runtime(config)
        except (ConfigError, OSError) as exc:
            print(f"toolproxy could not start: {exc}", file=sys.stderr)
            return 2
        runners = []
        try:
            for app, sock in ((agent_app(runtime), agent_socket), (admin_app(runtime), admin_socket)):
                runner = web.AppRunner(app)
                await runner.setup()
                await web.SockSite(runner, sock).start()
                runners.append(runner)
            return await _drive(args, runtime, grant, admin_url, agent_url)
        finally:
            for runner in runners:
                await runner.cleanup()
            await runtime.close()


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
