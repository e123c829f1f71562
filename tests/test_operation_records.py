"""The operation record's stored form (issue 32): one packed string of short field names, an earlier
version's hash record read and migrated, and the bytes a demo write costs in Redis (``MEMORY USAGE``)."""

from __future__ import annotations

import json
import time

import pytest
import redis.asyncio as aredis

from proxy.integrity import RecordMac
from proxy.operations import FIELDS, OperationStore, pack_record, record_keys
from tests.support.records import read_fields
from tests.support.stack import running_stack

# The demo's counter write (adjust_counter) as Redis holds its settled record, in bytes: the goal.
# 648 B measured (584 B before its meta carried a MAC of its own, 47 bytes of it); the hash of three versions
# before took 2,104 B, the packed record before derivation 1,416 B, before its texts were packed 904 B.
DEMO_WRITE_RECORD_MAX_BYTES = 660


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        yield s


async def test_a_demo_write_is_one_packed_record_within_its_byte_bound(stack):
    status, env = await stack.call("adjust_counter", {"counter": "ctr_size", "delta": 1},
                                   headers={"Idempotency-Key": "size-1"})
    assert status == 200 and env["outcome"] == "succeeded", env
    name = record_keys("toolproxy", env["idempotency_key"])[0]
    assert await stack.redis.type(name) == b"string"
    fields = await read_fields(stack.redis, name)
    # The meta and the outcome are stored packed (proxy/record_text.py): neither text is in the value as JSON.
    value = await stack.redis.get(name)
    assert fields["meta"].encode() not in value and fields["outcome"].encode() not in value
    assert b'"traceparent"' not in value and b'"evidence"' not in value
    assert fields["tenant"] == "acme" and fields["omac"].startswith("m2:")
    assert fields["state"] == "SUCCEEDED" and set(fields) <= set(FIELDS)
    stored_meta, stored_outcome = json.loads(fields["meta"]), json.loads(fields["outcome"])
    # Derived on read, so not stored: the target's and the meta's args_hash (its arguments are shown whole),
    # the marks (the target's resources), the executor's evidence, and the outcome's copies of the meta
    # and of the data's digest.
    assert "args_hash" not in stored_meta["target"] and "args_hash" not in stored_meta
    assert stored_meta["marks"] is True and "evidence" not in fields and "tenant" not in stored_meta
    assert set(stored_outcome) == {"data", "evidence", "~"}, stored_outcome
    assert set(stored_outcome["evidence"]) == {"backend_request_id", "server_time"}
    used = await stack.redis.memory_usage(name, samples=0)
    assert used <= DEMO_WRITE_RECORD_MAX_BYTES, used
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert record.meta["target"]["args_hash"] == record.meta["args_hash"]
    assert record.meta["marks"] == ["counter:ctr_size"] == record.meta["target"]["resources"]
    assert stack.runtime.operations.record_verified(record)
    # Read back whole: what the envelope said, as the record held it before anything was derived.
    assert record.outcome == {
        "data": env["data"], "error": None, "call_id": env["call_id"], "request_id": env["request_id"],
        "tool_version": "1.0.0", "side_effect": env["side_effect"], "evidence": env["evidence"]}
    assert record.evidence == {"source": "executor", "observed": "succeeded", "at_ms": record.updated_at}
    # A duplicate is answered from it, evidence and all.
    status, again = await stack.call("adjust_counter", {"counter": "ctr_size", "delta": 1},
                                     headers={"Idempotency-Key": "size-1"})
    assert again["replayed"] is True and again["data"] == env["data"]
    assert again["evidence"] == env["evidence"] and again["side_effect"] == env["side_effect"]


async def test_an_earlier_versions_hash_record_is_read_replayed_and_migrated_on_its_next_change(redis_url):
    client = aredis.Redis.from_url(redis_url)
    mac = RecordMac(b"m" * 32)
    ops = OperationStore(client, "tp", mac=mac)
    key, fingerprint = "ik_" + "5" * 64, "f" * 64
    outcome = json.dumps({"data": {"value": 1}, "error": None, "side_effect": {"attempted": True, "committed": True}},
                         separators=(",", ":"), sort_keys=True)
    name = record_keys("tp", key)[0]
    # Exactly as the version before wrote a settled write: a hash of long field names.
    await client.hset(name, mapping={
        "state": "SUCCEEDED", "attempt": 1, "token": 1, "is_write": 1, "fp": fingerprint, "created_at": 1,
        "updated_at": 2, "retention": 3600, "outcome": outcome, "evidence": '{"source":"executor"}',
        "meta": json.dumps({"tenant": "acme", "tool": "t", "args_hash": "a" * 64,
                            "target": {"args_hash": "a" * 64, "resources": []}}),
        "omac": mac.outcome(key=key, fingerprint=fingerprint, state="SUCCEEDED", outcome=outcome, version="m1")})
    await client.pexpire(name, 3_600_000)
    try:
        record = await ops.get(key)
        assert record.state == "SUCCEEDED" and record.tenant == "acme"
        # Its meta carries no MAC (written before metas had one): its outcome replays (above its MAC's own
        # check), but no view or compensation trusts what its meta says (docs/scale.md).
        assert not ops.record_verified(record)
        answer = await ops.begin(key, fingerprint=fingerprint, nonce="n", lease_ms=1000, retention_s=3600,
                                 is_write=True, max_attempts=3, meta={}, first_check_ms=100, window_ms=1000)
        assert answer.status == "replay" and answer.text(0) == outcome
        assert await client.type(name) == b"hash"  # a read changes nothing
        # The next change (a compensation block) writes it packed, with its TTL and everything it held.
        changed = await ops.set_compensation(key, block={"status": "requested"}, from_statuses=("none",))
        assert changed.status == "ok", changed
        assert await client.type(name) == b"string"
        assert 0 < await client.pttl(name) <= 3_600_000
        migrated = await ops.get(key)
        assert migrated.compensation == {"status": "requested"}
        assert (migrated.outcome_text, migrated.fingerprint, migrated.meta) == (
            record.outcome_text, record.fingerprint, record.meta)
        assert ops.outcome_verified(key, fingerprint=fingerprint, state="SUCCEEDED", outcome=migrated.outcome_text,
                                    mac=migrated.outcome_mac) and not ops.record_verified(migrated)
    finally:
        await client.flushall()
        await client.aclose()


