"""Per-user grants are sealed to their owner; the MCP credential kinds name what they lack; a challenge is a 401 or
a 403 that asks for scope; the SDK's private names the MCP OAuth module relies on are there."""

from __future__ import annotations

import base64
import inspect

import httpx2
import pytest
from mcp.client.auth import OAuthClientProvider

from proxy.config import ConfigError, load_config
from proxy.credentials.mcp_grants import Owner, Sealer, grant_required, read_grant_key
from proxy.credentials.mcp_oauth import OAuthClientSpec, is_challenge

pytestmark = pytest.mark.unit

KEY = bytes(range(32))


def test_a_grant_opens_only_for_its_owner_and_key():
    sealer = Sealer(KEY)
    ann, bob = Owner("acme", "ann", "github"), Owner("acme", "bob", "github")
    blob = sealer.seal({"tokens": {"access_token": "canary-access"}}, ann.associated_data)
    assert b"canary-access" not in blob
    assert sealer.open(blob, ann.associated_data) == {"tokens": {"access_token": "canary-access"}}
    assert sealer.open(blob, bob.associated_data) is None  # moved to another user's key: does not open
    assert sealer.open(blob, Owner("other", "ann", "github").associated_data) is None
    assert Sealer(bytes(32)).open(blob, ann.associated_data) is None  # another key
    tampered = blob[:-1] + bytes([blob[-1] ^ 1])
    assert sealer.open(tampered, ann.associated_data) is None
    assert sealer.seal({}, ann.associated_data) != sealer.seal({}, ann.associated_data)  # a fresh nonce each time


def test_owner_digest_names_no_one_in_clear():
    owner = Owner("acme", "ann@example.com", "github")
    assert "ann" not in owner.digest and len(owner.digest) == 64
    assert owner.digest != Owner("acme", "ann@example.com", "slack").digest


