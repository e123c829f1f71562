"""Cost per call next to the floor of its own hops, measured side by side in one run.

Starts its own real processes on loopback — OPA (repo policies + demo data),
Redis, the demo backend, a trivial upstream MCP server (``bench.mcp_upstream``),
the bare two-hop floor (``bench.floor_hop``) and ``toolproxy run`` with its
default configuration (static identity, as ``toolproxy dev``) — and drives
them with ``wrk`` (a C load generator, so the proxy gets the interpreter).
Every case runs once per round, sequentially (1 connection) and at 16
connections; rounds interleave the cases and the table shows medians over
rounds, so one run gives ratios that hold on a noisy machine.

    .venv/bin/python -m bench.floor [--rounds 5] [--seconds 4] [--before DIR] [--proxy-src DIR] [--contextforge]

Columns: sequential p50/p99 (ms), calls/s and p99 at 16 connections, the
serving process's CPU per call (``/proc/<pid>/stat`` utime+stime over the
16-connection run), OPA queries per call (OPA's own ``/metrics``), Redis
commands per call (``INFO commandstats`` deltas: top-level commands, not the
ones inside scripts; minus the idle rate of background sweeps, shown
below the table) and Redis round trips per call (``total_reads_processed``:
a pipeline counts once), and the answers over all runs of the case that were not a success
(an overloaded machine shows here: e.g. ``dependency_unavailable`` when Redis answers too late).

``--tracing`` adds two more proxies exporting OpenTelemetry spans to a sink (``bench.otlp_sink``): one with
the default sampler (parent-based, 10% of calls without a sampled traceparent), one at 100%; their "JSON
read" rows sit beside the untraced one (docs/observability.md#traces).

``--before DIR`` also runs a proxy from another checkout beside this one, against the same OPA, Redis and
backends: every case of the proxy is measured on both, back to back in each round (which one first alternates),
and each case's CPU per call and p50 after / before is the median over rounds of that round's ratio, so one run
compares two trees on the same machine load. ``--proxy-src DIR`` runs the proxy from another checkout (the
"before" table of separate runs);
``--contextforge`` also fronts the upstream MCP server with IBM ContextForge
from ``.tools/contextforge`` (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from bench import results
from bench.results import Ratio, fmt
from bench.servers import REPO
from tests.support.servers import OpaServer, RedisServer, free_port, mac_key_file

CLIENT_META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "wrk", "version": "0"}}
WIRE_FLOOR = "floor: two hops on the proxy's wire"
FLOW_RECORD = "JSON read labelled (flow record)"
FLOW_READ = "JSON read of an external sink (flow read)"
PROVENANCE_RECORD = "JSON read labelled and fingerprinted (provenance record)"
PROVENANCE_READ = "JSON read of a sink naming its target (provenance read)"
PINNED_READ = "read via pinned MCP upstream"
CREDENTIAL_READ = "JSON read with a credential"
BEFORE = " [before]"  # --before: a case's twin on the other checkout's proxy
CONTRACT_ALIASES = ["--alias", "flow_labelled_order=get_order", "--alias", "flow_sink_order=get_order",
                    "--alias", "flow_source_order=get_order", "--alias", "flow_target_order=get_order",
                    "--alias", "credentialed_order=get_order"]
_ORDER_CONTRACT = """
    version: "1.0.0"
    description: get_order for the flow stage's bench cases.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_id]
      properties: {order_id: {type: string, pattern: "^ord_[A-Za-z0-9]+$", maxLength: 64}}
    resources: [{template: "order:{order_id}", access: none}]
    timeout_ms: 2000
    backend: {type: http, service: demo, path: /tools/get_order}
"""
FLOW_TOOLS = ("tools:\n  - name: flow_labelled_order" + _ORDER_CONTRACT + "    flow: {produces: [private]}\n"
              "  - name: flow_sink_order" + _ORDER_CONTRACT + "    flow: {sink: external}\n"
              # the same two with argument provenance (proxy/provenance.py): the labelled read's output is also
              # fingerprinted (a trusted source, so the sink case below is not held), the sink looks its
              # order_id up; both inside the same flow.record / flow.read as the cases above
              "  - name: flow_source_order" + _ORDER_CONTRACT + "    flow: {produces: [private], trusted_source: true}\n"
              "  - name: flow_target_order" + _ORDER_CONTRACT + "    flow: {sink: external, sink_arguments: [order_id]}\n"
              # get_order with a bearer key the proxy attaches per call (proxy/credentials): what a credential costs
              "  - name: credentialed_order" + _ORDER_CONTRACT.replace(
                  "path: /tools/get_order}", "path: /tools/get_order, auth: bench-key}"))
MODERN_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
                  "Mcp-Method": "tools/call"}

# One Lua script for every case: a fixed request, or a unique one per call (``unique``); counts answers
# missing the case's success marker; prints one JSON line of results.
WRK_LUA = r"""
local body, path, marker, unique, run = %(body)s, %(path)s, %(marker)s, %(unique)s, %(run)s
local headers = %(headers)s
local threads, next_id = {}, 1
function setup(thread)
  thread:set("tid", next_id); next_id = next_id + 1
  table.insert(threads, thread)
end
local n = 0
bad = 0  -- a global: done() reads it from each thread
function init(args) tid = wrk.thread:get("tid") end
local pool, used = {}, 0  -- one header set per request, read from a file (tokens that are good once)
if %(pool)s ~= "" then
  for line in io.lines(%(pool)s) do
    local key, token = string.match(line, "^(%%S+) (%%S+)$")
    table.insert(pool, {key, token})
  end
