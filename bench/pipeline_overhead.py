"""What does the proxy add to a tool call? Direct backend call vs the full pipeline.

Runs N sequential calls of a read (``get_order``) and of a locked, audited write
(``adjust_counter``) straight to the demo backend and through an in-process
proxy (real OPA with the repo's policies, real Redis, real HTTP on loopback),
then prints mean / p50 / p99 latency of both paths, the added overhead, and
the mean of each pipeline stage from the proxy's own histograms.

    .venv/bin/python -m bench.pipeline_overhead [N]

Target (2-core dev machine): added p50 overhead below 5 ms for reads and
15 ms for locked writes; this is a benchmark, not a test, so read the numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from bench.servers import real_dependencies
from tests.support.calltokens import session_keys
from tests.support.stack import running_stack


def summary(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.fmean(ordered) * 1000, statistics.median(ordered) * 1000, p99 * 1000


async def timed(make_call, n: int) -> list[float]:
    samples = []
    for i in range(n):
        started = time.perf_counter()
        await make_call(i)
        samples.append(time.perf_counter() - started)
    return samples


async def main(n: int, deps: dict[str, str]) -> None:
    async with running_stack(deps) as stack:
        async def direct(tool: str, args: dict) -> None:  # with a call token, as the backend demands
            body = json.dumps(args).encode()
            headers = session_keys().headers_for("POST", f"/tools/{tool}", body, {"Content-Type": "application/json"})
            async with stack.session.post(f"{stack.backend_url}/tools/{tool}", data=body,
                                          headers=headers) as response:
                assert response.status == 200, await response.text()
                await response.read()

        async def proxied(tool: str, args: dict) -> None:
            status, env = await stack.call(tool, args)
            assert env["outcome"] == "succeeded", env

        stack.backend.counter_delay_ms = 0
        cases = {
            "read  get_order": ("get_order", lambda i: {"order_id": "ord_1001"}),
            "write adjust_counter": ("adjust_counter", lambda i: {"counter": "ctr_bench", "delta": 1}),
        }
        for label, (tool, args) in cases.items():
            await timed(lambda i: direct(tool, args(i)), 20)  # warm up both paths
            await timed(lambda i: proxied(tool, args(i)), 20)
            base = summary(await timed(lambda i: direct(tool, args(i)), n))
            via = summary(await timed(lambda i: proxied(tool, args(i)), n))
            print(f"{label:22s} direct mean {base[0]:6.2f} p50 {base[1]:6.2f} p99 {base[2]:6.2f} ms | "
                  f"proxy mean {via[0]:6.2f} p50 {via[1]:6.2f} p99 {via[2]:6.2f} ms | "
                  f"added p50 {via[1] - base[1]:6.2f} ms", file=sys.stderr)
        async with stack.session.get(stack.ops_url + "/metrics") as response:
            text = await response.text()
    for family in text_string_to_metric_families(text):
        if family.name == "toolproxy_stage_duration_seconds":
            sums = {s.labels["stage"]: s.value for s in family.samples if s.name.endswith("_sum")}
            counts = {s.labels["stage"]: s.value for s in family.samples if s.name.endswith("_count")}
            print("stage means (us): " + "  ".join(f"{k} {1e6 * sums[k] / counts[k]:.0f}"
                                                  for k in sorted(sums) if counts.get(k)), file=sys.stderr)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with real_dependencies() as deps, open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        asyncio.run(main(count, deps))
