"""What each process decides from the fleet's back-pressure state (proxy/backpressure.py), in-process: the
snapshot script's reply and the channel's transitions are played by a fake of their contract (the documented
reply ``{now ms, backend, "<state>:<until ms>:<code>", ...}`` and the message ``"<backend> <state> <ms>
<code>"``). The Lua itself runs against a real Redis in tests/test_quotas.py and tests/test_quotas_fleet.py."""

from __future__ import annotations

import pytest

from proxy.backpressure import _SNAPSHOT, PROBE_BUSY_RETRY_S, BackendGuard
from proxy.config import load_config
from proxy.errors import ProxyError
from proxy.registry import load_registry
from proxy.telemetry.metrics import Metrics
from tests.unit import DEMO_REGISTRY

NOW_MS = 1_700_000_000_000


class ScriptContract:
    """Stands where Redis would: the snapshot script answers the replies queued in ``snapshots``; the half-open
    probe's ``SET NX`` answers ``probe_claims``. Any other command fails the test (a closed backend must cost
    no Redis command)."""

    def __init__(self) -> None:
        self.snapshots: list[list[object]] = []
        self.probe_claims: list[bool | None] = []
        self.commands: list[str] = []

    def register_script(self, source: str):
        async def run(keys: list[str], args: list[object] | None = None) -> object:
            assert source == _SNAPSHOT.source, "only the snapshot script is played here"
            self.commands.append("snapshot")
            return self.snapshots.pop(0)
        return run

    async def set(self, key: str, value: str, *, nx: bool, px: int) -> bool | None:
        assert nx and px > 0 and key.endswith(":probe:billing")
        self.commands.append("probe")
        return self.probe_claims.pop(0)


def guard() -> tuple[BackendGuard, ScriptContract]:
    redis = ScriptContract()
    config = load_config(env={})
    return BackendGuard(redis, config.quotas, load_registry([DEMO_REGISTRY]), key_prefix="t",  # type: ignore[arg-type]
                        metrics=Metrics()), redis


async def refusal(g: BackendGuard, backend: str) -> ProxyError:
    with pytest.raises(ProxyError) as refused:
        await g.admit(backend)
    return refused.value


async def test_a_backend_the_snapshot_does_not_name_takes_calls_without_a_redis_command():
    g, redis = guard()
    redis.snapshots.append([NOW_MS])
    await g._subscribed()  # what the channel listener runs after each (re)subscription
    assert g.synced.is_set()
    assert await g.admit("billing") is False and await g.admit("never-seen") is False
    assert redis.commands == ["snapshot"]


async def test_a_paused_backend_refuses_with_its_code_for_the_time_the_snapshot_says():
    g, redis = guard()
    redis.snapshots.append([NOW_MS, b"billing", f"paused:{NOW_MS + 2000}:dependency_unavailable".encode(),
                            b"mail", f"paused:{NOW_MS + 30_000}:".encode()])
    await g._subscribed()
    busy = await refusal(g, "billing")
    assert busy.code == "dependency_unavailable" and busy.details["reason"] == "backend_retry_after"
    assert busy.details["limit"] == "backend:billing" and 1.0 < busy.details["retry_after_s"] <= 2.0
    assert (await refusal(g, "mail")).code == "rate_limited"  # a pause without a code: the 429 it came from
    assert redis.commands == ["snapshot"]


async def test_a_later_snapshot_without_the_backend_closes_it():
    g, redis = guard()
    redis.snapshots += [[NOW_MS, b"billing", f"open:{NOW_MS + 60_000}:".encode()], [NOW_MS + 5]]
    await g._subscribed()
    assert (await refusal(g, "billing")).details["reason"] == "breaker_open"
    await g._subscribed()  # resubscribed after a lost connection: the breaker closed meanwhile
    assert await g.admit("billing") is False


async def test_channel_messages_move_the_state_and_a_malformed_one_is_ignored():
    g, redis = guard()
    redis.snapshots.append([NOW_MS])
    await g._subscribed()
    g._apply_event(b"billing paused 1500 rate_limited")  # what the listener hands each message
    assert (await refusal(g, "billing")).code == "rate_limited"
    g._apply_event(b"billing closed 0")
    assert await g.admit("billing") is False
    g._apply_event(b"billing paused soon")
    g._apply_event(b"billing melted 100 x")
    assert await g.admit("billing") is False


async def test_an_open_breaker_is_not_shortened_to_a_pause():
    g, redis = guard()
    redis.snapshots.append([NOW_MS])
    await g._subscribed()
    g._apply_event(b"billing open 60000 ")
    g._apply_event(b"billing paused 1 rate_limited")
    refused = await refusal(g, "billing")
    assert refused.details["reason"] == "breaker_open" and refused.details["retry_after_s"] > 50


async def test_a_pause_that_ran_out_closes_without_asking_redis():
    g, redis = guard()
    redis.snapshots.append([NOW_MS, b"billing", f"paused:{NOW_MS}:rate_limited".encode()])
    await g._subscribed()
    assert await g.admit("billing") is False and await g.admit("billing") is False
    assert redis.commands == ["snapshot"]


async def test_past_its_open_time_one_call_claims_the_probe_and_the_others_wait():
    g, redis = guard()
    redis.snapshots.append([NOW_MS, b"billing", f"open:{NOW_MS}:".encode()])
    redis.probe_claims += [True, None]
    await g._subscribed()
    assert await g.admit("billing") is True  # this call is the probe
    waiting = await refusal(g, "billing")  # another replica (or call) holds the claim
    assert waiting.details == {"limit": "backend:billing", "reason": "breaker_open",
                               "retry_after_s": PROBE_BUSY_RETRY_S}
    assert redis.commands == ["snapshot", "probe", "probe"]