end
function request()
  if #pool > 0 then
    used = used + 1
    local entry = pool[((used - 1) %% #pool) + 1]  -- past the pool's end a token repeats: counted as bad
    headers["Idempotency-Key"], headers["Txn-Token"] = entry[1], entry[2]
  end
  if not unique then return wrk.format("POST", path, headers, body) end
  n = n + 1
  local id = run .. "_" .. tid .. "_" .. n
  headers["Idempotency-Key"] = "k" .. id
  return wrk.format("POST", path, headers, string.format(body, id))
end
function response(status, hdrs, resp)
  if status ~= 200 or not string.find(resp, marker, 1, true) then
    bad = bad + 1
    if bad == 1 then io.stderr:write("unexpected answer: " .. status .. " " .. string.sub(resp, 1, 600) .. "\n") end
  end
end
function done(summary, latency, requests)
  local wrong = 0
  for _, t in ipairs(threads) do wrong = wrong + t:get("bad") end
  local e = summary.errors
  io.write(string.format('{"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p99_us":%%d,"bad":%%d,' ..
    '"socket_errors":%%d}\n', summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), wrong, e.connect + e.read + e.write + e.timeout))
end
"""


def _lua_string(text: str) -> str:
    return "[==[" + text + "]==]"


@dataclass
class Case:
    name: str
    url: str                      # http://host:port/path
    body: str                     # JSON (with one %s per unique id when ``unique``)
    marker: str                   # a substring every successful answer contains
    pid: Callable[[], int | None]  # the process whose CPU is charged to the case
    headers: dict[str, str] | Callable[[], dict[str, str]] = field(default_factory=dict)  # callable: per run
    unique: bool = False
    calls_per_request: int = 1
    # Per request: (Idempotency-Key, Txn-Token) pairs written to a file the script reads (a call token is good
    # once, so a case that sends its own must send a new one each time); called with how many a run needs.
    token_pool: Callable[[int], list[tuple[str, str]]] | None = None
    before: "Case | None" = None  # --before: the same case on the proxy of the other checkout, run beside it

    def lua(self, run: str, pool_file: Path | None = None) -> str:
        path = "/" + self.url.split("/", 3)[3]
        headers = {"Content-Type": "application/json", **(self.headers() if callable(self.headers) else self.headers)}
        table = "{" + ", ".join(f"[ {_lua_string(k)} ] = {_lua_string(v)}" for k, v in headers.items()) + "}"
        return WRK_LUA % {"body": _lua_string(self.body), "path": _lua_string(path),
                          "marker": _lua_string(self.marker), "unique": "true" if self.unique else "false",
                          "run": _lua_string(run), "headers": table,
                          "pool": _lua_string(str(pool_file) if pool_file else "")}


@dataclass
class Sample:
    p50_ms: float
    p99_ms: float
    calls_s: float
    cpu_ms: float | None
    opa: float | None
    redis_cmds: float | None
    redis_rts: float | None
    failed: int = 0  # answers without the case's success marker (e.g. dependency_unavailable under overload)


# --------------------------------------------------------------------------- processes

class Processes:
    """Every process of the run; stopped in reverse order, whatever happened."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[subprocess.Popen[bytes]] = []
        self.servers: list[Any] = []

    def spawn(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None,
              cwd: Path = REPO) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=log)
        self.children.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.children):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for server in reversed(self.servers):
            server.stop()


def wait_http(url: str, proc: subprocess.Popen[bytes], bound_s: float = 60.0, method: str = "GET") -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {bound_s}s")


def post(url: str, body: str, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def opa_queries(opa_url: str, headers: dict[str, str]) -> float:
    request = urllib.request.Request(opa_url + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("http_request_duration_seconds_count") and 'handler="v1/data"' in line \
                and 'method="post"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class CommandCounter:
    """Top-level Redis commands, counted from a ``MONITOR`` feed (commands a script runs show as
    ``[0 lua]`` and are not counted; neither are the bench's own INFO and ECHO)."""

    def __init__(self, port: int, client: redis.Redis) -> None:
        self._client = client
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.sendall(b"MONITOR\r\n")
        self._tail = b""
        self._sock.settimeout(30)
        while b"\n" not in self._tail:  # +OK: the feed is on before anything is counted
            self._tail += self._sock.recv(1 << 16)
        self._tail = self._tail.partition(b"\n")[2]
        self._sock.settimeout(None)
        self._count = 0
        self._seen: set[bytes] = set()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            data = self._tail + chunk
            complete, _, self._tail = data.rpartition(b"\n")
            lines = complete.lower().split(b"\n")
            counted = sum(1 for line in lines if line[1:2].isdigit() and b" lua]" not in line
                          and b'] "info"' not in line and b'] "echo"' not in line)
            markers = [line.rsplit(b'"', 2)[1] for line in lines if b'] "echo"' in line]
            with self._cond:
                self._count += counted
                self._seen.update(markers)
                self._cond.notify_all()

    def count(self) -> int:
        """Every top-level command so far (waits until the feed caught up with this moment)."""
        token = uuid.uuid4().hex.encode()  # lower-case hex: the feed is lower-cased
        self._client.echo(token)
        with self._cond:
            if not self._cond.wait_for(lambda: token in self._seen, timeout=30):
                raise TimeoutError("MONITOR feed did not catch up")
            return self._count

    def close(self) -> None:
        self._sock.close()


def redis_counters(env: "Environment", monitor: CommandCounter) -> tuple[float, float]:
    """(top-level commands, read events) so far, not counting the bench's own INFO and ECHO."""
    commands = monitor.count()
    stats = env.redis.info("stats")
    return float(commands), float(stats["total_reads_processed"])


# --------------------------------------------------------------------------- the run

def wrk(case: Case, connections: int, seconds: float, workdir: Path, run: str) -> dict[str, Any]:
    stem = case.name.replace(' ', '_').replace('/', '_')
    script, pool_file = workdir / f"{stem}.lua", None
    if case.token_pool is not None:  # enough for the fastest case seen here (about 2,500 calls/s), twice over
        pool_file = workdir / f"{stem}.tokens"
        pool_file.write_text("".join(f"{key} {token}\n" for key, token in case.token_pool(int(5000 * seconds))))
    script.write_text(case.lua(run, pool_file))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(script),
                          case.url], capture_output=True, text=True, timeout=seconds + 60)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed for {case.name}: {out.stdout}\n{out.stderr}")
    if out.stderr.strip():
        print(f"{case.name} @{connections}: {out.stderr.strip()}", file=sys.stderr)
    return json.loads(lines[-1])


