"""Spring Authorization Server (tests/authserver, built by scripts/setup.sh) for delegation: RFC 8693 token
exchange with an actor token, recorded in the new token's ``act`` claim.

``AuthServer`` starts the built jar on a free loopback port (bounded), and ``user_token()`` signs alice in the way
a person does: the authorization code flow with a form login (driven here over HTTP, no browser), then the code
exchanged at the token endpoint. ``exchanges()`` is the server's own count of the token exchanges it issued.
"""

from __future__ import annotations

import base64
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urljoin, urlsplit

import aiohttp

from tests.support.servers import ServerStartError, free_port, stop_group

PROXY_SECRET = "sas-canary-proxy-secret-6e5d4c3b2a19"
AGENT_SECRET = "sas-agent-secret-0a9b8c7d"
USER_PASSWORD = "alice-sas-password-1b2c"
REDIRECT_URI = "http://127.0.0.1:1/callback"  # never followed: the code is read from the redirect itself
START_TIMEOUT_S = float(os.environ.get("TOOLPROXY_AUTHSERVER_START_S", "120"))


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def authserver_jar() -> Path | None:
    link = Path(__file__).resolve().parents[2] / ".venv" / "authserver.jar"
    return link if link.exists() else None


class AuthServer:
    def __init__(self, jar: Path, directory: Path) -> None:
        self.jar, self.directory = jar, directory
        self.port = free_port()
        self.issuer = self.url = f"http://127.0.0.1:{self.port}"
        self.token_url = f"{self.url}/oauth2/token"
        self.jwks_url = f"{self.url}/oauth2/jwks"
        self.log = directory / "authserver.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "AuthServer":
        env = {**os.environ, "AUTHSERVER_PROXY_SECRET": PROXY_SECRET, "AUTHSERVER_AGENT_SECRET": AGENT_SECRET,
               "AUTHSERVER_USER_PASSWORD": USER_PASSWORD, "AUTHSERVER_REDIRECT_URI": REDIRECT_URI}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["java", "-XX:TieredStopAtLevel=1", "-Xmx256m", "-jar", str(self.jar), f"--server.port={self.port}",
                 f"--spring.security.oauth2.authorizationserver.issuer={self.issuer}"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"the authorization server exited ({self.proc.returncode}); see {self.log}")
            try:
                self.exchanges()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"the authorization server did not answer within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)  # the launcher and the JVM it started

    def exchanges(self) -> int:
        with urllib.request.urlopen(f"{self.url}/test/exchanges", timeout=2) as response:
            return int(response.read())

    async def user_token(self, username: str = "alice") -> str:
        """alice's access token for the agent (audience toolproxy): authorization code flow with a form login."""
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=timeout) as session:
            url = (f"{self.url}/oauth2/authorize?response_type=code&client_id=agent-app&scope=crm.read"
                   f"&redirect_uri={REDIRECT_URI}")
            async with session.get(url, allow_redirects=False) as response:
                assert response.status == 302, response.status  # to the login page, the request saved
            async with session.post(f"{self.url}/login", data={"username": username, "password": USER_PASSWORD},
                                    allow_redirects=False) as response:
                location = response.headers["Location"]
            for _ in range(5):  # back to the saved authorize request, then to the client with the code
                if location.startswith(REDIRECT_URI):
                    break
                async with session.get(urljoin(self.url, location), allow_redirects=False) as response:
                    location = response.headers["Location"]
            code = parse_qs(urlsplit(location).query)["code"][0]
            async with session.post(self.token_url, data={"grant_type": "authorization_code", "code": code,
                                                          "redirect_uri": REDIRECT_URI},
                                    headers={"Authorization": basic("agent-app", AGENT_SECRET)}) as response:
                body = await response.json()
        return body["access_token"]