def test_grant_keys_are_32_bytes_of_base64():
    assert read_grant_key(base64.b64encode(KEY).decode() + "\n") == KEY
    for bad in ("not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(ValueError):
            read_grant_key(bad)


def test_the_grant_refusal_tells_the_agent_to_ask_the_user_and_carries_no_url():
    error = grant_required("github")
    assert error.code == "user_grant_required" and error.spec.resolution == "ask_user"
    assert error.attempted is False and "http" not in error.message and error.details == {"credential": "github"}


def test_secrets_stay_out_of_a_client_spec_repr():
    spec = OAuthClientSpec(grant="client_credentials", client_id="c", auth_method="private_key_jwt",
                           issuer="https://as.example", client_secret="canary-secret", private_key_pem="canary-key")
    assert "canary" not in repr(spec)


def _response(status: int, www: str | None = None) -> httpx2.Response:
    return httpx2.Response(status, headers={"WWW-Authenticate": www} if www else {},
                           request=httpx2.Request("POST", "http://u/mcp"))


def test_a_challenge_is_a_401_or_a_403_asking_for_scope():
    assert is_challenge(_response(401))
    assert is_challenge(_response(403, 'Bearer error="insufficient_scope", scope="a b"'))
    assert not is_challenge(_response(403, 'Bearer error="invalid_token"'))
    assert not is_challenge(_response(403)) and not is_challenge(_response(200))


def load(entry):
    return load_config(env={}, overrides={"credentials": {"k": entry}})


@pytest.mark.parametrize("entry, message", [
    ({"kind": "mcp_client_credentials"}, r"credentials.k.client_id: kind mcp_client_credentials needs it"),
    ({"kind": "mcp_client_credentials", "client_id": "c"}, r"credentials.k.issuer: kind mcp_client_credentials"),
    ({"kind": "mcp_client_credentials", "client_id": "c", "issuer": "https://as"},
     r"client_secret_file: client_auth client_secret_basic needs it"),
    ({"kind": "mcp_client_credentials", "client_id": "c", "issuer": "https://as", "client_auth": "private_key_jwt"},
     r"private_key_file: client_auth private_key_jwt needs it"),
    ({"kind": "mcp_client_credentials", "client_id": "c", "issuer": "https://as", "client_auth": "none"},
     r"client_auth: none \(a public client\) is for kind mcp_authorization_code only"),
    ({"kind": "mcp_authorization_code"}, r"credentials.k.resource: kind mcp_authorization_code needs it"),
    ({"kind": "mcp_authorization_code", "resource": "https://mcp/x", "redirect_uri": "https://c/connect/callback"},
     r"grant_key_file: kind mcp_authorization_code needs it"),
    ({"kind": "mcp_authorization_code", "resource": "https://mcp/x", "redirect_uri": "https://c/cb",
      "grant_key_file": "/k", "client_id": "pre"}, r"issuer: a configured client_id belongs to one"),
    ({"kind": "mcp_authorization_code", "resource": "mcp.example", "redirect_uri": "https://c/cb",
      "grant_key_file": "/k"}, r"resource: 'mcp.example' is not an http\(s\) URL"),
])
def test_the_mcp_kinds_name_what_they_lack(entry, message):
    with pytest.raises(ConfigError, match=message):
        load(entry)


def test_a_dynamically_registered_public_client_needs_no_secret():
    config = load({"kind": "mcp_authorization_code", "resource": "https://mcp.example/mcp",
                   "redirect_uri": "https://console.example/connect/callback", "grant_key_file": "/k"})
    assert config.credentials["k"].client_id == ""


def test_the_private_names_the_mcp_oauth_module_overrides_are_the_sdks():
    """``proxy.credentials.mcp_oauth`` overrides ``_validate_resource_match`` (a reason of its own for a resource
    mismatch) and reads ``context`` (the provider's tokens); ``mcp`` is pinned exactly (test_mcp_private_names)."""
    source = inspect.getsource(OAuthClientProvider)
    assert "async def _validate_resource_match(self, prm: ProtectedResourceMetadata) -> None:" in source
    assert "await self._validate_resource_match(prm)" in source
    assert "self.context = OAuthContext(" in source
    context_source = inspect.getsource(inspect.getmodule(OAuthClientProvider).OAuthContext)
    for name in ("current_tokens", "token_expiry_time", "def is_token_valid"):
        assert name in context_source


def _registry(tmp_path, backend: str):
    from proxy.registry import load_registry
    path = tmp_path / "tools.yaml"
    path.write_text(f"""tools:
  - name: t
    version: "1.0.0"
    description: A tool.
    mode: read
    risk: read
    inputSchema: {{type: object, additionalProperties: false}}
    backend: {backend}
""")
    return load_registry([str(path)])


@pytest.mark.parametrize("backend, credential, message", [
    ('{type: http, url: "https://api.example/x", auth: k}', {"kind": "mcp_client_credentials"},
     "kind mcp_client_credentials is for MCP upstreams"),
    ('{type: mcp, url: "https://mcp.example/mcp", tool: x, auth: k}', {"kind": "tls"},
     "kind tls cannot ride an MCP upstream"),
    ('{type: mcp, url: "https://other.example/mcp", tool: x, auth: k}',
     {"kind": "mcp_authorization_code", "resource": "https://mcp.example/mcp"}, "users connect their accounts to"),
    ('{type: mcp, url: "https://mcp.example/mcp", tool: x, auth: k, pin: {definition: "sha256:' + "0" * 64 +
     '", tool_list: "sha256:' + "0" * 64 + '"}}',
     {"kind": "mcp_authorization_code", "resource": "https://mcp.example/mcp"}, "a pinned tool"),
])
def test_a_registry_naming_an_mcp_credential_that_cannot_serve_it_is_refused(tmp_path, backend, credential,
                                                                             message):
    from types import SimpleNamespace

    from proxy.credentials.references import check_references
    from proxy.registry import RegistryError

    entry = SimpleNamespace(**{"tls_cert_file": "", "tls_ca_file": "", "resource": "", **credential})
    with pytest.raises(RegistryError, match=message):
        check_references(_registry(tmp_path, backend), {"k": entry}, {})