def measure(case: Case, connections: int, seconds: float, env: "Environment", run: str) -> tuple[dict, Sample]:
    pid = case.pid()
    cpu0 = cpu_seconds(pid) if pid else None
    opa0 = opa_queries(env.opa_url, env.opa_headers)
    # Redis is counted on the sequential runs only: the MONITOR feed costs the bench CPU under load.
    monitor = CommandCounter(env.redis_port, env.redis) if connections == 1 else None
    cmds0, reads0 = redis_counters(env, monitor) if monitor else (0.0, 0.0)
    started = time.monotonic()
    result = wrk(case, connections, seconds, env.workdir, run)
    elapsed = time.monotonic() - started
    cmds1, reads1 = redis_counters(env, monitor) if monitor else (0.0, 0.0)
    if monitor:
        monitor.close()
    opa1 = opa_queries(env.opa_url, env.opa_headers)
    cpu1 = cpu_seconds(pid) if pid else None
    calls = max(1, result["requests"]) * case.calls_per_request
    background = env.idle_rate_cmds * elapsed
    sample = Sample(
        p50_ms=result["p50_us"] / 1000, p99_ms=result["p99_us"] / 1000,
        calls_s=result["requests"] / (result["duration_us"] / 1e6),
        cpu_ms=None if cpu0 is None else 1000 * (cpu1 - cpu0) / max(1, result["requests"]),
        opa=(opa1 - opa0) / calls,
        redis_cmds=max(0.0, cmds1 - cmds0 - background) / calls if monitor else None,
        redis_rts=max(0.0, reads1 - reads0 - 2 - env.idle_rate_reads * elapsed) / calls if monitor else None,
        failed=result["bad"] + result["socket_errors"])
    return result, sample


@dataclass
class Environment:
    workdir: Path
    opa_url: str
    redis: redis.Redis
    redis_port: int
    idle_rate_cmds: float = 0.0
    idle_rate_reads: float = 0.0
    opa_headers: dict[str, str] = field(default_factory=dict)  # the bench's own reads of OPA's /metrics


def _direct_tokens(signing_key: Path, arguments: dict[str, Any], count: int) -> list[tuple[str, str]]:
    """Direct backend reads' (operation key, call token) pairs, each good once (five minutes)."""
    import hashlib

    from proxy.calltokens.keys import load_signing_key
    from proxy.calltokens.signer import CallTokenSigner
    signer = CallTokenSigner(load_signing_key(signing_key), issuer="toolproxy")
    args_hash = hashlib.sha256(json.dumps(arguments, separators=(",", ":"), sort_keys=True).encode()).hexdigest()
    pairs = []
    for _ in range(count):
        key = "ik_" + uuid.uuid4().hex * 2
        pairs.append((key, signer.sign(audience="demo", scope="tool:call", txn=key, subject="dev-user", tenant="acme",
                                       agent="dev-agent", context={"tool": "get_order", "version": "1.0.0",
                                                                   "args_hash": args_hash, "idempotency_key": key})))
    return pairs


def _call_token_key(workdir: Path) -> tuple[Path, Path]:
    """The run's call-token key (the proxy and the floor hop sign with it) and its JWKS (the backend's)."""
    from proxy.calltokens import keys
    key = keys.signing_key(keys.generate("EdDSA"))  # kid: its thumbprint, as the proxy computes it
    private, public = workdir / "call-token-key.pem", workdir / "call-token-jwks.json"
    private.write_bytes(keys.private_pem(key.private))
    public.write_text(json.dumps(keys.jwks(key)))
    return private, public


