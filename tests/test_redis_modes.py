"""Redis modes beyond the shared tests: the start-up slot check and replica acknowledgement (WAIT)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.metrics import sample, samples, scrape_text
from tests.support.stack import REPO, running_stack


def test_run_stops_with_one_line_on_a_prefix_that_breaks_the_slots():
    env = {"PATH": "/usr/bin:/bin", "TOOLPROXY_REDIS_KEY_PREFIX": "tp{", "TOOLPROXY_IDENTITY_MODE": "static"}
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("toolproxy: redis: the keys of script"), done.stderr


@pytest.mark.parametrize("redis_mode", ["sentinel", "cluster"], indirect=True)
@pytest.mark.parametrize("acks,shortfalls", [(-1, 0), (2, 1)], ids=["by-mode", "more-than-replicas"])
async def test_a_write_waits_for_its_replica_and_a_shortfall_is_counted(proxy_deps, acks, shortfalls):
    """One replica per master: the mode's default (1 ack) is met; asking for 2 is a counted shortfall of the
    reservation and of the committed outcome (the call itself still succeeds)."""
    settings = {**proxy_deps, "redis.min_replica_acks": acks, "redis.timeout_ms": 3000,
                "redis.replica_ack_timeout_ms": 1000 if acks < 2 else 100, "reconcile.enabled": False}
    async with running_stack(settings) as stack:
        status, env = await stack.call("refund_order", {"order_id": "ord_1002", "amount": 100, "reason": "x"},
                                       headers={"Idempotency-Key": "wait-1"})
        assert status == 200 and env["outcome"] == "succeeded", env
        values = samples(await scrape_text(stack))
        for transition in ("begin", "commit"):
            name = sample("toolproxy_redis_replica_ack_shortfalls_total", transition=transition)
            assert values.get(name, 0) == shortfalls, (transition, values.get(name))
