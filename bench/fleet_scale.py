"""How many sidecars does one Redis (or one Cluster) serve? N proxies against one topology, measured.

Starts a 6-node Redis Cluster (3 masters + 3 replicas) or a single Redis, real OPA, one demo
backend, and N ``toolproxy run`` processes (the sidecars), then drives locked, idempotent writes
(``adjust_counter``: reservation + lock + commit, with WAIT for one replica in cluster mode) and
reads with a fixed number of concurrent clients per proxy. Prints calls/s and Redis CPU per call
(``INFO cpu`` used_cpu_sys + used_cpu_user summed over every Redis process, before/after), then the
``MEMORY USAGE`` of one operation record, one held lock, one fencing counter and one approval.

    .venv/bin/python -m bench.fleet_scale [--mode cluster|standalone] [--proxies 1,2,4] [--seconds 10]

Everything runs on this machine, so the proxies, OPA, the backend and Redis share its cores: the
calls/s are a floor for a real fleet; the Redis CPU per call is the number that scales.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio.cluster import RedisCluster

from bench.servers import REPO
from proxy.config import load_config
from proxy.deadline import Deadline
from proxy.normalize import ResourceRef
from proxy.store import close_client, create_client
from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from tests.support.proxyproc import ProxyProcess
from tests.support.servers import OpaServer, RedisServer
from tests.support.stack import DEMO_REGISTRY, running_stack
from tests.support.topologies import PASSWORD, RedisClusterGroup

CLIENTS_PER_PROXY = 8


def redis_cpu_s(nodes: list[Any]) -> float:
    total = 0.0
    for node in nodes:
        info = node.client().info("cpu")
        total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


async def drive(proxies: list[ProxyProcess], seconds: float, kind: str) -> tuple[int, dict[str, int]]:
    counter = itertools.count()
    run = uuid.uuid4().hex[:8]  # fresh operation keys for every run (same Redis throughout)
    done = 0
    refused: collections.Counter[str] = collections.Counter()
    until = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, proxy: ProxyProcess, c: int) -> None:
        nonlocal done
        while time.monotonic() < until:
            n = next(counter)
            if kind == "write":
                body = {"call_id": f"w{n}", "tool": "adjust_counter",
                        "arguments": {"counter": f"ctr_{c}", "delta": 1}}  # one counter per client
                headers = {"Idempotency-Key": f"bench-{run}-{n}"}
            else:
                body = {"call_id": f"r{n}", "tool": "get_order", "arguments": {"order_id": "ord_1001"}}
                headers = {}
            async with session.post(proxy.url + "/v1/tool-calls", json=body, headers=headers) as response:
                answer = await response.json()
                if response.status == 200:
                    done += 1
                else:
                    refused[(answer.get("error") or {}).get("code", str(response.status))] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, p, i * CLIENTS_PER_PROXY + c) for i, p in enumerate(proxies)
                               for c in range(CLIENTS_PER_PROXY)))
    return done, dict(refused)


async def measure(redis_settings: dict[str, Any], nodes: list[Any], counts: list[int], seconds: float,
                  opa_settings: dict[str, str]) -> list[dict[str, Any]]:
    runner, backend_url, _ = await start_demo_backend(keys=session_keys().jwks)
    rows = []
    try:
        for count in counts:
            settings = {**redis_settings, **opa_settings, "backends.services": {"demo": backend_url},
                        **session_keys().settings(),
                        "registry.paths": [str(DEMO_REGISTRY)], "log.level": "warning",
                        "audit.sinks": ["stdout"]}
            proxies = [ProxyProcess(settings).start() for _ in range(count)]
            try:
                await asyncio.gather(*(p.ready() for p in proxies))
                before = redis_cpu_s(nodes)
                await asyncio.sleep(seconds)
                idle_per_s = (redis_cpu_s(nodes) - before) / seconds  # cron, replication and cluster-bus pings
                for kind in ("write", "read"):
                    before = redis_cpu_s(nodes)
                    started = time.monotonic()
                    calls, refused = await drive(proxies, seconds, kind)
                    elapsed = time.monotonic() - started
                    cpu = redis_cpu_s(nodes) - before - idle_per_s * elapsed
                    rows.append({"proxies": count, "kind": kind, "calls": calls,
                                 "calls_per_s": round(calls / elapsed, 1),
                                 "redis_cpu_ms_per_call": round(cpu * 1000 / max(calls, 1), 3),
                                 "redis_idle_cpu_ms_per_s": round(idle_per_s * 1000, 1), "refused": refused})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                for proxy in proxies:
                    proxy.stop()
    finally:
        await runner.cleanup()
    return rows


async def memory_usage(redis_settings: dict[str, Any], opa_settings: dict[str, str]) -> dict[str, int]:
    """MEMORY USAGE of the keys one write, one held lock and one approval leave behind."""
    client = create_client(load_config(env={}, overrides=redis_settings).redis)
    sizes: dict[str, int] = {}
    try:
        async with running_stack({**redis_settings, **opa_settings, "reconcile.enabled": False}) as stack:
            await stack.call("refund_order", {"order_id": "ord_1002", "amount": 100, "reason": "memory"},
                             headers={"Idempotency-Key": "mem-1"})
            await stack.call("refund_order", {"order_id": "ord_1001", "amount": 9000, "reason": "approval"},
                             headers={"Idempotency-Key": "mem-2"})
            held = await stack.runtime.pipeline._locks.acquire(
                [ResourceRef("order:ord_1002", "exclusive")], tenant="acme", tool="refund_order",
                is_write=True, deadline=Deadline(time.monotonic() + 5))
            for pattern, name in (("toolproxy:op:*", "operation record (SUCCEEDED, with outcome)"),
                                  ("toolproxy:lock:*", "held lock (one resource)"),
                                  ("toolproxy:fence:*", "fencing counter (per tenant)"),
                                  ("toolproxy:approval:*", "approval (pending)"),
                                  ("toolproxy:op-open:*", "unknown index entry set (per bucket)")):
                where = {"target_nodes": RedisCluster.PRIMARIES} if isinstance(client, RedisCluster) else {}
                keys = await client.keys(pattern, **where)
                if keys:
                    sizes[name] = int(await client.memory_usage(keys[0], samples=0))
            await held.release()
    finally:
        await close_client(client)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["cluster", "standalone"], default="cluster")
    parser.add_argument("--proxies", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    counts = [int(c) for c in args.proxies.split(",")]
    opa = OpaServer([REPO / "policies", REPO / "examples" / "opa"])
    opa.start()
    base = Path(tempfile.mkdtemp(prefix="toolproxy-fleet-"))
    if args.mode == "cluster":
        group = RedisClusterGroup(base).start()
        redis_settings, nodes, stop = group.overrides(), group.nodes, group.stop
    else:
        server = RedisServer(data_dir=base)
        server.start()
        redis_settings = {"redis.url": server.url}
        nodes, stop = [server], server.stop
    try:
        asyncio.run(measure(redis_settings, nodes, counts, args.seconds, opa.settings))
        print(json.dumps({"memory_usage_bytes": asyncio.run(memory_usage(redis_settings, opa.settings))}))
    finally:
        stop()
        opa.stop()


if __name__ == "__main__":
    main()
