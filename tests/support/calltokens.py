"""Call-token keys for tests: the proxy's signing key and the demo backend's JWKS, generated per session.

Tests generate their own keys (nothing is committed): ``session_keys()`` is one Ed25519 key pair per
test process, written to a temporary directory; ``settings()`` points a proxy at it and ``jwks`` is what
the demo backend verifies with. ``token()`` signs a token the way the proxy does, for tests that call the
demo backend directly (and for the walk-around tests, which sign with keys the backend does not know).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from examples.demo_backend import AUDIENCE, route
from proxy.calltokens import keys as token_keys
from proxy.calltokens.signer import CallTokenSigner
from toolproxy_verifier.verifier import arguments_hash


class TestKeys:
    __test__ = False  # not a test class

    def __init__(self, directory: Path, *, alg: str = "EdDSA", kid: str = "") -> None:
        self.key = token_keys.signing_key(token_keys.generate(alg), kid)
        self.kid = self.key.kid
        self.key_file = directory / f"{self.kid}.pem"
        self.key_file.write_bytes(token_keys.private_pem(self.key.private))
        self.key_file.chmod(0o600)
        self.jwks = token_keys.jwks(self.key)
        self.jwks_file = directory / f"{self.kid}.jwks.json"
        import json
        self.jwks_file.write_text(json.dumps(self.jwks))
        self.signer = CallTokenSigner(self.key, issuer="toolproxy")

    def settings(self) -> dict[str, Any]:
        return {"call_tokens.signing_key_file": str(self.key_file), "call_tokens.key_id": self.kid}

    def token(self, tool: str, body: bytes = b"", *, scope: str = "tool:call", key: str | None = None,
              tenant: str = "acme", subject: str = "dev-user", agent: str = "dev-agent", audience: str = AUDIENCE,
              budget_s: float | None = 60.0, now: float | None = None, txn: str | None = None,
              args_hash: str | None = None, **context: Any) -> str:
        tctx: dict[str, Any] = {"tool": tool, "version": "1.0.0", **context}
        if scope == "tool:call":
            tctx["args_hash"] = arguments_hash(body) if args_hash is None else args_hash
        if key is not None:
            tctx["idempotency_key"] = key
        return self.signer.sign(audience=audience, scope=scope, txn=txn or key or uuid.uuid4().hex,
                                subject=subject, tenant=tenant, agent=agent, context=tctx, budget_s=budget_s,
                                now=now)

    def headers_for(self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None,
                    tenant: str = "acme") -> dict[str, str]:
        """``headers`` plus a valid Txn-Token for a direct request to the demo backend."""
        out = dict(headers or {})
        expect = route(method, path.split("?")[0])
        if expect is not None and "Txn-Token" not in out:
            key = expect.key if expect.scope != "tool:call" else out.get("Idempotency-Key")
            tool = expect.tool if isinstance(expect.tool, str) else expect.tool[0]
            fence = out.get("X-Fencing-Token", "")
            context = {"fencing_token": int(fence)} if fence.isascii() and fence.isdigit() else {}
            out["Txn-Token"] = self.token(tool, body, scope=expect.scope, key=key, tenant=tenant, **context)
        return out


def demo_aliases(tools: Any) -> dict[str, str]:
    """Contracts of the registry (``ToolContract``s) served by a demo tool's route under another name
    (contract name -> demo tool), for ``DemoState.aliases``: their call tokens name the contract."""
    from examples.demo_backend import TOOLS
    aliases = {}
    for tool in tools:
        path = tool.backend.path or ""
        served = path.removeprefix("/tools/")
        if tool.backend.type == "http" and path.startswith("/tools/") and served in TOOLS and served != tool.name:
            aliases[tool.name] = served
    return aliases


_SESSION: dict[str, TestKeys] = {}


def session_keys() -> TestKeys:
    """The test process's call-token keys (made on first use, removed at exit)."""
    if "keys" not in _SESSION:
        directory = Path(tempfile.mkdtemp(prefix="toolproxy-calltokens-"))
        atexit.register(shutil.rmtree, directory, True)
        _SESSION["keys"] = TestKeys(directory, kid="test-proxy-key")
    return _SESSION["keys"]
