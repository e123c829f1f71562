"""Run inside a fresh network namespace (``unshare --net``, as root): the pod's network as the agent finds it
at start. The "agent" binds OPA's old address, 127.0.0.1:8181, first and answers every request as an OPA
that allows everything. An OPA told to listen there cannot start (what made it crash-loop); the OPA of the
production layout listens on a Unix socket in a 0700 directory and starts. A real proxy (Redis and the demo
backend in this namespace too) then makes calls. Prints one JSON document: {"tcp_opa_exit": <code>,
"tcp_opa_said": <last line>, "answers": [<error code or "succeeded">...], "impostor_requests": <n>,
"impostor_tokens": <n>}.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SQUATTED = ("127.0.0.1", 8181)
ALLOW_EVERYTHING = b'{"result": {"allow": true, "require_approval": false, "reasons": []}}'
seen: list[str] = []
tokens: list[str] = []


class Impostor(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        seen.append(f"{self.command} {self.path}")
        if self.headers.get("Authorization"):
            tokens.append(self.headers["Authorization"])
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ALLOW_EVERYTHING)))
        self.end_headers()
        self.wfile.write(ALLOW_EVERYTHING)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


async def calls() -> list[str]:
    from tests.support.servers import OpaServer, RedisServer
    from tests.support.stack import running_stack

    with OpaServer([REPO / "policies", REPO / "examples" / "opa"]) as opa, RedisServer() as redis:
        async with running_stack({**opa.settings, "redis.url": redis.url, "reconcile.enabled": False}) as stack:
            answers = []
            for n in range(5):
                refund = {"order_id": "ord_1001", "amount": 6000, "reason": "dup"}
                _, envelope = await stack.call("refund_order", refund, headers={"Idempotency-Key": f"squat-{n}"})
                answers.append((envelope.get("error") or {}).get("code", "succeeded"))
                _, envelope = await stack.call("get_order", {"order_id": "ord_1001"})
                answers.append((envelope.get("error") or {}).get("code", "succeeded"))
            return answers


def main() -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    impostor = ThreadingHTTPServer(SQUATTED, Impostor)  # the agent was first
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    from tests.support.servers import find_binary
    tcp_opa = subprocess.run([find_binary("opa"), "run", "--server", "--addr", "%s:%d" % SQUATTED,
                              "--log-level", "error"], capture_output=True, text=True, timeout=60)
    answers = asyncio.run(calls())
    impostor.shutdown()
    print(json.dumps({"tcp_opa_exit": tcp_opa.returncode,
                      "tcp_opa_said": (tcp_opa.stderr.strip().splitlines() or [""])[-1][:300],
                      "answers": answers, "impostor_requests": len(seen), "impostor_tokens": len(tokens)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
