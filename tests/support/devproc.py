"""The dev stack as the reader runs it: ``toolproxy dev`` in a subprocess, on free ports.

``DevStack().start()`` runs ``python -m proxy.cli dev`` (real OPA, Redis, demo
backend and proxy processes), waits (bounded) for its banner and reads the
console URL and the dev approver/operator token from it; ``stop()`` is
SIGTERM (the dev command stops its children) with a bounded wait.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.proxyproc import LoggedProcess
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parent.parent.parent


class DevStack(LoggedProcess):
    stop_grace_s = 20.0  # it stops four children first

    def __init__(self) -> None:
        super().__init__("dev.log")
        self.ports = {name: free_port() for name in ("proxy", "admin", "ops", "redis", "backend")}
        base = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.agent_url, self.admin_url, self.ops_url = base["proxy"], base["admin"], base["ops"]
        self.backend_url = base["backend"]
        self.opa_socket = ""  # OPA's Unix socket, read from the banner
        self.console_url = ""
        self.token = ""
        # OPA answers the proxy's token only; this one (full access) lets a test edit its policy data.
        self.opa_admin_token = secrets.token_urlsafe(32)
        self.opa_headers = {"Authorization": f"Bearer {self.opa_admin_token}"}

    def start(self, bound_s: float = 60.0) -> "DevStack":
        command = [sys.executable, "-m", "proxy.cli", "dev"]
        for name, port in self.ports.items():
            command += [f"--{name}-port", str(port)]
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              "TOOLPROXY_OPA_ADMIN_TOKEN": self.opa_admin_token})
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"toolproxy dev exited:\n{self.log()}"
            match = re.search(r"console\s+(http://\S+/ui)\s+\(paste the dev approver/operator token there:\s+(\S+) \)",
                              self.log(limit=100000))
            opa = re.search(r"OPA\s+unix://(\S+)", self.log(limit=100000))
            if match and opa and self._ready():
                self.console_url, self.token = match.group(1), match.group(2)
                self.opa_socket = opa.group(1)
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"toolproxy dev not up within {bound_s}s:\n{self.log()}")

    async def put_opa(self, path: str, document: object) -> int:
        """PUT a document into the stack's OPA (over its Unix socket, with the full-access token): the status."""
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.opa_socket)) as session:
            async with session.put("http://localhost" + path, json=document, headers=self.opa_headers) as answer:
                return answer.status

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.ops_url}/readyz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False
