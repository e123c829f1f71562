"""Which Redis eviction policies keep the proxy's records, and the refusal line (proxy/eviction.py)."""

from __future__ import annotations

import pytest

from proxy.config import load_config
from proxy.eviction import MasterMemory, Verdict, may_evict

# Every maxmemory-policy Redis 7/8 and Valkey know. Only noeviction keeps keys that carry a TTL.
EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random",
            "volatile-ttl")


def test_only_noeviction_keeps_the_records():
    assert not may_evict("noeviction")
    assert all(may_evict(policy) for policy in EVICTING)
    assert may_evict("")  # INFO did not say (or was refused): not known to be safe
    assert may_evict("allkeys-lrm")  # a policy a later Redis may add is refused until it is known


@pytest.mark.parametrize("policy", EVICTING)
def test_the_refusal_is_one_line_naming_the_master_its_policy_and_the_override(policy):
    verdict = Verdict((MasterMemory("10.0.0.5:6379", "noeviction", 0), MasterMemory("10.0.0.6:6379", policy, 3)),
                      accepted=False)
    assert not verdict.ok
    line = verdict.refusal()
    assert "\n" not in line
    assert f"{policy} on 10.0.0.6:6379" in line and "10.0.0.5" not in line
    assert "noeviction" in line and "redis.accept_eviction" in line and "TOOLPROXY_REDIS_ACCEPT_EVICTION" in line


def test_accepting_eviction_makes_the_verdict_ok_but_still_names_the_masters():
    verdict = Verdict((MasterMemory("a:1", "volatile-ttl", 0),), accepted=True)
    assert verdict.ok and [m.node for m in verdict.evicting] == ["a:1"]
    assert Verdict((MasterMemory("a:1", "noeviction", 0),), accepted=False).ok


def test_the_override_is_off_by_default_and_named_in_the_environment():
    assert load_config(env={}).redis.accept_eviction is False
    assert load_config(env={"TOOLPROXY_REDIS_ACCEPT_EVICTION": "true"}).redis.accept_eviction is True
