"""Who may act on an operation (proxy/policy/operation_access.py): the facts policy sees of it, and the two
answers given without asking OPA (its own subject may; another tenant's operation does not exist for the
caller). Another subject of the same tenant is OPA's to decide, against the real policies in
tests/test_operation_cancel.py."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.deadline import Deadline
from proxy.errors import ProxyError
from proxy.identity import Caller
from proxy.operations import Record
from proxy.policy.client import RequestFacts
from proxy.policy.operation_access import authorizer, is_own, original_facts

CAROL = Caller(subject="carol", tenant="acme", roles=("support",), scopes=(), agent="bot", source="static")
RECORD = Record(key="ik_" + "a" * 64, state="SUCCEEDED", attempt=1, token=7, is_write=True, created_at=1,
                updated_at=2, retention_s=60,
                meta={"tenant": "acme", "subject": "carol", "tool": "refund_order", "tool_version": "1.0.0",
                      "target": {"resources": ["order:ord_1001"]}, "arguments": {"amount": 5}})


class NoPolicy:
    """Stands where the policy client would: these answers must not ask it."""

    def __getattr__(self, name: str):
        raise AssertionError(f"asked the policy client for {name}")


NO_POLICY: Any = NoPolicy()


def test_the_original_facts_are_the_records_trusted_fields_only():
    assert original_facts(RECORD) == {"idempotency_key": RECORD.key, "tool": "refund_order", "version": "1.0.0",
                                      "tenant": "acme", "subject": "carol", "state": "SUCCEEDED",
                                      "resources": ["order:ord_1001"]}  # no arguments, no outcome
    bare = Record(key="ik_" + "b" * 64, state="IN_PROGRESS", attempt=0, token=0, is_write=False,
                  meta={"tenant": "acme"}, created_at=0, updated_at=0, retention_s=0)
    assert original_facts(bare)["subject"] == "" and original_facts(bare)["resources"] == []


@pytest.mark.parametrize("caller, own", [
    (CAROL, True),
    (Caller(subject="dave", tenant="acme", roles=(), scopes=(), agent="bot", source="static"), False),
    (Caller(subject="carol", tenant="globex", roles=(), scopes=(), agent="bot", source="static"), False),
])
def test_own_means_the_same_subject_in_the_same_tenant(caller, own):
    assert is_own(caller, RECORD) is own


async def test_the_callers_own_operation_is_allowed_without_asking_opa():
    check = authorizer(NO_POLICY, CAROL, "cancel", RequestFacts(request_id="r1"), deadline=Deadline.after(1.0))
    await check(RECORD)


async def test_another_tenants_operation_does_not_exist_for_the_caller():
    stranger = Caller(subject="carol", tenant="globex", roles=("admin",), scopes=(), agent="bot", source="static")
    check = authorizer(NO_POLICY, stranger, "read_operation", RequestFacts(request_id="r1"), deadline=Deadline.after(1.0))
    with pytest.raises(ProxyError) as refused:
        await check(RECORD)
    assert refused.value.code == "operation_not_found" and refused.value.phase == "request"