def start_all(args: argparse.Namespace, procs: Processes, workdir: Path) -> tuple[Environment, list[Case]]:
    # OPA on TCP for the floor and the proxy alike: the floor's one client reaches OPA and the backend, and the
    # runs stay comparable with the earlier ones (the proxy is let use TCP with opa.allow_tcp).
    opa = OpaServer([REPO / "policies", REPO / "examples" / "opa"], tcp=True)
    redis_server = RedisServer(data_dir=workdir / "redis")
    procs.servers += [opa, redis_server]
    opa.start()
    redis_server.start()
    python = sys.executable
    backend_port, upstream_port, floor_port, proxy_port = (free_port() for _ in range(4))
    admin_port, ops_port = free_port(), free_port()
    signing_key, backend_keys = _call_token_key(workdir)
    backend = procs.spawn("backend", [python, "-m", "examples.demo_backend", "--port", str(backend_port),
                                      "--jwks-file", str(backend_keys), *CONTRACT_ALIASES])
    upstream = procs.spawn("upstream", [python, "-m", "bench.mcp_upstream", "--port", str(upstream_port)])
    backend_url = f"http://127.0.0.1:{backend_port}"
    upstream_url = f"http://127.0.0.1:{upstream_port}/mcp"
    floor = procs.spawn("floor", [python, "-m", "bench.floor_hop", "--port", str(floor_port), "--opa", opa.url,
                                  "--backend", backend_url, "--opa-token-file", opa.token_file,
                                  "--signing-key", str(signing_key)])
    wire_floor_port = free_port()
    wire_floor = procs.spawn("wire floor", [python, "-m", "bench.floor_hop", "--port", str(wire_floor_port),
                                            "--opa", opa.url, "--backend", backend_url, "--opa-token-file",
                                            opa.token_file, "--signing-key", str(signing_key), "--client", "wire"])
    extra = workdir / "bench-tools.yaml"
    from tests.support.mcp_upstream import registry_yaml
    wait_http(upstream_url, upstream)
    extra.write_text(registry_yaml(upstream_url) + pinned_lookup(upstream_url))
    flow_tools = workdir / "flow-tools.yaml"
    flow_tools.write_text(FLOW_TOOLS)
    src = Path(args.proxy_src).resolve() if args.proxy_src else REPO
    settings = {
        "listen.port": proxy_port, "admin.port": admin_port, "ops.port": ops_port,
        "identity.mode": "static",  # as `toolproxy dev`; every other setting is the default
        **opa.settings, "redis.url": redis_server.url,
        "backends.services": f"demo={backend_url}",
        "call_tokens.signing_key_file": str(signing_key),  # the key the demo backend verifies with
        "integrity.mac_key_file": mac_key_file(), "opa.allow_tcp": "true",
        # The proxy's own example registry: an older checkout may not know a newer contract's fields.
        "registry.paths": f"{src / 'examples' / 'registry'},{extra}" + ("" if args.proxy_src else f",{flow_tools}"),
        # (--proxy-src: an older checkout may not know the flow contracts' fields; their cases are left out)
    }
    env = {**os.environ, "PYTHONPATH": str(src), **setting_env(settings)}
    key_file = workdir / "bench-key"  # the credential the "with a credential" case's contract names (a bearer key)
    key_file.write_text(uuid.uuid4().hex + "\n")
    credentials = json.dumps({"bench-key": {"kind": "bearer", "secret_file": str(key_file)}})
    if not args.proxy_src:
        env["TOOLPROXY_CREDENTIALS"] = credentials
    wrap = list(getattr(args, "wrap", ()))  # bench.instructions: the proxies run under callgrind
    env.update(setting_env(getattr(args, "slow_settings", {})))
    proxy = procs.spawn("proxy", [*wrap, python, "-m", "proxy.cli", "run"], env=env, cwd=src)
    traced = _traced_proxies(args, procs, env, src, settings) if args.tracing else []
    before = _before_proxy(Path(args.before), procs, {**env, "TOOLPROXY_CREDENTIALS": credentials}, settings,
                           [extra], wrap) if args.before else None
    wait_http(f"{backend_url}/healthz", backend)
    wait_http(upstream_url, upstream)
    wait_http(f"http://127.0.0.1:{floor_port}/", floor)
    wait_http(f"http://127.0.0.1:{wire_floor_port}/", wire_floor)
    ready_s = getattr(args, "ready_s", 60.0)
    wait_http(f"http://127.0.0.1:{ops_port}/readyz", proxy, ready_s)
    for _, _, ops, process in traced + ([before] if before else []):
        wait_http(f"http://127.0.0.1:{ops}/readyz", process, ready_s)
    proxy_url = f"http://127.0.0.1:{proxy_port}"

    def pid_of(proc: subprocess.Popen[bytes]) -> Callable[[], int | None]:
        return lambda: proc.pid

    read_body = json.dumps({"call_id": "c1", "tool": "get_order", "arguments": {"order_id": "ord_1001"}})
    upstream_direct = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                  "params": {"name": "lookup", "arguments": {"key": "k1"}, "_meta": CLIENT_META}})
    nobody = lambda: None  # noqa: E731
    cases = [
        # The backend admits only call tokens, each good once: every request sends one of its own, minted
        # before the run (the bench's CPU, not the backend's), under an operation key of its own.
        Case("direct backend read", f"{backend_url}/tools/get_order", json.dumps({"order_id": "ord_1001"}),
             '"order_id"', nobody,
             token_pool=lambda count: _direct_tokens(signing_key, {"order_id": "ord_1001"}, count)),
        Case("floor: bare two hops", f"http://127.0.0.1:{floor_port}/", read_body, '"succeeded"',
             pid_of(floor)),
        Case(WIRE_FLOOR, f"http://127.0.0.1:{wire_floor_port}/", read_body, '"succeeded"', pid_of(wire_floor)),
        *proxy_cases(proxy_url, pid_of(proxy)),
    ]
    # the upstream alone, beside the proxy's reads of it
    at = next(i for i, c in enumerate(cases) if c.name == "read via MCP upstream")
    cases.insert(at, Case("direct MCP upstream read", upstream_url, upstream_direct, '"isError":false', nobody,
                          headers={**MODERN_HEADERS, "Mcp-Name": "lookup"}))
    if args.proxy_src:  # an older checkout knows no flow contracts (its registry has none loaded for it)
        cases = [c for c in cases if c.name not in (FLOW_RECORD, FLOW_READ, PROVENANCE_RECORD, PROVENANCE_READ,
                                                    CREDENTIAL_READ)]
    for label, url, _, process in traced:
        cases.append(Case(f"JSON read ({label})", url + "/v1/tool-calls", read_body, '"outcome":"succeeded"',
                          pid_of(process)))
    if args.contextforge:
        cases.append(start_contextforge(procs, workdir, upstream_url))
    client = redis.Redis.from_url(redis_server.url)
    environment = Environment(workdir=workdir, opa_url=opa.url, redis=client,
                              redis_port=redis_server.port, opa_headers=opa.admin_headers)
    for case in cases:  # every case answers as expected before anything is timed
        wrong = failure(case)
        if wrong:
            raise RuntimeError(f"case {case.name!r} does not work: {wrong}")
    if before is not None:
        pair(cases, proxy_cases(before[1], pid_of(before[3]), BEFORE))
    return environment, cases


