"""Token exchange with delegation against Spring Authorization Server (tests/authserver, built by setup.sh).

Keycloak's standard token exchange ignores ``actor_token``; Spring Authorization Server records it. With
``actor_token: true`` the proxy sends its own access token (client credentials of the same client) as the actor:
the backend receives a token whose ``sub`` is alice and whose ``act.sub`` names the proxy's client, and verifies it
against the server's keys. One exchange serves 30 calls (the server's own count).
"""

from __future__ import annotations

import asyncio

import aiohttp
import jwt
import pytest

from tests.support import authserver as sas
from tests.support.credential_backends import VerifyingBackend, echo_tool, write_file
from tests.support.servers import session_server
from tests.support.stack import running_stack


@pytest.fixture(scope="session")
def authserver(tmp_path_factory):
    missing = "the authorization server is not built: run scripts/setup.sh (it links .venv/authserver.jar)"
    yield from session_server(sas.authserver_jar(), missing,
                              lambda jar: sas.AuthServer(jar, tmp_path_factory.mktemp("as")))


async def test_the_backend_sees_the_user_with_the_proxy_as_its_actor(proxy_deps, tmp_path, authserver, issuers):
    crm = await VerifyingBackend(authserver.issuer, authserver.jwks_url, "crm").start()
    try:
        overrides = {
            **proxy_deps, "identity.mode": "jwt", "identity.agent_id": "agent-under-test",
            "identity.jwt": {"issuer": authserver.issuer, "audience": "toolproxy", "jwks_url": authserver.jwks_url,
                             "algorithms": ["RS256"], "claim_scopes": "toolproxy_scopes"},
            "registry.paths": [write_file(tmp_path / "tools.yaml", "tools:\n" + echo_tool("crm_echo", "crm",
                                                                                          "crm-on-behalf"))],
            "backends.services": {"crm": crm.url},
            "credentials": {"crm-on-behalf": {
                "kind": "token_exchange", "token_url": authserver.token_url, "client_id": "toolproxy",
                "client_secret_file": write_file(tmp_path / "cs", sas.PROXY_SECRET), "audience": "crm",
                "actor_token": True}}}
        user_token = await authserver.user_token("alice")
        before = authserver.exchanges()
        async with running_stack(overrides) as stack:
            stack.headers["Authorization"] = f"Bearer {user_token}"
            results = []
            for batch in range(3):
                results += await asyncio.gather(*(stack.call("crm_echo", {"text": f"{batch}-{i}"}) for i in range(10)))
            failed = [body["error"] for _, body in results if body["outcome"] != "succeeded"]
            assert not failed, failed[:2]
            async with aiohttp.ClientSession() as session:  # the agent's own token, straight to the backend
                async with session.post(crm.url + "/echo", json={"text": "direct"},
                                        headers={"Authorization": f"Bearer {user_token}"}) as response:
                    assert response.status == 401
        assert authserver.exchanges() - before == 1
        assert {(c["sub"], c["aud"] if isinstance(c["aud"], str) else tuple(c["aud"]), c["act"]["sub"])
                for c in crm.claims} == {("alice", "crm", "toolproxy")}
        assert jwt.decode(user_token, options={"verify_signature": False})["sub"] == "alice"
    finally:
        await crm.stop()