async def test_records_held_are_counted_by_the_hour_their_retention_ends(redis_url):
    client = aredis.Redis.from_url(redis_url)
    ops = OperationStore(client, "tp", mac=RecordMac(b"m" * 32))

    async def begin(key: str, nonce: str = "n"):
        return await ops.begin(key, fingerprint="f" * 64, nonce=nonce, lease_ms=60_000, retention_s=3600,
                               is_write=True, max_attempts=3, meta={"tenant": "acme"}, first_check_ms=100,
                               window_ms=1000)

    async def slots() -> dict[str, int]:
        found: dict[str, int] = {}
        for bucket in "0123456789abcdef":
            for slot, count in (await client.hgetall(f"tp:op-held:{{op{bucket}}}")).items():
                if int(count):
                    found[slot.decode()] = found.get(slot.decode(), 0) + int(count)
        return found

    settled, abandoned, unknown = "ik_" + "1" * 64, "ik_" + "2" * 64, "ik_" + "3" * 64
    try:
        assert await ops.held_records() == 0
        for key in (settled, abandoned, unknown):
            assert (await begin(key)).status == "new"
        assert await ops.held_records() == 3
        # One settles; for one nothing was sent (the reservation is undone, its count taken back); one is unknown.
        await ops.commit(settled, token=1, target="SUCCEEDED", outcome={"data": 1}, evidence={},
                         first_check_ms=100, window_ms=1000, fingerprint="f" * 64)
        await ops.commit(abandoned, token=1, target="ABANDON", outcome=None, evidence={}, first_check_ms=100,
                         window_ms=1000)
        await ops.commit(unknown, token=1, target="UNKNOWN", outcome=None, evidence={}, first_check_ms=100,
                         window_ms=1000)
        assert await client.exists(record_keys("tp", abandoned)[0]) == 0
        assert await ops.held_records() == 2
        # The unknown one never expires ('p'); the settled one is counted in the hour its retention ends.
        counts = await slots()
        ttl_ms = await client.pttl(record_keys("tp", settled)[0])
        assert counts.pop("p") == 1 and len(counts) == 1 and sum(counts.values()) == 1
        [hour] = counts
        assert abs(int(hour) * 3_600_000 - (int(time.time() * 1000) + ttl_ms)) <= 3_600_000
        # Settling the unknown one moves its count from 'p' to an hour: still two records.
        resolved = await ops.resolve_by_operator(unknown, verdict="FAILED_FINAL", outcome=None,
                                                 evidence={"by": "op"})
        assert resolved.status == "ok", resolved
        assert "p" not in await slots() and await ops.held_records() == 2
        # Once their hours are over they are no longer held, and the ended hours are dropped.
        assert await ops.held_records(now_s=time.time() + 3 * 3600) == 0
        assert await slots() == {}
    finally:
        await client.flushall()
        await client.aclose()


async def test_the_version_befores_record_with_plain_texts_is_read_and_its_tenant_index_kept(redis_url):
    """The version before packed the record but not its texts: its meta (with the tenant in it) and outcome
    are JSON, its MAC ``m1``. It is read as it was, an operator settles it, and the scripts find its tenant's
    open index from its meta (it has no ``tenant`` field)."""
    client = aredis.Redis.from_url(redis_url)
    mac = RecordMac(b"m" * 32)
    ops = OperationStore(client, "tp", mac=mac)
    key, fingerprint = "ik_" + "6" * 64, "f" * 64
    name, _, open_index, _, _ = record_keys("tp", key)
    meta = {"tenant": "acme", "tool": "t", "tool_version": "1.0.0", "target": {"resources": ["r:1"]}}
    await client.set(name, pack_record({
        "state": "UNKNOWN", "attempt": "1", "token": "1", "is_write": "1", "fp": fingerprint, "created_at": "1",
        "updated_at": "2", "retention": "3600", "unknown_since": "2", "meta": json.dumps(meta)}))
    await client.zadd(open_index, {key: 2})
    await client.zadd(open_index + ":t:acme", {key: 2})
    try:
        record = await ops.get(key)
        assert record.state == "UNKNOWN" and record.tenant == "acme" and record.meta == meta
        assert await ops.open_keys(10, tenant="acme") == [key]
        outcome = {"data": {"value": 1}, "error": None}
        settled = await ops.resolve_by_operator(key, verdict="SUCCEEDED", outcome=outcome,
                                                evidence={"by": "op"}, fingerprint=fingerprint)
        assert settled.status == "ok", settled
        assert await ops.open_keys(10, tenant="acme") == [] and await ops.open_keys(10) == []
        migrated = await ops.get(key)
        assert migrated.meta == meta and migrated.outcome == outcome and not ops.record_verified(migrated)
        assert ops.outcome_verified(key, fingerprint=fingerprint, state="SUCCEEDED", outcome=migrated.outcome_text,
                                    mac=migrated.outcome_mac)  # its outcome is genuine; its meta unvouched
        assert migrated.outcome_mac.startswith("m2:")
    finally:
        await client.flushall()
        await client.aclose()