def setting_env(settings: dict[str, Any]) -> dict[str, str]:
    """The proxy's settings as the environment variables it reads (``opa.url``: ``TOOLPROXY_OPA_URL``)."""
    return {"TOOLPROXY_" + k.replace(".", "_").upper(): str(v) for k, v in settings.items()}


def _before_proxy(src: Path, procs: Processes, env: dict[str, str], settings: dict[str, Any],
                  extra: list[Path], wrap: list[str]) -> tuple[str, str, int, subprocess.Popen[bytes]]:
    """``--before``: a second proxy run from the checkout ``src``, with the same settings on ports of its own,
    against the same OPA, Redis, backend and upstream; (label, agent URL, ops port, process). Its registry: its
    own examples, the bench's MCP tools and its own ``bench/floor.py``'s flow tools (an older checkout may not
    know a newer contract's fields; a case it cannot answer is left without a twin)."""
    src = src.resolve()
    own = subprocess.run([sys.executable, "-c", "import bench.floor as f; print(getattr(f, 'FLOW_TOOLS', ''))"],
                         cwd=src, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
                         timeout=120)
    tools = procs.workdir / "before-flow-tools.yaml"
    tools.write_text(own.stdout if own.returncode == 0 else "")
    port, admin, ops = free_port(), free_port(), free_port()
    paths = [src / "examples" / "registry", *extra] + ([tools] if tools.read_text().strip() else [])
    mine = {**settings, "listen.port": port, "admin.port": admin, "ops.port": ops,
            "registry.paths": ",".join(map(str, paths))}
    process = procs.spawn("proxy (before)", [*wrap, sys.executable, "-m", "proxy.cli", "run"],
                          env={**env, "PYTHONPATH": str(src), **setting_env(mine)}, cwd=src)
    return "before", f"http://127.0.0.1:{port}", ops, process


def proxy_cases(proxy_url: str, pid: Callable[[], int | None], suffix: str = "") -> list[Case]:
    """The cases one proxy serves (``suffix`` on their names), with the MCP session and the replayed write
    they need opened on it."""
    read_body = json.dumps({"call_id": "c1", "tool": "get_order", "arguments": {"order_id": "ord_1001"}})
    write_body = json.dumps({"call_id": "c1", "tool": "adjust_counter",
                             "arguments": {"counter": "ctr_%s", "delta": 1}})
    mcp_read = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                           "params": {"name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}})
    mcp_legacy = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                             "params": {"name": "get_order", "arguments": {"order_id": "ord_1001"}}})
    upstream_body = json.dumps({"call_id": "c1", "tool": "up_lookup", "arguments": {"key": "k1"}})
    batch = json.dumps({"calls": [{"call_id": f"c{i}", "tool": "get_order",
                                   "arguments": {"order_id": "ord_1001"}} for i in (1, 2, 3)]})
    session = _open_session(proxy_url + "/mcp")
    replay_key = "replay-" + uuid.uuid4().hex
    replay_body = json.dumps({"call_id": "c1", "tool": "adjust_counter",
                              "arguments": {"counter": "ctr_replay", "delta": 1}})
    status, _, text = post(proxy_url + "/v1/tool-calls", replay_body, {"Idempotency-Key": replay_key})
    assert status == 200 and '"succeeded"' in text, text
    calls = proxy_url + "/v1/tool-calls"
    cases = [
        Case("JSON read", calls, read_body, '"outcome":"succeeded"', pid),
        # The flow stage (proxy/flow.py): get_order under a contract whose output is labelled (one flow.record
        # per call, in the commit round trip), and one that is an external sink (one flow.read per call).
        Case(FLOW_RECORD, calls, read_body.replace('"get_order"', '"flow_labelled_order"'),
             '"outcome":"succeeded"', pid),
        Case(FLOW_READ, calls, read_body.replace('"get_order"', '"flow_sink_order"'), '"outcome":"succeeded"', pid),
        Case(PROVENANCE_RECORD, calls, read_body.replace('"get_order"', '"flow_source_order"'),
             '"outcome":"succeeded"', pid),
        Case(PROVENANCE_READ, calls, read_body.replace('"get_order"', '"flow_target_order"'),
             '"outcome":"succeeded"', pid),
        Case(CREDENTIAL_READ, calls, read_body.replace('"get_order"', '"credentialed_order"'),
             '"outcome":"succeeded"', pid),
        Case("JSON write (unique keys)", calls, write_body, '"outcome":"succeeded"', pid, unique=True),
        Case("write replay", calls, replay_body, '"replayed":true', pid, headers={"Idempotency-Key": replay_key}),
        Case("MCP read (stateless)", proxy_url + "/mcp", mcp_read, '"isError":false', pid,
             headers={**MODERN_HEADERS, "Mcp-Name": "get_order"}),
        Case("MCP read (session)", proxy_url + "/mcp", mcp_legacy, '"isError":false', pid,
             headers={"Accept": "application/json, text/event-stream", "Mcp-Session-Id": session}),
        Case("batch of 3 reads", proxy_url + "/v1/tool-calls:batch", batch, '"outcome":"succeeded"', pid,
             calls_per_request=3),
        Case("read via MCP upstream", calls, upstream_body, '"outcome":"succeeded"', pid),
        # The same read of a pinned tool: its upstream is checked against the pins while calls flow
        # (mcp_pins.read_max_age_ms), so this case carries the checks' cost.
        Case(PINNED_READ, calls, upstream_body.replace('"up_lookup"', '"up_lookup_pinned"'),
             '"outcome":"succeeded"', pid),
    ]
    for case in cases:
        case.name += suffix
    return cases


