"""Helpers that run real OPA and Redis servers as subprocesses for tests.

Plain synchronous code (no pytest import) so fixtures, benchmarks and ad-hoc
scripts can all use it. Binaries are looked up in the active virtualenv first
(``scripts/setup.sh`` symlinks ``opa``, ``helm`` and ``redis-server`` into
``.venv/bin``), then on ``PATH``.

Every wait is bounded; ``stop()`` terminates, waits, then kills.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from proxy.authoring import devstack
from proxy.policy.opa_control import AUTHZ_POLICY
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = [
    "BinaryNotFound",
    "ServerStartError",
    "free_port",
    "find_binary",
    "OpaServer",
    "RedisServer",
    "mac_key_file",
    "session_server",
    "stop_group",
]

DEFAULT_START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0


class BinaryNotFound(RuntimeError):
    """A required server binary is not installed."""


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready in time."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def mac_key_file() -> str:
    """The record MAC key of this test process (a file of 64 hex characters), generated once: every proxy a
    test run starts, in process or not, shares it, as the proxies of a fleet do."""
    path = Path(tempfile.mkdtemp(prefix="toolproxy-mac-")) / "mac.key"
    path.write_text(secrets.token_hex(32))
    return str(path)


def find_binary(name: str) -> str:
    """Find ``name`` in ``<sys.prefix>/bin`` first, then on ``PATH`` (the same lookup as ``toolproxy dev``)."""
    try:
        return devstack.find_binary(name)
    except FileNotFoundError as exc:
        raise BinaryNotFound(str(exc)) from None


def _stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started (``toolproxy dev``'s
    OPA, Redis and backend): SIGTERM to its group, SIGKILL when it has not ended in 20 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def session_server(artifact: Path | None, missing: str, make: Callable[[Path], Any]) -> Iterator[Any]:
    """A fixture's body for a server built by scripts/setup.sh (``artifact``): ``make(artifact).start()`` once,
    yielded, stopped after; BinaryNotFound saying ``missing`` when setup did not build it."""
    if artifact is None:
        raise BinaryNotFound(missing)
    server = make(artifact).start()
    try:
        yield server
    finally:
        server.stop()


def _read_log(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


class _Server:
    """Common process handling: start, bounded readiness poll, stop."""

    name = "server"

    def __init__(self, port: int | None, start_timeout: float) -> None:
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._logdir = Path(tempfile.mkdtemp(prefix=f"toolproxy-{self.name}-log-"))
        self._log_path = self._logdir / f"{self.name}.log"
        self._log_file = None

    # subclasses provide these
    def _command(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        """The process's environment (None: this process's)."""
        return None

    def _is_ready(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> "_Server":
        """Start the process (on the same port as before) and wait until ready."""
        if self.running:
            return self
        self._log_file = open(self._log_path, "ab")
        self._proc = subprocess.Popen(
            self._command(),
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._close_log()
                raise ServerStartError(
                    f"{self.name} exited with code {code} during startup "
                    f"(cmd: {' '.join(self._command())}).\n{_read_log(self._log_path)}"
                )
            try:
                if self._is_ready():
                    return self
            except BinaryNotFound:
                self.stop()
                raise
            except Exception:
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerStartError(
                    f"{self.name} on port {self.port} not ready after "
                    f"{self.start_timeout:.0f}s.\n{_read_log(self._log_path)}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the process (terminate, bounded wait, then kill). Idempotent."""
        try:
            _stop_process(self._proc)
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log(self) -> str:
        """Tail of the server's combined stdout/stderr, for debugging failures."""
        return _read_log(self._log_path)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix socket (the standard library's client, connected to a path)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class OpaServer(_Server):
    """A real ``opa run --server`` listening, as in production, on a Unix socket in a directory of its own
    (mode 0700: only this user reaches it); ``url`` is ``unix://<path>``, what ``opa.url`` takes.
    ``tcp=True`` binds 127.0.0.1:``port`` instead (``url`` is then ``http://...``; a proxy run by
    ``toolproxy run`` needs ``opa.allow_tcp`` for it).

    ``paths`` are policy/data files or directories loaded at startup (they
    must exist). ``watch=True`` adds ``--watch`` so edits on disk are reloaded.

    ``auth=True`` (the default) runs it as the chart and the dev stack do: ``--authentication=token
    --authorization=basic`` with proxy/policy/opa_authz.rego, which admits the proxy's ``token`` (in
    ``token_file``; ``settings`` points a proxy at it) on the decision path only. The test helpers here
    (``put_policy``, ``put_data``, ``query``) use ``admin_token``, a second token with full access that
    only tests and the dev stack set.
    """

    name = "opa"

    def __init__(
        self,
        paths: Iterable[str | os.PathLike] = (),
        *,
        watch: bool = False,
        port: int | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        auth: bool = True,
        decision_path: str = "toolproxy/decision",
        start_timeout: float = DEFAULT_START_TIMEOUT,
        tcp: bool = False,
    ) -> None:
        super().__init__(port, start_timeout)
        # A short private path (a socket path has at most 107 bytes): not the log directory, which a test may read.
        self.socket_path = None if tcp else str(Path(tempfile.mkdtemp(prefix="toolproxy-opa-")) / "opa.sock")
        self.binary = binary or find_binary("opa")
        self.paths = [str(p) for p in paths]
        self.watch = watch
        self.extra_args = list(extra_args)
        self.auth = auth
        self.decision_path = decision_path  # the one data path the proxy's token may query
        self.token = secrets.token_urlsafe(32)
        self.admin_token = secrets.token_urlsafe(32)
        self.token_file = str(self._logdir / "opa-token")
        Path(self.token_file).write_text(self.token)

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}" if self.socket_path else f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """``--addr`` of the opa process."""
        return f"unix://{self.socket_path}" if self.socket_path else f"127.0.0.1:{self.port}"

    def start(self) -> "OpaServer":
        if self.socket_path and not self.running and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a killed opa: it would refuse to bind
        super().start()
        return self

    @property
    def settings(self) -> dict[str, str]:
        """The proxy's ``opa.*`` settings for this server (its URL and, with auth, its token file)."""
        return {"opa.url": self.url, **({"opa.token_file": self.token_file} if self.auth else {})}

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers for a test's own request to OPA's API (data, policies, metrics)."""
        return {"Authorization": f"Bearer {self.admin_token}"} if self.auth else {}

    def _env(self) -> dict[str, str] | None:
        if not self.auth:
            return None
        return {**os.environ, "TOOLPROXY_OPA_TOKEN": self.token, "TOOLPROXY_OPA_ADMIN_TOKEN": self.admin_token,
                "TOOLPROXY_OPA_CATALOG_PUSH": "true", "TOOLPROXY_OPA_DECISION_PATH": self.decision_path}

    def _command(self) -> list[str]:
        cmd = [
            self.binary,
            "run",
            "--server",
            "--addr",
            self.address,
            "--log-level",
            "error",
        ]
        if self.watch:
            cmd.append("--watch")
        if self.auth:
            cmd += ["--authentication=token", "--authorization=basic", str(AUTHZ_POLICY)]
        cmd += self.extra_args
        cmd += self.paths
        return cmd

    def _is_ready(self) -> bool:
        status, _ = self._request("GET", "/health", timeout=1.0)
        return status == 200

    # -- HTTP helpers -----------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                timeout: float = 5.0) -> tuple[int, bytes]:
        """One request to this OPA (over its socket or port): (status, body). ``headers``: the admin token's
        unless given."""
        connection = (_UnixConnection(self.socket_path, timeout) if self.socket_path
                      else http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout))
        try:
            connection.request(method, path, body=body,
                               headers=self.admin_headers if headers is None else headers)
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
        timeout: float = 5.0,
    ) -> tuple[int, Any]:
        headers = {**self.admin_headers, **({"Content-Type": content_type} if body is not None else {})}
        status, raw = self.request(method, path, body, headers, timeout)
        parsed: Any = None
        if raw:
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
        return status, parsed

    def _check(self, what: str, status: int, body: Any) -> Any:
        if status >= 300:
            raise RuntimeError(f"OPA {what} failed: HTTP {status}: {body}")
        return body

    def put_policy(self, policy_id: str, rego: str) -> None:
        """Create or replace a policy module (``PUT /v1/policies/<id>``)."""
        status, body = self._request(
            "PUT", f"/v1/policies/{policy_id}", rego.encode(), "text/plain"
        )
        self._check(f"put_policy({policy_id!r})", status, body)

    def delete_policy(self, policy_id: str) -> None:
        status, body = self._request("DELETE", f"/v1/policies/{policy_id}")
        if status != 404:
            self._check(f"delete_policy({policy_id!r})", status, body)

    def put_data(self, path: str, value: Any) -> None:
        """Create or replace a document (``PUT /v1/data/<path>``)."""
        status, body = self._request(
            "PUT", f"/v1/data/{path.strip('/')}", json.dumps(value).encode()
        )
        self._check(f"put_data({path!r})", status, body)

    def query(self, path: str, input: Any = None) -> Any:
        """``POST /v1/data/<path>`` with optional input; returns ``result`` (or None)."""
        payload = {} if input is None else {"input": input}
        status, body = self._request(
            "POST", f"/v1/data/{path.strip('/')}", json.dumps(payload).encode()
        )
        body = self._check(f"query({path!r})", status, body)
        return (body or {}).get("result")


class RedisServer(_Server):
    """A real ``redis-server`` (or ``valkey-server``) bound to 127.0.0.1.

    Persistence is off by default; pass ``extra_args=["--appendonly", "yes"]``
    for restart tests. ``start()`` after ``stop()`` reuses the same port and
    data directory, so persisted data survives a restart.

    ``password`` turns AUTH on (``requirepass``: the default user's password); ``users`` are ACL rules
    (``"toolproxy on >secret ~toolproxy:* +get"``), one user each. ``url`` never carries credentials;
    ``client()`` (the test's own inspection) authenticates as the default user.
    """

    name = "redis"

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        data_dir: str | os.PathLike | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        password: str | None = None,
        users: Sequence[str] = (),
    ) -> None:
        super().__init__(port, start_timeout)
        self.password = password
        self.users = list(users)
        self.binary = binary or find_binary("redis-server")
        self.extra_args = list(extra_args)
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="toolproxy-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            # A state store never evicts (proxy/eviction.py refuses any other policy); tests that need
            # another policy pass it in extra_args.
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(self.data_dir),
            *(["--requirepass", self.password] if self.password else []),
            *[part for user in self.users for part in ("--user", *user.split())],
            *self.extra_args,  # later options override earlier ones
        ]

    def client(self, **kwargs):
        """A sync ``redis.Redis`` client for this server (caller closes it)."""
        try:
            import redis  # imported lazily so this module imports without it
        except ImportError as e:
            raise BinaryNotFound(
                "the 'redis' Python package is required to talk to RedisServer; "
                "it should come with `pip install -e '.[test]'` (scripts/setup.sh)"
            ) from e
        if self.password:
            kwargs.setdefault("password", self.password)
        return redis.Redis.from_url(self.url, **kwargs)

    def _is_ready(self) -> bool:
        c = self.client(socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(c.ping())
        finally:
            c.close()

    def flushall(self) -> None:
        c = self.client(socket_timeout=5)
        try:
            c.flushall()
        finally:
            c.close()
