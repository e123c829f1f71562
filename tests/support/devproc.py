"""The dev stack as the reader runs it: ``toolproxy dev`` in a subprocess, on free ports.

``DevStack().start()`` runs ``python -m proxy.cli dev`` (real OPA, Redis, demo
backend and proxy processes), waits (bounded) for its banner and reads the
console URL and the dev approver/operator token from it; ``stop()`` is
SIGTERM (the dev command stops its children) with a bounded wait.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.servers import free_port

REPO = Path(__file__).resolve().parent.parent.parent


class DevStack:
    def __init__(self) -> None:
        self.ports = {name: free_port() for name in ("proxy", "admin", "ops", "opa", "redis", "backend")}
        self._log_path = Path(tempfile.mkdtemp(prefix="toolproxy-devstack-")) / "dev.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.console_url = ""
        self.token = ""

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def backend_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['backend']}"

    @property
    def opa_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['opa']}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['ops']}"

    def start(self, bound_s: float = 60.0) -> "DevStack":
        command = [sys.executable, "-m", "proxy.cli", "dev"]
        for name, port in self.ports.items():
            command += [f"--{name}-port", str(port)]
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"toolproxy dev exited:\n{self.log()}"
            match = re.search(r"console\s+(http://\S+/ui)\s+\(paste the dev approver/operator token there:\s+(\S+) \)",
                              self.log(limit=100000))
            if match and self._ready():
                self.console_url, self.token = match.group(1), match.group(2)
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"toolproxy dev not up within {bound_s}s:\n{self.log()}")

    def _ready(self) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"{self.ops_url}/readyz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def log(self, limit: int = 4000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""