def pair(cases: list[Case], twins: list[Case]) -> None:
    """Each case beside its twin on the other checkout's proxy (``--before``), where that one answers it."""
    for twin in twins:
        mine = next((c for c in cases if c.name + BEFORE == twin.name), None)
        wrong = failure(twin) if mine is not None else None
        if mine is not None and wrong:
            print(f"--before: {mine.name!r} has no twin (the other checkout answers {wrong[:200]})", file=sys.stderr)
        elif mine is not None:
            mine.before = twin


def failure(case: Case) -> str | None:
    """What is wrong with one answer of the case (None: it answers as expected)."""
    probe = "probe" + uuid.uuid4().hex[:8]
    headers = case.headers() if callable(case.headers) else dict(case.headers)
    if case.unique:  # as the wrk script does: each unique request under its own key
        headers["Idempotency-Key"] = "k" + probe
    if case.token_pool is not None:
        [(headers["Idempotency-Key"], headers["Txn-Token"])] = case.token_pool(1)
    status, _, text = post(case.url, case.body % probe if case.unique else case.body, headers)
    return None if status == 200 and case.marker in text else f"HTTP {status} {text[:400]}"


TRACING_MODES = (("traced: parent-based 10%", {}), ("traced: 100%", {"tracing.sampler": "always_on"}))


def _traced_proxies(args: argparse.Namespace, procs: Processes, env: dict[str, str], src: Path,
                    settings: dict[str, Any]) -> list[tuple[str, str, int, subprocess.Popen[bytes]]]:
    """The proxies of ``--tracing``: the same settings plus a trace endpoint (an OTLP sink), one per sampler
    mode; (label, agent URL, ops port, process) each."""
    sink_port = free_port()
    sink = procs.spawn("otlp sink", [sys.executable, "-m", "bench.otlp_sink", "--port", str(sink_port)])
    wait_http(f"http://127.0.0.1:{sink_port}/", sink)
    out = []
    for label, extra in TRACING_MODES:
        port, admin, ops = free_port(), free_port(), free_port()
        mode = {**settings, "listen.port": port, "admin.port": admin, "ops.port": ops,
                "tracing.endpoint": f"http://127.0.0.1:{sink_port}", **extra}
        mode_env = {**env, **setting_env(mode)}
        process = procs.spawn(f"proxy ({label})", [sys.executable, "-m", "proxy.cli", "run"], env=mode_env, cwd=src)
        out.append((label, f"http://127.0.0.1:{port}", ops, process))
    return out


def pinned_lookup(url: str) -> str:
    """``up_lookup`` again as ``up_lookup_pinned``, with the upstream's live pins (as `toolproxy import-mcp`
    writes them): its calls pay for the pin checks (the freshness bound: docs/mcp.md#pinned-upstream-tools)."""
    import asyncio

    import yaml

    from proxy.authoring.mcp_import import fetch_tools
    from proxy.drift import pin_of
    from tests.support.mcp_upstream import registry_yaml

    listed = asyncio.run(fetch_tools(url))
    pin = pin_of(next(tool for tool in listed if tool.name == "lookup"), listed)
    lookup = next(t for t in yaml.safe_load(registry_yaml(url))["tools"] if t["name"] == "up_lookup")
    lookup["name"] = "up_lookup_pinned"
    lookup["backend"]["pin"] = {"definition": pin.definition, "tool_list": pin.tool_list}
    return "\n".join("  " + line for line in yaml.safe_dump([lookup], sort_keys=False).splitlines()) + "\n"


def _open_session(url: str) -> str:
    status, headers, text = post(url, json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "wrk", "version": "0"}}}),
        {"Accept": "application/json, text/event-stream"})
    assert status == 200, text
    session = {k.lower(): v for k, v in headers.items()}["mcp-session-id"]
    post(url, json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
         {"Accept": "application/json, text/event-stream", "Mcp-Session-Id": session})
    return session


def start_contextforge(procs: Processes, workdir: Path, upstream_url: str) -> Case:
    from bench.contextforge import start
    return start(procs, workdir, upstream_url, Case)


# --------------------------------------------------------------------------- report

