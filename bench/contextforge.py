"""IBM ContextForge (``mcp-contextforge-gateway``) in front of the benchmark's upstream MCP server.

Optional (``bench.floor --contextforge``): installed into ``.tools/contextforge`` by
``scripts/setup.sh --contextforge``. Started with fresh secrets, SQLite in the run's directory,
UI and admin UI off, its rate limiter off (by default it allows 100 tool calls a minute and then locks
the caller out) and its logs at ERROR; the upstream is registered as a gateway with a
platform-admin token, and the case calls its tool through the gateway's JSON-RPC endpoint (``/rpc``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.servers import REPO
from tests.support.servers import free_port

VENV = REPO / ".tools" / "contextforge"
ADMIN = "admin@example.com"


def start(procs: Any, workdir: Path, upstream_url: str, case_type: Any) -> Any:
    from bench.floor import post, wait_http
    if not (VENV / "bin" / "mcpgateway").exists():
        raise RuntimeError("ContextForge is not installed: scripts/setup.sh --contextforge")
    port = free_port()
    env = {**os.environ,
           "JWT_SECRET_KEY": secrets.token_hex(32), "AUTH_ENCRYPTION_SECRET": secrets.token_hex(32),
           "BASIC_AUTH_PASSWORD": "Bench-" + secrets.token_hex(8) + "!",
           "PLATFORM_ADMIN_EMAIL": ADMIN, "PLATFORM_ADMIN_PASSWORD": "Bench-" + secrets.token_hex(8) + "!",
           "DATABASE_URL": f"sqlite:///{workdir}/contextforge.db", "MCPGATEWAY_UI_ENABLED": "false",
           "MCPGATEWAY_ADMIN_API_ENABLED": "false", "LOG_LEVEL": "ERROR", "DEV_MODE": "true",
           "CACHE_TYPE": "memory", "SSRF_PROTECTION_ENABLED": "false", "SSRF_ALLOW_LOCALHOST": "true",
           "SSRF_ALLOW_PRIVATE_NETWORKS": "true",
           # Its rate limiter (100 tool calls a minute, then a lockout) would measure the limiter, not the path.
           "RATE_LIMITING_ENABLED": "false", "TOOL_RATE_LIMIT": "1000000"}
    proc = procs.spawn("contextforge", [str(VENV / "bin" / "mcpgateway"), "--host", "127.0.0.1", "--port",
                                        str(port)], env=env, cwd=workdir)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc, bound_s=180)
    token = subprocess.run([str(VENV / "bin" / "python"), "-m", "mcpgateway.utils.create_jwt_token", "--username",
                            ADMIN, "--admin", "--exp", "600", "--secret", env["JWT_SECRET_KEY"]], env=env,
                           capture_output=True, text=True, timeout=120, cwd=workdir).stdout.strip().splitlines()[-1]
    auth = {"Authorization": f"Bearer {token}"}
    status, _, text = post(base + "/gateways", json.dumps({"name": "bench", "url": upstream_url,
                                                          "transport": "STREAMABLEHTTP"}), auth)
    if status >= 300:
        raise RuntimeError(f"ContextForge refused the gateway: HTTP {status} {text[:300]}")
    deadline = time.monotonic() + 60
    name = None
    while name is None and time.monotonic() < deadline:
        status, _, text = post(base + "/rpc", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}), auth)
        tools = (json.loads(text).get("result") or {}).get("tools", []) if status == 200 else []
        name = next((t["name"] for t in tools if t["name"].endswith("lookup")), None)
        if name is None:
            time.sleep(1)
    if name is None:
        raise RuntimeError(f"ContextForge lists no lookup tool: {text[:300]}")
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": name, "arguments": {"key": "k1"}}})
    return case_type("ContextForge: read via MCP upstream", base + "/rpc", body, "value-of-k1",
                     lambda: proc.pid, headers=auth)
