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


async def while_transferred(stack, tool: str, arguments: dict, key: str):
    """``tool``'s call made while a transfer of prj_1001 to mallory holds the project's lock at the backend: it
    is decided, then waits for the lock, and the project has changed hands when it gets it. Its answer."""
    await stack.fault("transfer_project", "slow", delay_ms=1500, count=1)
    first = asyncio.create_task(stack.call("transfer_project", {**TRANSFER, "to_owner": "mallory"},
                                           headers={"Idempotency-Key": "first-transfer"}))
    await wait_until(lambda: _transfers(stack), timeout=10, what="the first transfer to hold the project's lock")
    answer = await stack.call(tool, arguments, headers={"Idempotency-Key": key})
    _, done = await first
    assert done["outcome"] == "succeeded" and stack.backend.projects["prj_1001"]["owner"] == "mallory"
    return answer


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
    status, env = await while_transferred(stack, "transfer_project", TRANSFER, "second-transfer")

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
    assert not any(name in line for line in warned for name in ("transfer_project", "rename_project", "get_project"))


RENAME = {"project_id": "prj_1001", "name": "Apollo"}


def _renames(stack):
    return [r for r in stack.backend.requests if r["tool"] == "rename_project"]


async def test_a_state_captured_at_the_decision_is_checked_under_the_lock_and_sent_as_if_match(stack):
    """``rename_project`` names no state in its arguments: its ``state_guard`` reads the project's version
    right after the decision allows the call, and that version is what the write expects. It is sent as
    ``If-Match``, which the demo backend honours."""
    status, env = await stack.call("rename_project", RENAME)
    assert status == 200 and env["outcome"] == "succeeded", env
    assert _renames(stack)[0]["headers"]["If-Match"] == '"1"'
    assert stack.backend.projects["prj_1001"]["name"] == "Apollo"
    reads = [r for r in stack.backend.requests if r["tool"] == "get_project"]
    assert len(reads) == 2  # at the decision, and under the lock right before sending


async def test_a_project_transferred_after_the_decision_is_refused_unsent_without_a_guard_argument(stack):
    """The project changes hands after the rename was allowed, while the rename waits for the project's lock
    (held by the transfer): under the lock the version read differs from the one the decision saw, and the
    rename is refused with nothing sent."""
    status, env = await while_transferred(stack, "rename_project", RENAME, "rename-after")

    assert status == 412 and env["outcome"] == "failed", env
    assert env["error"]["code"] == "state_changed" and env["error"]["phase"] == "execute", env
    assert env["error"]["details"] == {"state": "/version", "state_read": "get_project@1.0.0"}, env
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert not _renames(stack) and "name" not in stack.backend.projects["prj_1001"]
    assert stack.backend.effect_counts().get("rename_project") is None
    assert await stack.runtime.operations.get(env["idempotency_key"]) is None  # nothing sent: the key is free


async def test_a_change_after_the_last_read_meets_the_captured_if_match_at_the_backend(stack):
    """A change that lands after the read under the lock (here: while the rename is on its way) is the
    backend's to catch: the version the decision saw travels as If-Match, and the stale write is refused."""
    await stack.fault("rename_project", "slow", delay_ms=800, count=1)
    call = asyncio.create_task(stack.call("rename_project", RENAME))
    await wait_until(lambda: _renames(stack), timeout=10, what="the rename at the backend")
    project = stack.backend.projects["prj_1001"]
    project["owner"], project["version"] = "mallory", project["version"] + 1  # transferred outside the proxy
    status, env = await call
    assert env["outcome"] == "failed" and env["error"]["details"]["backend_status"] == 412, env
    assert env["side_effect"] == {"attempted": True, "committed": False}
    assert "name" not in project and stack.backend.effect_counts().get("rename_project") is None


async def test_a_captured_state_the_read_cannot_give_sends_nothing_but_a_duplicate_replays(stack):
    await stack.fault("get_project", "http_500", count=1)  # the read at the decision fails
    _, env = await stack.call("rename_project", RENAME, headers={"Idempotency-Key": "rename-unread"})
    assert env["error"]["code"] == "dependency_unavailable" and env["error"]["phase"] == "authorize", env
    assert env["error"]["details"]["state_read"] == "get_project@1.0.0" and env["error"]["details"]["read_error"]
    assert env["side_effect"] == {"attempted": False, "committed": False} and not _renames(stack)
    assert await stack.runtime.operations.get(env["idempotency_key"]) is None  # the key is free again

    _, done = await stack.call("rename_project", RENAME, headers={"Idempotency-Key": "rename-unread"})
    assert done["outcome"] == "succeeded" and len(_renames(stack)) == 1, done
    await stack.fault("get_project", "http_500", count=1)
    _, again = await stack.call("rename_project", RENAME, headers={"Idempotency-Key": "rename-unread"})
    assert again["outcome"] == "succeeded" and again.get("replayed") is True, again  # the stored answer
    assert len(_renames(stack)) == 1
