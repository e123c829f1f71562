"""The quota stage's decisions around its admission script (proxy/quotas.py), in-process: a fake plays the
script's documented contract (KEYS one per counter; ARGV member, lease, then kind / emission or slots / burst
per counter; reply ``{1}`` or ``{0, i, retry ms}``). The Lua itself, GCRA and slots, runs against a real
Redis in tests/test_quotas.py and tests/test_quotas_fleet.py."""

from __future__ import annotations

import pytest

from proxy.backpressure import BackendGuard
from proxy.config import load_config
from proxy.deadline import Deadline
from proxy.errors import ProxyError
from proxy.identity import Caller
from proxy.quotas import _ADMIT, _RELEASE, CONCURRENCY_RETRY_CAP_MS, QuotaStage
from proxy.registry import load_registry
from proxy.telemetry.metrics import Metrics
from tests.unit import DEMO_REGISTRY

REGISTRY = load_registry([DEMO_REGISTRY])
READ, WRITE = REGISTRY.get("get_order", "1.0.0"), REGISTRY.get("refund_order", "1.0.0")
CALLER = Caller(subject="bot-1", tenant="acme", roles=(), scopes=(), agent="bot", source="static")
NO_DEADLINE = Deadline(None)


class AdmitContract:
    """Stands where Redis would: the admission script answers ``replies`` in order (an exception: Redis is
    away), the release script records what it frees. Each call's KEYS and ARGV are kept."""

    def __init__(self, *replies: object) -> None:
        self.replies = list(replies)
        self.admits: list[tuple[list[str], list[object]]] = []
        self.released: list[tuple[list[str], list[object]]] = []

    def register_script(self, source: str):
        async def run(keys: list[str], args: list[object]) -> object:
            if source == _RELEASE.source:
                self.released.append((keys, args))
                return 1
            assert source == _ADMIT.source, "back-pressure keeps to its in-memory state here: no script of its own"
            self.admits.append((keys, args))
            reply = self.replies.pop(0)
            if isinstance(reply, Exception):
                raise reply
            return reply
        return run


def stage(redis: AdmitContract, tenant: str = "rate=5/1s burst=3 concurrency=2", **settings: object) -> QuotaStage:
    config = load_config(env={}, overrides={"quotas.tenant": tenant, **settings})
    metrics = Metrics()
    guard = BackendGuard(redis, config.quotas, REGISTRY, key_prefix="t", metrics=metrics)  # type: ignore[arg-type]
    return QuotaStage(redis, config, REGISTRY, metrics, guard)  # type: ignore[arg-type]


async def test_one_script_step_counts_every_counter_and_the_slots_are_released_by_the_same_member():
    redis = AdmitContract([1])
    quotas = stage(redis)
    ticket = await quotas.admit(CALLER, READ, None, NO_DEADLINE, wait=False)
    [(keys, args)] = redis.admits
    assert [k.rsplit(":", 1)[1] for k in keys] == ["rate", "slots"]
    assert all("{q}" in k and "acme" in k for k in keys)  # one hash tag: one script, one Cluster slot
    member, lease_ms, *counters = args
    assert counters == ["r", "200.000000", 3, "c", 2, CONCURRENCY_RETRY_CAP_MS]
    assert lease_ms > READ.timeout_ms  # an undeadlined call's longest life, plus the grace
    assert ticket.member == member and ticket.slot_keys == (keys[1],) and ticket.slot_limits == ("tenant",)
    await quotas.finish(ticket, sent=True, error=None)
    assert redis.released == [([keys[1]], [member])]


async def test_a_refusal_names_the_limit_and_when_to_retry_and_holds_nothing():
    redis = AdmitContract([0, 1, 250])
    with pytest.raises(ProxyError) as refused:
        await stage(redis).admit(CALLER, READ, None, NO_DEADLINE, wait=False)
    assert refused.value.code == "rate_limited" and refused.value.phase == "quota"
    assert refused.value.details == {"limit": "tenant", "retry_after_s": 0.25}
    assert len(redis.admits) == 1 and redis.released == []


async def test_a_batch_call_waits_for_the_rate_and_is_counted_once():
    redis = AdmitContract([0, 1, 20], [1])
    ticket = await stage(redis).admit(CALLER, READ, None, NO_DEADLINE, wait=True)
    assert len(redis.admits) == 2 and redis.admits[0] == redis.admits[1]  # the same member, the same counters
    assert ticket.member == redis.admits[0][1][0]


async def test_a_batch_call_whose_deadline_ends_before_the_retry_is_refused_at_once():
    redis = AdmitContract([0, 1, 60_000])
    soon = Deadline(at=100.0, clock=lambda: 99.0)  # one second left, the rate frees in a minute
    with pytest.raises(ProxyError) as refused:
        await stage(redis).admit(CALLER, READ, None, soon, wait=True)
    assert refused.value.code == "rate_limited" and len(redis.admits) == 1


@pytest.mark.parametrize("tool, admitted", [(READ, True), (WRITE, False)], ids=["read proceeds", "write refused"])
async def test_redis_away_lets_a_read_go_uncounted_and_refuses_a_write_by_default(tool, admitted):
    redis = AdmitContract(ConnectionRefusedError("redis away"))
    quotas = stage(redis)
    if admitted:
        ticket = await quotas.admit(CALLER, tool, None, NO_DEADLINE, wait=False)
        assert ticket.slot_keys == () and ticket.member == ""
        return
    with pytest.raises(ProxyError) as refused:
        await quotas.admit(CALLER, tool, None, NO_DEADLINE, wait=False)
    assert refused.value.code == "dependency_unavailable" and refused.value.details["limit"] == "tenant"


async def test_a_call_no_limit_applies_to_costs_no_script_step():
    redis = AdmitContract()
    ticket = await stage(redis, tenant="").admit(CALLER, READ, None, NO_DEADLINE, wait=False)
    assert redis.admits == [] and ticket.slot_keys == ()
