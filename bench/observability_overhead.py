"""How much do metrics, the audit record and the log context cost per call?

Runs N read and N write calls through an in-process proxy and the demo backend
(real HTTP on loopback), audit records going to stdout (redirected to
/dev/null here), then prints the mean and p99 of the ``commit`` stage (metrics
+ unknown index + final audit record) and the ``audit`` stage (the intent
record of fail-closed writes) from the proxy's own histograms.

    .venv/bin/python -m bench.observability_overhead [N]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from prometheus_client.parser import text_string_to_metric_families

from bench.servers import real_dependencies
from tests.support.stack import running_stack


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return float("inf")


async def main(n: int, deps: dict[str, str]) -> None:
    async with running_stack(deps) as stack:
        for i in range(n):
            await stack.call("get_order", {"order_id": "ord_1001"})
            await stack.call("adjust_counter", {"counter": "ctr_bench", "delta": 1})
        async with stack.session.get(stack.ops_url + "/metrics") as response:
            text = await response.text()
    stages: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "toolproxy_stage_duration_seconds":
            continue
        for s in family.samples:
            entry = stages.setdefault(s.labels["stage"], {"buckets": []})
            if s.name.endswith("_bucket"):
                entry["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                entry["sum"] = s.value
            elif s.name.endswith("_count"):
                entry["count"] = s.value
    print(f"{2 * n} calls ({n} reads, {n} writes)", file=sys.stderr)
    for stage in ("audit", "commit", "decode", "normalize"):
        e = stages[stage]
        print(f"{stage:10s} mean {1e6 * e['sum'] / e['count']:8.1f} us   p99 <= "
              f"{1e6 * _quantile(sorted(e['buckets']), 0.99):8.1f} us   ({int(e['count'])} observations)",
              file=sys.stderr)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    with real_dependencies() as deps, open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        asyncio.run(main(count, deps))
