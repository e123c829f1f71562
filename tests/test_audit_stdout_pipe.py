"""The stdout audit sink never blocks the event loop: a real `toolproxy run` whose stdout pipe nobody reads.

The pipe is shrunk to one page so a handful of records fill it. Reads keep succeeding (their final
records wait in the sink's bounded queue, then are dropped and counted); a fail-closed write whose
intent record cannot leave the process is refused before anything is sent; once somebody reads the
pipe again, the queued records arrive in order and writes go through.
"""

from __future__ import annotations

import asyncio
import fcntl
import threading

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from tests.support.audit import audit_records
from tests.support.proxyproc import ProxyProcess
from tests.support.waits import wait_until

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


async def _sample(session: aiohttp.ClientSession, proxy: ProxyProcess, name: str) -> float:
    async with session.get(f"http://127.0.0.1:{proxy.ops_port}/metrics") as response:
        text = await response.text()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and s.labels.get("sink") == "stdout")


async def _call(session: aiohttp.ClientSession, proxy: ProxyProcess, tool: str, arguments: dict,
                **headers: str) -> dict:
    body = {"call_id": "c1", "tool": tool, "arguments": arguments}
    async with session.post(proxy.url + "/v1/tool-calls", json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=30)) as response:
        return await response.json()


async def test_a_stdout_pipe_nobody_reads_never_stalls_calls(proxy_deps):
    runner, backend_url, backend = await start_demo_backend(keys=session_keys().jwks)
    proxy = ProxyProcess({**proxy_deps, "backends.services": {"demo": backend_url},
                          "audit.stdout_queue_records": 5, "log.level": "warning"}, stdout_pipe=True).start()
    try:
        assert proxy.proc is not None and proxy.proc.stdout is not None
        fcntl.fcntl(proxy.proc.stdout.fileno(), F_SETPIPE_SZ, 4096)
        await proxy.ready()
        async with aiohttp.ClientSession() as session:
            # Fill the pipe, then the queue (5 records), then drop: every read still answers.
            for _ in range(20):
                env = await _call(session, proxy, "get_order", {"order_id": "ord_1001"})
                assert env["outcome"] == "succeeded", env
                if await _sample(session, proxy, "toolproxy_audit_dropped_records_total") > 0:
                    break
            assert await _sample(session, proxy, "toolproxy_audit_queued_records_total") >= 5
            assert await _sample(session, proxy, "toolproxy_audit_dropped_records_total") > 0

            # A fail-closed write: its intent record cannot leave, so nothing is sent.
            refused = await _call(session, proxy, "adjust_counter", {"counter": "ctr_pipe", "delta": 1},
                                  **{"Idempotency-Key": "pipe-1"})
            assert refused["error"]["code"] == "audit_unavailable", refused
            assert refused["side_effect"] == {"attempted": False, "committed": False}
            assert backend.counters.get("ctr_pipe", 0) == 0

            # Somebody reads stdout again: the queue drains and a write goes through.
            lines: list[bytes] = []

            def read_stdout() -> None:
                for line in proxy.proc.stdout:  # type: ignore[union-attr]
                    lines.append(line)

            threading.Thread(target=read_stdout, daemon=True).start()
            await wait_until(lambda: any(b'"kind":"tool_call"' in line for line in lines), timeout=10,
                             what="queued records reaching the reader")

            async def write_succeeds() -> bool:
                env = await _call(session, proxy, "adjust_counter", {"counter": "ctr_pipe", "delta": 1},
                                  **{"Idempotency-Key": "pipe-2"})
                return env["outcome"] == "succeeded"

            assert await write_succeeds()
            assert backend.counters["ctr_pipe"] == 1
    finally:
        proxy.stop()
        await runner.cleanup()
    records = audit_records([line.decode() for line in lines])  # each one valid against the schema
    assert records, "no audit record reached the pipe"
    kinds = [r["kind"] for r in records]
    assert "tool_call_intent" in kinds and kinds.count("tool_call") >= 2
