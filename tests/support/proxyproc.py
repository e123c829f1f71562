"""A real ``toolproxy run`` process for tests that need more than one proxy, or to kill one.

``ProxyProcess(settings)`` starts ``python -m proxy.cli run`` with every
setting passed as a ``TOOLPROXY_*`` environment variable (the way a pod gets
them), on free ports; ``await ready()`` polls ``/readyz`` with a bound;
``kill()`` is SIGKILL (no cleanup at all: the point of crash tests);
``stop()`` is SIGTERM with a bounded wait. Output goes to a log file whose
tail ``log()`` returns for failure messages.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import aiohttp

from tests.support.calltokens import session_keys
from tests.support.servers import free_port, mac_key_file

REPO = Path(__file__).resolve().parent.parent.parent


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def fleet_key_env() -> dict[str, str]:
    """The two key files `toolproxy run` refuses to start without, as environment variables: the test run's
    record MAC key and call-token signing key (one fleet, one of each)."""
    return {"TOOLPROXY_INTEGRITY_MAC_KEY_FILE": mac_key_file(),
            "TOOLPROXY_CALL_TOKENS_SIGNING_KEY_FILE": str(session_keys().key_file)}


class LoggedProcess:
    """A child process whose output goes to a log file; stopped with SIGTERM and a bounded wait."""

    stop_grace_s = 10.0

    def __init__(self, log_name: str) -> None:
        self._log_path = Path(tempfile.mkdtemp(prefix="toolproxy-proc-")) / log_name
        self.proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def log(self, limit: int = 4000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class ProxyProcess(LoggedProcess):
    def __init__(self, settings: Mapping[str, Any], *, stdout_pipe: bool = False,
                 merge_stderr: bool = False) -> None:
        super().__init__("proxy.log")
        self.stdout_pipe = stdout_pipe  # stdout (the audit records) to a pipe the test reads, or never reads
        self.merge_stderr = merge_stderr  # with stdout_pipe: the log lines (stderr) into that same pipe
        self.port, self.admin_port, self.ops_port = free_port(), free_port(), free_port()
        merged = {"listen.port": self.port, "admin.port": self.admin_port, "ops.port": self.ops_port,
                  "log.level": "info", "identity.mode": "static",
                  # `toolproxy run` needs both keys: every process of a test run is one fleet with one of each
                  "integrity.mac_key_file": mac_key_file(), **session_keys().settings(),
                  **settings}
        self.env = {**os.environ, **{"TOOLPROXY_" + k.replace(".", "_").upper(): _env_value(v)
                                     for k, v in merged.items()}}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ProxyProcess":
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, env=self.env,
                                         stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE if self.stdout_pipe else log,
                                         stderr=subprocess.STDOUT if self.merge_stderr or not self.stdout_pipe
                                         else log)
        return self

    async def ready(self, bound_s: float = 60.0) -> None:  # a loaded 2-core machine takes 20 s to start one
        deadline = time.monotonic() + bound_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, f"toolproxy exited:\n{self.log()}"
                try:
                    async with session.get(f"http://127.0.0.1:{self.ops_port}/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError(f"toolproxy not ready within {bound_s}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to record anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