def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rows(cases: list[Case], seq: dict[str, list[Sample]], conc: dict[str, list[Sample]]) -> list[dict[str, Any]]:
    """The medians of every case: the table's rows, as data (``bench.results``)."""
    out = []
    for case in cases:
        s, c = seq[case.name], conc[case.name]
        out.append({"case": case.name, "seq_p50_ms": median([x.p50_ms for x in s]),
                    "seq_p99_ms": median([x.p99_ms for x in s]), "calls_s_16": median([x.calls_s for x in c]),
                    "p99_16_ms": median([x.p99_ms for x in c]), "cpu_ms_call": median([x.cpu_ms for x in c]),
                    "opa_q_call": median([x.opa for x in s]), "redis_cmds_call": median([x.redis_cmds for x in s]),
                    "redis_rts_call": median([x.redis_rts for x in s]), "failed": sum(x.failed for x in s + c)})
    return out


def ratios(seq: dict[str, list[Sample]], conc: dict[str, list[Sample]]) -> list[Ratio]:
    def m(name: str, attr: str, where: dict[str, list[Sample]]) -> float | None:
        return median([getattr(x, attr) for x in where.get(name, [])])

    floor, read, mcp = "floor: bare two hops", "JSON read", "MCP read (stateless)"
    lines = []

    def line(label: str, value: float | None, target: str) -> None:
        lines.append(Ratio(label, value, target))

    fc, fr, fp = m(floor, "cpu_ms", conc), m(floor, "calls_s", conc), m(floor, "p50_ms", seq)
    rc, rr, rp = m(read, "cpu_ms", conc), m(read, "calls_s", conc), m(read, "p50_ms", seq)
    if None not in (fc, rc):
        line("JSON read CPU / floor CPU", rc / fc, "<= 1.5")
    if None not in (fr, rr):
        line("JSON read calls/s / floor calls/s", rr / fr, ">= 0.75")
    if None not in (fp, rp):
        line("JSON read p50 - floor p50 (ms)", rp - fp, "<= 0.6")
    # The same against the floor of the proxy's own client (bench.floor_hop --client wire): what the
    # pipeline adds, without what aiohttp's client costs the aiohttp floor. No target yet: reported.
    wc, wr, wp = m(WIRE_FLOOR, "cpu_ms", conc), m(WIRE_FLOOR, "calls_s", conc), m(WIRE_FLOOR, "p50_ms", seq)
    if None not in (wc, rc):
        line("JSON read CPU / wire floor CPU", rc / wc, "")
    if None not in (wr, rr):
        line("JSON read calls/s / wire floor calls/s", rr / wr, "")
    if None not in (wp, rp):
        line("JSON read p50 - wire floor p50 (ms)", rp - wp, "")
    for label, attr, where in (("CPU", "cpu_ms", conc), ("p50", "p50_ms", seq)):
        a, b = m(mcp, attr, where), m(read, attr, where)
        if None not in (a, b):
            line(f"MCP read {label} / JSON read {label}", a / b, "<= 1.15")
    a, b = m(read, "calls_s", conc), m(mcp, "calls_s", conc)
    if None not in (a, b):
        line("JSON read calls/s / MCP read calls/s", a / b, "<= 1.15")
    a, b = m("read via MCP upstream", "cpu_ms", conc), rc
    if None not in (a, b):
        line("MCP-upstream read CPU / JSON read CPU", a / b, "<= 1.3")
    for case, what in ((FLOW_RECORD, "flow record"), (FLOW_READ, "flow read")):  # the flow stage's cost
        for label, attr, where in (("CPU", "cpu_ms", conc), ("p50", "p50_ms", seq)):
            a, b = m(case, attr, where), m(read, attr, where)
            if None not in (a, b):
                line(f"read with {what} {label} / JSON read {label}", a / b, "")
    # argument provenance's cost: the same record and read with fingerprints (proxy/provenance.py)
    for case, base, what in ((PROVENANCE_RECORD, FLOW_RECORD, "provenance record"),
                             (PROVENANCE_READ, FLOW_READ, "provenance read")):
        for label, attr, where in (("CPU", "cpu_ms", conc), ("p50", "p50_ms", seq)):
            a, b = m(case, attr, where), m(base, attr, where)
            if None not in (a, b):
                line(f"{what} {label} / flow {what.split()[1]} {label}", a / b, "<= 1.10")
    for label, attr, where in (("CPU", "cpu_ms", conc), ("p50", "p50_ms", seq)):  # an attached credential's cost
        a, b = m(CREDENTIAL_READ, attr, where), m(read, attr, where)
        if None not in (a, b):
            line(f"read with a credential {label} / JSON read {label}", a / b, "<= 1.05")
    a, b = m("JSON write (unique keys)", "cpu_ms", conc), fc
    if None not in (a, b):
        line("write CPU / floor CPU", a / b, "<= 2.5")
    a, b = m("read via MCP upstream", "calls_s", conc), m("ContextForge: read via MCP upstream", "calls_s", conc)
    if a is not None and b is not None:
        line("MCP-upstream calls/s: toolproxy / ContextForge", a / b if b else float("inf"), ">= 10")
    return lines


def against_before(cases: list[Case], seq: dict[str, list[Sample]], conc: dict[str, list[Sample]]) -> list[Ratio]:
    """``--before``: per case with a twin, this proxy's CPU per call (16 connections) and sequential p50 over the
    other checkout's: each round's ratio of the two runs made back to back, the median over rounds."""
    lines = []
    for case in cases:
        if case.before is None:
            continue
        for label, attr, where in (("CPU", "cpu_ms", conc), ("p50", "p50_ms", seq)):
            pairs = zip(where[case.name], where[case.before.name])
            value = median([getattr(a, attr) / getattr(b, attr) for a, b in pairs
                            if getattr(a, attr) is not None and getattr(b, attr)])
            lines.append(Ratio(f"{case.name} {label}: after / before", value, "<= 1.05"))
    return lines


