"""A sidecar's footprint: the proxy's memory and start-up, Redis bytes per operation record, OPA's memory.

Starts its own real processes on loopback, as ``bench.floor`` does (its helpers, not copies): OPA (repo
policies + demo data), Redis, the demo backend, a trivial upstream MCP server (``bench.mcp_upstream``), and
``toolproxy run`` in two configurations:

- **JSON/OpenAI only**: the demo registry, ``mcp.front`` off (no ``/mcp``), no MCP upstream in the registry;
- **everything on**: the MCP front on and the upstream's tools in the registry as well.

and prints one table:

- proxy RSS idle (``/proc/<pid>/status`` VmRSS) of each configuration, after ``/readyz`` answered 200 and
  one call through every front the configuration serves (a module imported on first use is counted),
  then a quiet second;
- proxy RSS after ``--calls`` mixed calls (JSON read, JSON write under a fresh key, MCP read, MCP-upstream
  read, OpenAI-shaped read, in turn; ``wrk``, 8 connections) and its growth over a second ``--calls``;
- process start to ``/readyz`` 200 of each configuration (OPA and Redis already up; median of
  ``--starts`` starts, polled every 5 ms);
- the first call's latency after ``/readyz`` next to the median of the 20 calls after it (what work moved
  off start-up costs the first caller);
- the records held after the mixed runs as ``toolproxy_operation_records`` says, beside the record keys
  Redis holds (``SCAN``);
- Redis bytes (``MEMORY USAGE <key> SAMPLES 0``) of the operation record of the demo's counter write, of a
  larger output (``generate_report``), and the mean over the records of the mixed run;
- OPA RSS with the shipped policies and demo data (after the mixed run), and the ``GOMEMLIMIT`` it ran with.

    .venv/bin/python -m bench.footprint [--calls 100000] [--starts 3] [--proxy-src DIR]

The proxy's sources are byte-compiled first (``compileall``, as the image's Dockerfile does), so a start
measures what a deployed sidecar's start does, not compiling ~90 modules from source (which a checkout run
with ``PYTHONDONTWRITEBYTECODE`` set would do at every start, about 0.5 s).

``--proxy-src DIR`` runs the proxy from another checkout (the "before" table). The machine is whatever
it is: RSS is stable, start-up times are not on a shared machine (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.floor import CLIENT_META, MODERN_HEADERS, Processes, _call_token_key, post, wait_http
from bench.servers import REPO
from tests.support.servers import OpaServer, RedisServer, free_port, mac_key_file

# One Lua script: the mixed requests in turn, a fresh key for each write; after ``total`` answers it writes
# ``flag`` (wrk's main thread sleeps its whole duration: the bench stops it with SIGINT when the flag is
# there); counts answers without the request's success marker.
MIXED_LUA = r"""
local kinds = %(kinds)s
local total, run, flag = %(total)d, %(run)s, %(flag)s
local threads = {}
function setup(thread) table.insert(threads, thread) end
local n, answered = 0, 0
bad = 0
local sent = {}
function request()
  n = n + 1
  local k = kinds[(n %% #kinds) + 1]
  local headers = {}
  for name, value in pairs(k.headers) do headers[name] = value end
  local body = k.body
  if k.unique then
    local id = run .. "_" .. n
    headers["Idempotency-Key"] = "k" .. id
    body = string.format(k.body, id)
  end
  return wrk.format("POST", k.path, headers, body)
end
function response(status, hdrs, resp)
  answered = answered + 1
  if status ~= 200 or not (string.find(resp, '"succeeded"', 1, true) or string.find(resp, '"isError":false', 1, true)) then
    bad = bad + 1
    if bad == 1 then io.stderr:write("unexpected answer: " .. status .. " " .. string.sub(resp, 1, 400) .. "\n") end
  end
  if answered == total then
    local f = io.open(flag, "w")
    f:write("done")
    f:close()
  end
end
function done(summary, latency, requests)
  local wrong = 0
  for _, t in ipairs(threads) do wrong = wrong + t:get("bad") end
  io.write(string.format('{"requests":%%d,"bad":%%d}\n', summary.requests, wrong))
end
"""


LONG_TITLE = ("Quarterly sales for the EMEA region, 2026-Q1, by product line and channel, with returns, "
              "refunds and the regional managers' notes on each of the three months")[:160]


def _lua(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[ {_lua(k)} ] = {_lua(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "{" + ", ".join(_lua(v) for v in value) + "}"
    return "[==[" + str(value) + "]==]"


@dataclass(frozen=True)
class Call:
    """One request of the mix (``body`` holds one ``%s`` for a fresh id when ``unique``)."""

    path: str
    body: str
    headers: dict[str, str]
    unique: bool = False


def mixed_calls(with_mcp: bool) -> list[Call]:
    read = json.dumps({"call_id": "c1", "tool": "get_order", "arguments": {"order_id": "ord_1001"}})
    write = json.dumps({"call_id": "c1", "tool": "adjust_counter", "arguments": {"counter": "ctr_%s", "delta": 1}})
    openai = json.dumps({"tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_order", "arguments": json.dumps({"order_id": "ord_1001"})}}]})
    json_headers = {"Content-Type": "application/json"}
    calls = [Call("/v1/tool-calls", read, json_headers), Call("/v1/tool-calls", write, json_headers, unique=True),
             Call("/v1/openai/tool-calls", openai, json_headers)]
    if with_mcp:
        mcp = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}})
        upstream = json.dumps({"call_id": "c1", "tool": "up_lookup", "arguments": {"key": "k1"}})
        calls += [Call("/mcp", mcp, {**json_headers, **MODERN_HEADERS, "Mcp-Name": "get_order"}),
                  Call("/v1/tool-calls", upstream, json_headers)]
    return calls


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def mb(kib: float) -> str:
    return f"{kib / 1024:.1f} MB"


class Stack:
    """OPA, Redis, the demo backend and the upstream: started once, shared by every proxy the run starts."""

    def __init__(self, procs: Processes, workdir: Path) -> None:
        self.procs, self.workdir = procs, workdir
        self.opa = OpaServer([REPO / "policies", REPO / "examples" / "opa"])
        self.redis_server = RedisServer(data_dir=workdir / "redis")
        procs.servers += [self.opa, self.redis_server]
        self.opa.start()
        self.redis_server.start()
        self.redis = redis.Redis.from_url(self.redis_server.url)
        python = sys.executable
        backend_port, upstream_port = free_port(), free_port()
        self.signing_key, backend_keys = _call_token_key(workdir)
        backend = procs.spawn("backend", [python, "-m", "examples.demo_backend", "--port", str(backend_port),
                                          "--jwks-file", str(backend_keys)])
        upstream = procs.spawn("upstream", [python, "-m", "bench.mcp_upstream", "--port", str(upstream_port)])
        self.backend_url = f"http://127.0.0.1:{backend_port}"
        self.upstream_url = f"http://127.0.0.1:{upstream_port}/mcp"
        wait_http(f"{self.backend_url}/healthz", backend)
        wait_http(self.upstream_url, upstream)
        self.extra = workdir / "bench-tools.yaml"
        from tests.support.mcp_upstream import registry_yaml
        self.extra.write_text(registry_yaml(self.upstream_url))

    def proxy_env(self, src: Path, everything: bool) -> tuple[dict[str, str], dict[str, int]]:
        ports = {"listen": free_port(), "admin": free_port(), "ops": free_port()}
        registry = str(src / "examples" / "registry") + (f",{self.extra}" if everything else "")
        settings = {
            "listen.port": ports["listen"], "admin.port": ports["admin"], "ops.port": ports["ops"],
            "identity.mode": "static", **self.opa.settings, "redis.url": self.redis_server.url,
            "backends.services": f"demo={self.backend_url}", "call_tokens.signing_key_file": str(self.signing_key),
            "integrity.mac_key_file": mac_key_file(),  # `toolproxy run` needs both keys
            "registry.paths": registry, "mcp.front": "true" if everything else "false",
        }
        env = {**os.environ, "PYTHONPATH": str(src),
               **{"TOOLPROXY_" + k.replace(".", "_").upper(): str(v) for k, v in settings.items()}}
        return env, ports


def wait_ready(url: str, proc: subprocess.Popen[bytes], bound_s: float = 120.0) -> float:
    """Seconds from now until ``url`` answers 200 (polled every 5 ms)."""
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the proxy exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.005)
    raise TimeoutError(f"{url} not 200 within {bound_s}s")


@dataclass
class Proxy:
    proc: subprocess.Popen[bytes]
    url: str
    ready_s: float
    ops_url: str = ""


def start_proxy(stack: Stack, src: Path, everything: bool, name: str) -> Proxy:
    env, ports = stack.proxy_env(src, everything)
    started = time.monotonic()
    proc = stack.procs.spawn(name, [sys.executable, "-m", "proxy.cli", "run"], env=env, cwd=src)
    wait_ready(f"http://127.0.0.1:{ports['ops']}/readyz", proc)
    return Proxy(proc, f"http://127.0.0.1:{ports['listen']}", time.monotonic() - started,
                 f"http://127.0.0.1:{ports['ops']}")


def stop_proxy(stack: Stack, proxy: Proxy) -> None:
    proxy.proc.terminate()
    try:
        proxy.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proxy.proc.kill()
        proxy.proc.wait(timeout=5)
    stack.procs.children.remove(proxy.proc)


def call_once(proxy: Proxy, call: Call) -> float:
    """One call (a fresh key for a write); its latency in ms. Raises if it did not succeed."""
    headers = dict(call.headers)
    body = call.body
    if call.unique:
        probe = uuid.uuid4().hex[:12]
        headers["Idempotency-Key"] = "k" + probe
        body = call.body % probe
    started = time.perf_counter()
    status, _, text = post(proxy.url + call.path, body, headers)
    elapsed = (time.perf_counter() - started) * 1000
    if status != 200 or not ('"succeeded"' in text or '"isError":false' in text):
        raise RuntimeError(f"{call.path}: HTTP {status} {text[:400]}")
    return elapsed


def mixed_run(proxy: Proxy, calls: list[Call], total: int, workdir: Path) -> int:
    """``total`` calls of the mix through wrk; the answers that were not a success."""
    kinds = [{"path": c.path, "body": c.body, "headers": c.headers, "unique": c.unique} for c in calls]
    script, flag = workdir / "mixed.lua", workdir / f"mixed-{uuid.uuid4().hex[:8]}.done"
    script.write_text(MIXED_LUA % {"kinds": _lua(kinds), "total": total, "run": _lua(uuid.uuid4().hex[:8]),
                                   "flag": _lua(flag)})
    wrk = subprocess.Popen(["wrk", "-t1", "-c8", "-d7200s", "--timeout", "10s", "-s", str(script), proxy.url],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not flag.exists() and wrk.poll() is None:
            time.sleep(0.2)
        wrk.send_signal(signal.SIGINT)  # wrk stops its threads and reports on SIGINT
        stdout, stderr = wrk.communicate(timeout=60)
    finally:
        if wrk.poll() is None:
            wrk.kill()
            wrk.wait(timeout=10)
    if stderr.strip():
        print(f"mixed run: {stderr.strip()[:600]}", file=sys.stderr)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"wrk failed: {stdout}\n{stderr}")
    return int(json.loads(lines[-1])["bad"])


def record_bytes(stack: Stack, operation_key: str) -> int:
    matches = list(stack.redis.scan_iter(match=f"*:op:*:{operation_key}", count=1000))
    if len(matches) != 1:
        raise RuntimeError(f"operation record of {operation_key}: {len(matches)} keys")
    return int(stack.redis.memory_usage(matches[0], samples=0))


def write_record(stack: Stack, proxy: Proxy, tool: str, arguments: dict[str, Any]) -> int:
    body = json.dumps({"call_id": "c1", "tool": tool, "arguments": arguments})
    status, _, text = post(proxy.url + "/v1/tool-calls", body, {"Idempotency-Key": "fp-" + uuid.uuid4().hex})
    envelope = json.loads(text)
    if status != 200 or envelope.get("outcome") != "succeeded":
        raise RuntimeError(f"{tool}: HTTP {status} {text[:400]}")
    return record_bytes(stack, envelope["idempotency_key"])


def records_held(stack: Stack, proxy: Proxy) -> tuple[int, int]:
    """(``toolproxy_operation_records`` as the proxy's /metrics says, record keys Redis holds by SCAN)."""
    with urllib.request.urlopen(proxy.ops_url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    gauge = next(int(float(line.split()[-1])) for line in text.splitlines()
                 if line.startswith("toolproxy_operation_records "))
    keys = sum(1 for _ in stack.redis.scan_iter(match="*:op:{op*}:ik_*", count=1000))
    return gauge, keys


def mean_record_bytes(stack: Stack, sample: int = 500) -> tuple[float, int]:
    sizes = []
    for name in stack.redis.scan_iter(match="*:op:{op*}:ik_*", count=1000):
        sizes.append(int(stack.redis.memory_usage(name, samples=0)))
        if len(sizes) >= sample:
            break
    return (statistics.mean(sizes) if sizes else 0.0), len(sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100000, help="mixed calls per run (two runs)")
    parser.add_argument("--starts", type=int, default=3, help="starts per configuration (median start-up)")
    parser.add_argument("--proxy-src", help="run the proxy from this checkout (e.g. an export of main)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench: wrk not found: run scripts/setup.sh (it installs Debian's wrk)", file=sys.stderr)
        return 1
    src = Path(args.proxy_src).resolve() if args.proxy_src else REPO
    workdir = Path(tempfile.mkdtemp(prefix="toolproxy-footprint-"))
    procs = Processes(workdir)
    rows: list[tuple[str, str]] = []
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "proxy")], check=True)  # as the image
    try:
        stack = Stack(procs, workdir)
        for everything, label in ((False, "JSON/OpenAI only"), (True, "everything on")):
            calls = mixed_calls(everything)
            ready, first, rest, idle = [], [], [], []
            for n in range(args.starts):
                proxy = start_proxy(stack, src, everything, f"proxy-{int(everything)}-{n}")
                ready.append(proxy.ready_s)
                first.append(call_once(proxy, calls[1]))  # the first call after /readyz: a write
                rest.append(statistics.median(call_once(proxy, calls[i % len(calls)]) for i in range(20)))
                for call in calls:
                    call_once(proxy, call)
                time.sleep(1.0)
                idle.append(rss_kib(proxy.proc.pid))
                if n < args.starts - 1 or not everything:
                    stop_proxy(stack, proxy)
            rows.append((f"proxy RSS idle, {label}", mb(statistics.median(idle))))
            rows.append((f"start to /readyz 200, {label}", f"{statistics.median(ready):.2f} s"))
            rows.append((f"first write after /readyz, {label} (next 20 calls' median)",
                         f"{statistics.median(first):.1f} ms ({statistics.median(rest):.1f} ms)"))
        # ``proxy`` is the last everything-on process, idle and warm.
        base = rss_kib(proxy.proc.pid)
        bad = mixed_run(proxy, mixed_calls(True), args.calls, workdir)
        after = rss_kib(proxy.proc.pid)
        bad += mixed_run(proxy, mixed_calls(True), args.calls, workdir)
        again = rss_kib(proxy.proc.pid)
        rows.append((f"proxy RSS after {args.calls:,} mixed calls (growth over the idle one)",
                     f"{mb(after)} (+{(after - base) / 1024:.1f} MB)"))
        rows.append((f"proxy RSS growth over a second {args.calls:,}", f"{(again - after) / 1024:+.1f} MB"))
        rows.append(("answers that were not a success, mixed runs", str(bad)))
        counter = write_record(stack, proxy, "adjust_counter", {"counter": "ctr_fp", "delta": 1})
        report = write_record(stack, proxy, "generate_report", {"title": LONG_TITLE, "duration_ms": 1})
        mean, sampled = mean_record_bytes(stack)
        gauge, keys = records_held(stack, proxy)
        rows.append(("records held: toolproxy_operation_records (record keys in Redis)", f"{gauge:,} ({keys:,})"))
        rows.append(("Redis bytes per operation record: demo counter write", f"{counter:,} B"))
        rows.append(("Redis bytes per operation record: generate_report, a 160-character title",
                     f"{report:,} B"))
        rows.append((f"Redis bytes per operation record: mean of {sampled} from the mixed run", f"{mean:,.0f} B"))
        rows.append(("OPA RSS, shipped policies + demo data (GOMEMLIMIT "
                     f"{os.environ.get('GOMEMLIMIT', 'unset')})", mb(rss_kib(stack.opa.pid))))
        print(f"\nProxy from {args.proxy_src or 'this checkout'}; {args.starts} starts per configuration; "
              f"{args.calls:,} mixed calls x 2.\n")
        width = max(len(r[0]) for r in rows)
        print(f"| {'measure'.ljust(width)} | value |\n|{'-' * (width + 2)}|------:|")
        for name, value in rows:
            print(f"| {name.ljust(width)} | {value} |")
        return 0
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
