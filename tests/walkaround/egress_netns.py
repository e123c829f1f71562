"""Run inside a fresh network namespace (``unshare --net``, as root): loopback carries two more addresses
(a peer reached by a second address, as a Service's pod IP beside its ClusterIP), listeners stand in for a
peer of the proxy (a tool backend or Redis), the proxy's agent and admin ports, the agent's model API (on an
address of its own, allow-listed) and a DNS server; ``toolproxy egress-rules --apply`` installs the guard,
and a connection is tried to each as several UIDs. Prints one JSON document:
{"rules": <nft ruleset>, "results": {"<uid>": {"<target>": "connected" | "refused" | "timeout"}}}.

Usage: python egress_netns.py PROXY_UID OTHER_UID [OTHER_UID ...]
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (socket encodes host names with it; a child after setuid may not read it)
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECOND, THIRD, MODEL = "10.77.0.1", "10.77.0.2", "10.77.0.9"  # more addresses of this namespace (on lo)


def listener(address: str = "0.0.0.0", port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(64)  # the kernel completes handshakes into the backlog: no accept loop needed
    return sock


def try_connect(uid: int, address: str, port: int) -> str:
    """Connect as ``uid`` in a forked child (setgid/setuid there); the child's exit code is the answer."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.create_connection((address, port), timeout=3):
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
    for address in (SECOND, THIRD, MODEL):
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    socks = {"peer": listener(), "agent_port": listener(), "admin": listener(), "model": listener(MODEL),
             "dns": listener("127.0.0.1", 53)}
    ports = {name: sock.getsockname()[1] for name, sock in socks.items()}
    targets = {"peer": ("127.0.0.1", ports["peer"]), "peer_second_address": (SECOND, ports["peer"]),
               "peer_third_address": (THIRD, ports["peer"]), "agent_port": ("127.0.0.1", ports["agent_port"]),
               "admin": ("127.0.0.1", ports["admin"]), "model": (MODEL, ports["model"]),
               "dns": ("127.0.0.1", 53)}
    applied = subprocess.run([sys.executable, "-m", "proxy.cli", "egress-rules", "--uid", str(proxy_uid),
                              "--agent-port", str(ports["agent_port"]), "--allow", f"{MODEL}/32:{ports['model']}",
                              "--apply"], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    if applied.returncode != 0:
        print(json.dumps({"error": applied.stderr}))
        return 1
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
    results = {str(uid): {name: try_connect(uid, *target) for name, target in targets.items()}
               for uid in [proxy_uid, *others]}
    print(json.dumps({"rules": ruleset, "ports": ports, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