def profile(case: Case, seconds: int, workdir: Path) -> int:
    """Collapsed stacks of the case's serving process under load (py-spy, if installed)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = workdir / "profile.txt"
    wrk(case, 4, 1, workdir, "warm")
    sampler = subprocess.Popen([spy, "record", "--pid", str(case.pid()), "--format", "raw", "--rate", "250",
                                "--duration", str(seconds), "--output", str(out), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrk(case, 16, seconds, workdir, "profile" + uuid.uuid4().hex[:6])
    sampler.wait(timeout=seconds + 60)
    print(out.read_text())
    return 0


def run_rounds(cases: list[Case], rounds: int, seconds: float,
               env: Environment) -> tuple[dict[str, list[Sample]], dict[str, list[Sample]]]:
    """Every case once per round, sequentially and at 16 connections, the order rotating between rounds; a case
    with a twin (``--before``) beside it, which one first alternating by round. The samples by case name:
    (sequential, 16 connections)."""
    both = [c for case in cases for c in (case, case.before) if c is not None]
    seq: dict[str, list[Sample]] = {c.name: [] for c in both}
    conc: dict[str, list[Sample]] = {c.name: [] for c in both}
    run = uuid.uuid4().hex[:8]
    for r in range(rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]  # rotate: no case always runs first
        for case in order:
            for one in [case, case.before][::1 if r % 2 == 0 else -1] if case.before else [case]:
                for connections, into in ((1, seq), (16, conc)):
                    tag = f"{run}r{r}c{connections}" + ("b" if one is case.before else "")  # the twin's keys apart
                    _, sample = measure(one, connections, seconds, env, tag)
                    into[one.name].append(sample)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return seq, conc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=4, help="length of each wrk run")
    parser.add_argument("--proxy-src", help="run the proxy from this checkout (e.g. an export of main)")
    parser.add_argument("--before", metavar="DIR", help="also run a proxy from this checkout (e.g. an export of "
                        "an older commit) beside this one, each case's two runs back to back in every round, and "
                        "print after / before per case")
    parser.add_argument("--contextforge", action="store_true", help="also measure IBM ContextForge (.tools/)")
    parser.add_argument("--only", help="comma-separated case names to run (default: all)")
    parser.add_argument("--tracing", action="store_true", help="also run 'JSON read' on proxies exporting "
                        "OpenTelemetry spans: default (parent-based) sampler and 100%%")
    parser.add_argument("--samples", action="store_true", help="also print each round's proxy CPU per call")
    parser.add_argument("--save", action="store_true", help="write the run to bench/results/ (bench.results)")
    parser.add_argument("--note", default="", help="a line saved with the run (what the machine was doing)")
    parser.add_argument("--profile", metavar="CASE", help="instead of the table: py-spy profile of the serving "
                        "process under 16 connections of CASE (collapsed stacks to stdout)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench: wrk not found: run scripts/setup.sh (it installs Debian's wrk)", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="toolproxy-floor-"))
    procs = Processes(workdir)
    try:
        env, cases = start_all(args, procs, workdir)
        if args.only:
            wanted = set(args.only.split(","))
            cases = [c for c in cases if c.name in wanted or c.name.startswith("floor")]
        if args.profile:
            return profile(next(c for c in cases if c.name == args.profile), args.seconds, workdir)
        cases = [c for case in cases for c in (case, case.before) if c is not None]  # twins beside their case
        for case in cases:  # warm up: connection pools, sessions, JIT-free but cache-warm
            wrk(case, 4, 1, workdir, "warm" + uuid.uuid4().hex[:6])
        monitor = CommandCounter(env.redis_port, env.redis)
        cmds0, reads0 = redis_counters(env, monitor)
        time.sleep(5)
        cmds1, reads1 = redis_counters(env, monitor)
        monitor.close()
        env.idle_rate_cmds, env.idle_rate_reads = (cmds1 - cmds0) / 5, max(0.0, reads1 - reads0 - 2) / 5
        paired = [c for c in cases if not c.name.endswith(BEFORE)]
        seq, conc = run_rounds(paired, args.rounds, args.seconds, env)
        print(f"\n{args.rounds} rounds x {args.seconds:g} s per case and concurrency; medians over rounds. "
              f"Proxy from {args.proxy_src or 'this checkout'}"
              f"{f'; [before]: from {args.before}' if args.before else ''}. Idle Redis traffic (background sweeps): "
              f"{env.idle_rate_cmds:.1f} commands/s, {env.idle_rate_reads:.1f} round trips/s.\n")
        measured = rows(cases, seq, conc)
        checked = ratios(seq, conc) + against_before(paired, seq, conc)
        print(results.table(measured))
        print()
        print("\n".join(map(str, checked)))
        if args.save:
            path = results.save(results.Run(
                commit=results.head_commit() if not args.proxy_src else f"src:{Path(args.proxy_src).name}",
                taken_at=results.now_iso(), rounds=args.rounds, seconds=args.seconds, rows=tuple(measured),
                ratios=tuple(checked), note=args.note))
            print(f"\nsaved: {path.relative_to(results.REPO)} (docs/performance.md: python -m bench.results doc)")
        if args.samples:  # the rounds behind each median: drift within a run shows here
            print("\nproxy CPU ms/call at 16 connections, round by round:")
            for case in cases:
                values = [fmt(x.cpu_ms) for x in conc[case.name]]
                print(f"- {case.name}: {', '.join(values)}")
        return 0
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
