"""docs/getting-started.md runs as written: its commands, taken from the page itself, against a real dev stack.

The page marks each fenced block it means to be run with an HTML comment just above it:

  ``<!-- guide: stack -->``            ``./scripts/dev.sh [ARGS]``: (re)start the dev stack with ARGS
  ``<!-- guide: file PATH -->``        write the block to PATH
  ``<!-- guide: background waits-for PORT -->``  start the block in the background, wait until PORT listens
  ``<!-- guide: run expect "TEXT" ... -->``  run the block with bash (-euo pipefail); it must exit 0 and
                                       print every TEXT

The reader's clone is a scratch directory: ``policies/`` and ``examples/`` copied (the guide edits
them), the rest linked to this repository. What the harness changes, and only that: the fixed ports
(8787, 8788, 9464, 6390, 8790 and the guide's backend 8085) become free ones, so the test runs
beside anything else on the machine; ``./scripts/dev.sh`` (set-up, then ``toolproxy dev``) becomes
``toolproxy dev`` (the test session is set up), given the scratch clone's policies and OPA data; the
``export NAME='...'`` lines the banner prints are exported for the commands, as the page tells its reader
to do; and after a new file under ``policies/`` it waits until OPA serves it (the page says a saved file
applies at once; a person types slower than a script). ``PYTHONPATH`` names this checkout, whose
environment the scratch clone borrows.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.servers import free_port, stop_group

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "getting-started.md"
MARKED = re.compile(r"<!-- guide: (?P<marker>[^\n]*?) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)
DEV_PORTS = {"proxy": 8787, "admin": 8788, "ops": 9464, "redis": 6390, "backend": 8790}  # OPA: a Unix socket
BACKEND_PORT = 8085  # the guide's own backend
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Step:
    kind: str
    args: tuple[str, ...]
    body: str


def steps(text: str) -> list[Step]:
    found = []
    for match in MARKED.finditer(text):
        kind, *args = shlex.split(match["marker"])
        found.append(Step(kind, tuple(args), match["body"]))
    return found


def test_the_guide_marks_its_commands():
    """A block that looks like a command the reader runs is marked, so the run below covers the page."""
    text = GUIDE.read_text(encoding="utf-8")
    marked = {m["body"] for m in MARKED.finditer(text)}
    unmarked = [b for b in re.findall(r"```(?:sh|python|yaml|rego)\n(.*?)```", text, flags=re.S) if b not in marked]
    assert not unmarked
    kinds = [s.kind for s in steps(text)]
    assert kinds[0] == "stack" and kinds.count("run") >= 10 and set(kinds) == {"stack", "file", "background", "run"}


class Reader:
    """The newcomer's two terminals: the dev stack in one, everything else in the other."""

    def __init__(self, clone: Path) -> None:
        self.clone = clone
        self.ports = {name: free_port() for name in DEV_PORTS}
        self.backend_port = free_port()
        self.opa_admin_token = secrets.token_urlsafe(16)
        self.env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
                    "TOOLPROXY_OPA_ADMIN_TOKEN": self.opa_admin_token}
        self.stack: subprocess.Popen[bytes] | None = None
        self.opa_socket = ""  # read from the banner
        self.log = clone / "stack.log"
        self.background: list[subprocess.Popen[bytes]] = []

    def localize(self, text: str) -> str:
        mapping = {DEV_PORTS[name]: port for name, port in self.ports.items()} | {BACKEND_PORT: self.backend_port}
        text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{mapping.get(int(m[1]), m[1])}", text)
        return re.sub(rf"\b{BACKEND_PORT}\b", str(self.backend_port), text)  # the backend's own port= too

    def start_stack(self, command: str) -> None:
        self.stop_stack()
        argv = shlex.split(command.replace("\\\n", " "))
        assert argv[0] == "./scripts/dev.sh", argv
        argv = [str(VENV_BIN / "python"), "-m", "proxy.cli", "dev", *argv[1:],
                *[f"--{n}-port={p}" for n, p in self.ports.items()],
                "--policies", str(self.clone / "policies"), "--opa-data", str(self.clone / "examples" / "opa")]
        log = self.log.open("wb")
        self.stack = subprocess.Popen(argv, cwd=self.clone, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                      start_new_session=True)
        deadline = time.monotonic() + 90
        while "stack is up" not in self.log.read_text(errors="replace"):
            assert self.stack.poll() is None, self.log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the dev stack printed no banner in 90 s"
            time.sleep(0.2)
        banner = self.log.read_text(errors="replace")
        exported = dict(re.findall(r"export (\w+)='([^']*)'", banner))
        assert {"APPROVER", "TOOLPROXY_REDIS_PASSWORD"} <= set(exported), banner
        self.env.update(exported)
        self.opa_socket = re.search(r"OPA\s+unix://(\S+)", banner)[1]
        self.wait_listening(self.ports["proxy"], self.stack)

    def stop_stack(self) -> None:
        for proc in [*self.background, *([self.stack] if self.stack else [])]:
            stop_group(proc)
        self.background.clear()
        self.stack = None

    def wait_listening(self, port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"exited with {proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout} s"
                time.sleep(0.1)

    def write(self, path: str, body: str) -> None:
        target = self.clone / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.localize(body))
        if path.startswith("policies/") and self.stack is not None:
            self.wait_opa_serves(path)

    def wait_opa_serves(self, path: str) -> None:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # OPA's socket, as the banner names it
                sock.settimeout(5)
                sock.connect(self.opa_socket)
                sock.sendall(f"GET /v1/policies HTTP/1.0\r\nHost: localhost\r\n"
                             f"Authorization: Bearer {self.opa_admin_token}\r\n\r\n".encode())
                answer = b"".join(iter(lambda: sock.recv(65536), b""))
            if path.encode() in answer:
                return
            assert time.monotonic() < deadline, f"OPA did not load {path} in 20 s"
            time.sleep(0.2)

    def run_background(self, body: str, port: str) -> None:
        log = self.clone / f"background-{len(self.background)}.log"
        proc = subprocess.Popen(["bash", "-c", self.localize(body)], cwd=self.clone, env=self.env,
                                stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.background.append(proc)
        try:
            self.wait_listening(self.backend_port if int(port) == BACKEND_PORT else int(port), proc)
        except AssertionError as failed:
            raise AssertionError(f"{failed}: {body}\n{log.read_text(errors='replace')[-3000:]}") from None

    def run(self, body: str) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", self.localize(body)], cwd=self.clone,
                              env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{body}\n-> exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout


@pytest.fixture
def clone(tmp_path):
    root = tmp_path / "toolproxy"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name in {"policies", "examples"}:
            shutil.copytree(entry, root / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        elif entry.name not in {".git", ".venv"}:
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.prefix))  # the environment this test runs in (scripts/setup.sh's)
    return root


def test_the_getting_started_guide_runs_as_written(clone):
    assert shutil.which("jq") and shutil.which("curl"), "the guide's commands use curl and jq"
    reader = Reader(clone)
    ran = []
    try:
        for step in steps(GUIDE.read_text(encoding="utf-8")):
            if step.kind == "stack":
                reader.start_stack(step.body.strip())
            elif step.kind == "file":
                reader.write(step.args[0], step.body)
            elif step.kind == "background":
                assert step.args[0] == "waits-for", step.args
                reader.run_background(step.body, step.args[1])
            else:
                assert step.kind == "run" and step.args[::2] == ("expect",) * (len(step.args) // 2), step.args
                out = reader.run(step.body)
                missing = [text for text in step.args[1::2] if text not in out]
                assert not missing, f"{step.body}\nprinted:\n{out}"
            ran.append(step.kind)
    finally:
        reader.stop_stack()
    assert ran.count("run") >= 10
