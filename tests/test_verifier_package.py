"""toolproxy-verifier, installed alone: a backend team's clean virtualenv gets the verifier and its
middlewares from the wheel ``packages/toolproxy-verifier`` builds, with PyJWT[crypto] and rfc8785 and
nothing of the proxy, and verifies the token of a real call the proxy sent.

Offline: the wheel is built here without build isolation (the environment's locked setuptools), and the
dependencies come from the wheels ``scripts/setup.sh`` fetched into the tools cache (the locked versions,
hashes checked); pip is told ``--no-index``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from tests.support.stack import running_stack

REPO = Path(__file__).resolve().parent.parent
TOOLS_CACHE = Path(os.environ.get("TOOLPROXY_TOOLS_CACHE")
                   or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "toolproxy" / "tools")
WHEELS = TOOLS_CACHE / "verifier-wheels"

BACKEND_CHECK = r'''
import json, sys
from pathlib import Path

from toolproxy_verifier.middleware import AsgiCallTokens, Expect  # the ASGI middleware needs nothing more
from toolproxy_verifier.verifier import CallTokenVerifier, JwksFile, Refused

jwks, token, body = sys.argv[1], Path(sys.argv[2]).read_text(), Path(sys.argv[3]).read_bytes()
facts = CallTokenVerifier(JwksFile(jwks), audience="demo").verify(token, tool="get_order", body=body)
seen = {"tool": facts.tool, "tenant": facts.tenant, "subject": facts.subject, "scope": facts.scope}
for name, verifier, tool, sent in [
        ("other_arguments", CallTokenVerifier(JwksFile(jwks), audience="demo"), "get_order",
         body.replace(b"ord_1001", b"ord_2001")),
        ("other_tool", CallTokenVerifier(JwksFile(jwks), audience="demo"), "refund_order", body),
        ("other_backend", CallTokenVerifier(JwksFile(jwks), audience="payments"), "get_order", body)]:
    try:
        verifier.verify(token, tool=tool, body=sent)
        seen[name] = "accepted"
    except Refused as refused:
        seen[name] = refused.reason
print(json.dumps(seen))
'''


def run(argv: list[str], **kw) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def test_the_verifier_alone_in_a_clean_venv_verifies_a_real_call(tmp_path, proxy_deps):
    assert len(list(WHEELS.glob("*.whl"))) >= 5, f"{WHEELS} holds no verifier wheels: run scripts/setup.sh"
    dist = tmp_path / "dist"
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
         str(REPO / "packages" / "toolproxy-verifier")], env=offline)
    venv = tmp_path / "backend-venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--find-links", str(WHEELS),
         "--find-links", str(dist), "toolproxy-verifier"], env=offline)

    installed = {d["name"].lower() for d in json.loads(run([sys.executable, "-m", "pip", "--python", python, "list",
                                                             "--format", "json"], env=offline))}
    assert installed == {"toolproxy-verifier", "pyjwt", "cryptography", "cffi", "pycparser", "rfc8785"}
    isolated = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}  # no PYTHONPATH: the clean venv alone
    for absent in ("proxy", "aiohttp", "redis", "mcp"):
        done = subprocess.run([python, "-c", f"import {absent}"], capture_output=True, text=True, env=isolated,
                              cwd=tmp_path, timeout=60)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, absent

    # A real call through the proxy, to a backend that keeps what it received.
    received: list[tuple[str, bytes]] = []

    async def get_order(request: web.Request) -> web.Response:
        received.append((request.headers["Txn-Token"], await request.read()))
        return web.json_response({"order_id": "ord_1001", "tenant": "acme", "status": "paid", "total": 100,
                                  "refundable": 100, "currency": "USD"})

    app = web.Application()
    app.router.add_post("/tools/get_order", get_order)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        backend = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with running_stack({**proxy_deps, "backends.services": {"demo": backend}}) as stack:
            status, envelope = await stack.post("/v1/tool-calls", {"call_id": "c1", "tool": "get_order",
                                                                   "arguments": {"order_id": "ord_1001"}})
            assert status == 200 and envelope["outcome"] == "succeeded", envelope
            async with stack.session.get(stack.ops_url + "/.well-known/jwks.json") as response:
                (tmp_path / "jwks.json").write_bytes(await response.read())
    finally:
        await runner.cleanup()
    [(token, body)] = received
    (tmp_path / "token").write_text(token)
    (tmp_path / "body").write_bytes(body)
    (tmp_path / "check.py").write_text(BACKEND_CHECK)

    seen = json.loads(run([python, str(tmp_path / "check.py"), str(tmp_path / "jwks.json"), str(tmp_path / "token"),
                           str(tmp_path / "body")], env=isolated, cwd=tmp_path))
    assert seen == {"tool": "get_order", "tenant": "acme", "subject": "dev-user", "scope": "tool:call",
                    "other_arguments": "wrong_arguments", "other_tool": "wrong_tool", "other_backend": "wrong_audience"}
