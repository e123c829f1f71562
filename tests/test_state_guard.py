"""A state guard between the decision and the write (issue 29 item 12; seed 003 §2 and §3.3
``expectedState``, seed 004 §4: "授权和写入在同一事务或带版本条件"), with real OPA, Redis and the demo
backend. The demo's ``transfer_project`` declares ``state_guard: {argument: expected_owner}``: the proxy
forwards the expected owner as ``If-Match`` (the argument travels in the body too) and the backend
applies the transfer only if the project still has that owner.

The seed's transfer race: OPA allows the call, then, while the request is on its way, the project
changes hands; the write is refused by the condition and the outcome is ``failed`` with the backend's
answer, never ``succeeded``.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.stack import running_stack
from tests.support.waits import wait_until

TRANSFER = {"project_id": "prj_1001", "to_owner": "bob", "expected_owner": "dev-user"}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as s:
        s.auto_key = True
        yield s


def _transfers(stack):
    return [r for r in stack.backend.requests if r["tool"] == "transfer_project"]


async def test_the_expected_state_is_forwarded_and_a_current_one_applies(stack):
    status, env = await stack.call("transfer_project", TRANSFER)
    assert status == 200 and env["outcome"] == "succeeded", env
    assert env["data"] == {"project_id": "prj_1001", "owner": "bob", "version": 2}
    assert _transfers(stack)[0]["headers"]["If-Match"] == '"dev-user"'
    assert stack.backend.projects["prj_1001"]["owner"] == "bob"


async def test_the_transfer_race_is_refused_by_the_condition_never_succeeded(stack):
    # The backend holds the request a second after it arrives (after OPA allowed it and the lock was taken);
    # meanwhile the project changes hands outside this call.
    await stack.fault("transfer_project", "slow", delay_ms=1000, count=1)
    call = asyncio.create_task(stack.call("transfer_project", TRANSFER))
    await wait_until(lambda: _transfers(stack), timeout=10, what="the transfer reached the backend")
    stack.backend.projects["prj_1001"]["owner"] = "mallory"  # transferred by someone else since the decision
    status, env = await call
    assert env["outcome"] == "failed", env
    error = env["error"]
    assert error["phase"] == "execute"  # authorized, sent, refused by the backend's condition
    assert error["details"]["backend_status"] == 412 and error["details"]["backend_code"] == "state_changed"
    assert env["side_effect"] == {"attempted": True, "committed": False}
    assert stack.backend.projects["prj_1001"]["owner"] == "mallory" and not stack.backend.effects
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert record.state == "FAILED_FINAL"  # a definite refusal: a retry with the same key gets the same answer
    _, again = await stack.call("transfer_project", TRANSFER, headers={"Idempotency-Key": "test-key-1"})
    assert again["outcome"] == "failed" and again.get("replayed") is True and len(_transfers(stack)) == 1


async def test_the_expected_state_may_come_as_an_if_match_header(stack):
    args = {"project_id": "prj_1002", "to_owner": "carol"}
    status, env = await stack.call("transfer_project", args, headers={"If-Match": '"alice"'})
    assert status == 200 and env["outcome"] == "succeeded", env
    sent = _transfers(stack)[0]
    assert sent["headers"]["If-Match"] == '"alice"' and stack.backend.projects["prj_1002"]["owner"] == "carol"
    # The header is the argument: the same call with the argument spelled out is the same operation.
    _, again = await stack.call("transfer_project", {**args, "expected_owner": "alice"},
                                headers={"Idempotency-Key": "test-key-1"})
    assert again.get("replayed") is True and len(_transfers(stack)) == 1


async def test_an_if_match_that_cannot_be_honoured_runs_nothing(stack):
    _, disagree = await stack.call("transfer_project", TRANSFER, headers={"If-Match": '"someone-else"'})
    assert disagree["error"]["code"] == "invalid_arguments"
    _, unguarded = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 1, "reason": "x"},
                                    headers={"If-Match": '"v1"'})
    assert unguarded["error"]["code"] == "invalid_request" and unguarded["error"]["details"]["header"] == "If-Match"
    _, weak = await stack.call("transfer_project", TRANSFER, headers={"If-Match": 'W/"dev-user"'})
    assert weak["error"]["code"] == "invalid_request"
    status, batch = await stack.post("/v1/tool-calls:batch", {"calls": [
        {"call_id": "a", "tool": "transfer_project", "arguments": TRANSFER}]},
        headers={"If-Match": '"dev-user"', "Idempotency-Key": "b1"})
    assert status == 400 and batch["error"]["code"] == "invalid_request", batch
    assert not stack.backend.requests and stack.backend.projects["prj_1001"]["owner"] == "dev-user"


async def test_a_project_transferred_between_the_decision_and_the_write_is_refused_unsent(stack):
    """The proxy reads the guarded state itself (``state_guard.read``), under the project's lock, right before
    sending. Here the project changes hands after this call's decision, while it waits for the lock held by
    the write that transfers it: the read sees the new owner and nothing is sent."""
    await stack.fault("transfer_project", "slow", delay_ms=600, count=1)
    first = asyncio.create_task(stack.call("transfer_project", {**TRANSFER, "to_owner": "mallory"},
                                           headers={"Idempotency-Key": "first-transfer"}))
    await wait_until(lambda: _transfers(stack), timeout=10, what="the first transfer to hold the project's lock")
    status, env = await stack.call("transfer_project", TRANSFER, headers={"Idempotency-Key": "second-transfer"})
    _, done = await first
    assert done["outcome"] == "succeeded" and stack.backend.projects["prj_1001"]["owner"] == "mallory"

    assert status == 412 and env["outcome"] == "failed", env
    assert env["error"]["code"] == "state_changed" and env["error"]["details"]["field"] == "expected_owner"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert len(_transfers(stack)) == 1  # the second transfer never reached the backend
    reads = [r for r in stack.backend.requests if r["tool"] == "get_project"]
    assert len(reads) == 2  # each transfer read the owner under its lock
    assert await stack.runtime.operations.get(env["idempotency_key"]) is None  # nothing sent: the key is free


def test_check_registry_warns_about_writes_whose_state_nothing_checks(capsys):
    from proxy.cli import main as cli_main
    from tests.support.stack import DEMO_REGISTRY
    assert cli_main(["check-registry", str(DEMO_REGISTRY)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "not checked at the write" in line]
    assert any(line.startswith("warning: refund_order 1.0.0") for line in warned), warned
    assert not any("transfer_project" in line or "get_project" in line for line in warned)
