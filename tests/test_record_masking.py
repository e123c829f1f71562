"""Audit and decision records keep less: identifiers, numbers and enums in clear, every other argument
masked unless the contract marks it safe to show (``safe_to_show``). A replayed exfiltration: the stolen
security code the model put in a notice's free-text message reaches neither record (only args_hash binds
it); what names a resource stays readable."""

from __future__ import annotations

import json

from tests.support.audit import audit_records
from tests.support.stack import running_stack
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
    assert notice["input"]["arguments"] == {"recipients": ["usr_1001"], "message": "[redacted]"}
    assert ["arguments", "message"] in notice["masked_paths"]
    sent = [a for a in audits if a["tool"] == "send_notices"]
    assert all(a["arguments"]["message"] == "[redacted]" and a["arguments"]["recipients"] == ["usr_1001"]
               and len(a["args_hash"]) == 64 for a in sent)
    # What the contract marks safe to show stays (who a project goes to).
    [transfer] = [d for d in decisions if d["tool"] == "transfer_project"]
    assert transfer["input"]["arguments"]["to_owner"] == "bob"
