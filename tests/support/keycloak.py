"""A real Keycloak (its server distribution, scripts/setup.sh puts it in the tools cache) for the credential tests.

``KeycloakServer`` starts ``kc.sh start-dev`` on a free loopback port with an in-memory database, bounded in time,
then creates the test realm through Keycloak's own admin API: users ``alice`` and ``bob``, whose tokens (password
grant of the public client ``agent-app``) are for the proxy (audience ``toolproxy``, claims ``tenant``, ``roles``,
``toolproxy_scopes``); the proxy's confidential client ``toolproxy`` (client credentials, standard token exchange
on, may exchange for the audience ``crm``); ``toolproxy-post`` (client_secret_post) and ``toolproxy-jwt``
(private_key_jwt, its certificate made here). Events are stored, so the test counts the exchanges in Keycloak's own
event log. ``stop()`` terminates, waits, then kills.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from tests.support.servers import ServerStartError, free_port, stop_group

REALM = "acme"
CLIENT_SECRET = "kc-canary-client-secret-7d1e9a2b4c6f"
POST_SECRET = "kc-canary-post-secret-3b5d7f9a1c2e"
USER_PASSWORD = "alice-password-4f6a8c"
START_TIMEOUT_S = float(os.environ.get("TOOLPROXY_KEYCLOAK_START_S", "300"))  # a first start builds, on 2 busy cores


def keycloak_home() -> Path | None:
    """The distribution scripts/setup.sh unpacked (``.venv/keycloak`` links to it), or None."""
    link = Path(__file__).resolve().parents[2] / ".venv" / "keycloak"
    return link if (link / "bin" / "kc.sh").exists() else None


def _hardcoded(name: str, claim: str, value: str) -> dict[str, Any]:
    return {"name": name, "protocol": "openid-connect", "protocolMapper": "oidc-hardcoded-claim-mapper",
            "config": {"claim.name": claim, "claim.value": value, "jsonType.label": "String",
                       "access.token.claim": "true", "id.token.claim": "false", "userinfo.token.claim": "false"}}


def _audience(name: str, client: str) -> dict[str, Any]:
    return {"name": name, "protocol": "openid-connect", "protocolMapper": "oidc-audience-mapper",
            "config": {"included.client.audience": client, "access.token.claim": "true", "id.token.claim": "false"}}


class KeycloakServer:
    def __init__(self, home: Path, directory: Path) -> None:
        self.home, self.directory = home, directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.issuer = f"{self.url}/realms/{REALM}"
        self.token_url = f"{self.issuer}/protocol/openid-connect/token"
        self.jwks_url = f"{self.issuer}/protocol/openid-connect/certs"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "keycloak.log"
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.jwt_client_key = str(directory / "toolproxy-jwt-key.pem")
        Path(self.jwt_client_key).write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "toolproxy-jwt")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
        self._jwt_client_cert = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()

    # -- process ---------------------------------------------------------------------------------------------

    def start(self) -> "KeycloakServer":
        env = {**os.environ, "KC_BOOTSTRAP_ADMIN_USERNAME": "admin", "KC_BOOTSTRAP_ADMIN_PASSWORD": "admin-pw",
               "JAVA_OPTS_APPEND": "-XX:TieredStopAtLevel=1 -Xshare:auto"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(self.home / "bin" / "kc.sh"), "start-dev", f"--http-port={self.port}", "--http-host=127.0.0.1",
                 "--db=dev-mem", "--cache=local", "--http-management-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"keycloak exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/realms/master", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        else:
            self.stop()
            raise ServerStartError(f"keycloak did not answer within {START_TIMEOUT_S:.0f} s; see {self.log}")
        self._create_realm()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)  # the launcher and the JVM it started

    # -- admin API -------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, *, form: dict[str, str] | None = None,
                 token: str | None = None) -> Any:
        data, headers = None, {}
        if form is not None:
            data = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        elif body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def admin_token(self) -> str:
        return self._request("POST", "/realms/master/protocol/openid-connect/token",
                             form={"grant_type": "password", "client_id": "admin-cli", "username": "admin",
                                   "password": "admin-pw"})["access_token"]

    def _create_realm(self) -> None:
        agent_mappers = [_audience("aud-toolproxy", "toolproxy"), _hardcoded("tenant", "tenant", "acme"),
                         _hardcoded("roles", "roles", "agent"),
                         _hardcoded("scopes", "toolproxy_scopes", "tools:read tools:write")]
        realm = {
            "realm": REALM, "enabled": True, "eventsEnabled": True, "adminEventsEnabled": False,
            "enabledEventTypes": ["TOKEN_EXCHANGE", "TOKEN_EXCHANGE_ERROR", "CLIENT_LOGIN", "CLIENT_LOGIN_ERROR"],
            "accessTokenLifespan": 300,
            "users": [{"username": name, "enabled": True, "email": f"{name}@acme.test", "emailVerified": True,
                       "firstName": name.title(), "lastName": "Acme",
                       "credentials": [{"type": "password", "value": USER_PASSWORD, "temporary": False}]}
                      for name in ("alice", "bob")],
            "clients": [
                {"clientId": "agent-app", "publicClient": True, "directAccessGrantsEnabled": True,
                 "standardFlowEnabled": False, "protocolMappers": agent_mappers},
                {"clientId": "toolproxy", "publicClient": False, "secret": CLIENT_SECRET,
                 "clientAuthenticatorType": "client-secret", "serviceAccountsEnabled": True,
                 "standardFlowEnabled": False, "directAccessGrantsEnabled": False,
                 "attributes": {"standard.token.exchange.enabled": "true"},
                 "protocolMappers": [_audience("aud-crm", "crm")]},
                {"clientId": "toolproxy-post", "publicClient": False, "secret": POST_SECRET,
                 "clientAuthenticatorType": "client-secret", "serviceAccountsEnabled": True,
                 "standardFlowEnabled": False},
                {"clientId": "toolproxy-jwt", "publicClient": False, "clientAuthenticatorType": "client-jwt",
                 "serviceAccountsEnabled": True, "standardFlowEnabled": False,
                 "attributes": {"jwt.credential.certificate": self._jwt_client_cert, "use.jwks.url": "false",
                                "token.endpoint.auth.signing.alg": "RS256"}},
                {"clientId": "crm", "publicClient": False, "bearerOnly": False, "standardFlowEnabled": False,
                 "secret": "crm-secret-unused"},
            ],
        }
        self._request("POST", "/admin/realms", realm, token=self.admin_token())

    def user_token(self, username: str = "alice") -> str:
        return self._request("POST", f"/realms/{REALM}/protocol/openid-connect/token",
                             form={"grant_type": "password", "client_id": "agent-app", "username": username,
                                   "password": USER_PASSWORD})["access_token"]

    def events(self, kind: str) -> list[dict[str, Any]]:
        """Keycloak's own event log of the realm: events of ``kind`` (e.g. TOKEN_EXCHANGE, CLIENT_LOGIN)."""
        return self._request("GET", f"/admin/realms/{REALM}/events?type={kind}&max=1000",
                             token=self.admin_token()) or []
