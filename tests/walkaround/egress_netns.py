"""Run inside a fresh network namespace (``unshare --net``, as root): three listeners stand in for a tool
backend, Redis and OPA, ``toolproxy egress-rules --apply`` installs the guard for them from a proxy
config, and a connection is tried to each as several UIDs. Prints one JSON document:
{"rules": <nft ruleset>, "results": {"<uid>": {"<peer>": "connected" | "refused" | "timeout"}}}.

Usage: python egress_netns.py PROXY_UID OTHER_UID [OTHER_UID ...]
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (socket encodes host names with it; a child after setuid may not read it)
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # the kernel completes handshakes into the backlog: no accept loop needed
    return sock


def try_connect(uid: int, port: int) -> str:
    """Connect as ``uid`` in a forked child (setgid/setuid there); the child's exit code is the answer."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.create_connection(("127.0.0.1", port), timeout=3):
                code = 0
        except ConnectionRefusedError:
            code = 1
        except OSError:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 1: "refused", 2: "timeout"}.get(os.waitstatus_to_exitcode(status), "error")


def main(argv: list[str]) -> int:
    proxy_uid, others = int(argv[0]), [int(a) for a in argv[1:]]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    socks = {name: listener() for name in ("backend", "redis", "opa", "unguarded")}
    ports = {name: sock.getsockname()[1] for name, sock in socks.items()}
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "config.yaml"
        config.write_text(json.dumps({  # JSON is YAML
            "backends": {"services": {"demo": f"http://127.0.0.1:{ports['backend']}"}},
            "redis": {"url": f"redis://127.0.0.1:{ports['redis']}/0"},
            "opa": {"url": f"http://127.0.0.1:{ports['opa']}"},
            "registry": {"paths": [str(REPO / "examples" / "registry")]}}))
        applied = subprocess.run([sys.executable, "-m", "proxy.cli", "egress-rules", "--uid", str(proxy_uid),
                                  "--config", str(config), "--apply"], cwd=REPO, capture_output=True, text=True,
                                 timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        if applied.returncode != 0:
            print(json.dumps({"error": applied.stderr}))
            return 1
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
    results = {str(uid): {name: try_connect(uid, port) for name, port in ports.items()}
               for uid in [proxy_uid, *others]}
    print(json.dumps({"rules": ruleset, "ports": ports, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
