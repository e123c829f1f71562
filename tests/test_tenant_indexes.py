"""A noisy tenant cannot push another tenant's entries out of the lists its operators read: denials and open
(unknown) operations are kept per tenant beside the fleet's capped lists, against a real Redis (every mode's
scripts stay in one slot: the tenant's open index shares its bucket's hash tag)."""

from __future__ import annotations

import hashlib

import pytest

from proxy.telemetry.metrics import Metrics
from proxy.integrity import RecordMac
from proxy.operations import OperationStore
from proxy.policy.denials import KEEP, DenialLog
from tests.support.modes import all_redis_modes


async def test_a_noisy_tenants_denials_leave_the_quiet_tenants_in_place(state_client):
    log = DenialLog(state_client, "tp-test", Metrics())

    async def deny(tenant: str, n: int) -> None:
        await log.record(tenant=tenant, subject="s", tool="refund_order", tool_version="1.0.0",
                         reasons=("amount_above_limit",), decision_id=None, policy_revision=None,
                         request_id=f"req_{tenant}_{n}", call_id=None)

    await deny("quiet", 0)
    for n in range(KEEP + 20):
        await deny("noisy", n)
    quiet = await log.recent(tenant="quiet")
    assert [e["request_id"] for e in quiet["recent"]] == ["req_quiet_0"]
    assert quiet["by_tool_and_reason"][0]["count"] == 1
    fleet = await log.recent(tenant=None, limit=KEEP)
    assert len(fleet["recent"]) == KEEP and {e["tenant"] for e in fleet["recent"]} == {"noisy"}
    assert len((await log.recent(tenant="noisy", limit=KEEP))["recent"]) == KEEP


@all_redis_modes
async def test_a_noisy_tenants_unknown_operations_leave_the_quiet_tenants_listed(state_client, redis_mode):
    store = OperationStore(state_client, "tp-test", mac=RecordMac.from_file(""))  # a key of this test only

    async def unknown(tenant: str, n: int) -> str:
        key = "ik_" + hashlib.sha256(f"{tenant}/{n}".encode()).hexdigest()
        began = await store.begin(key, fingerprint="fp", nonce=f"n{n}", lease_ms=60000, retention_s=600,
                                  is_write=True, max_attempts=3, meta={"tenant": tenant, "tool": "t"},
                                  first_check_ms=1000, window_ms=60000)
        assert began.status == "new"
        done = await store.commit(key, token=int(began.values[0]), target="UNKNOWN", outcome=None,
                                  evidence={"observed": "test"}, first_check_ms=1000, window_ms=60000)
        assert done.values[0] == "UNKNOWN"
        return key

    noisy = [await unknown("noisy", n) for n in range(30)]
    quiet = await unknown("quiet", 0)
    assert quiet not in await store.open_keys(10)  # the fleet's ten oldest are all the noisy tenant's
    assert await store.open_keys(10, tenant="quiet") == [quiet]
    assert len(await store.open_keys(100, tenant="noisy")) == 30
    # Settled (an operator's verdict), it leaves its tenant's index with the fleet's.
    await store.resolve_by_operator(quiet, verdict="SUCCEEDED", outcome={"data": {}}, evidence={"note": "x"})
    assert await store.open_keys(10, tenant="quiet") == []
    assert set(await store.open_keys(100)) == set(noisy)
