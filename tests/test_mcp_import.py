"""`toolproxy import-mcp`: registry drafts from a real upstream MCP server, reviewed-by-default safe."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from proxy.authoring.mcp_import import UpstreamTool, _strict_schema, draft
from proxy.registry import load_file
from proxy.telemetry.record_view import apply, ephemeral_key
from tests.support.mcp_upstream import running_upstream
from tests.support.stack import DEMO_REGISTRY, running_stack
from tests.support.tokens import Issuer


async def import_mcp(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy.cli", "import-mcp", *args,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def test_draft_is_valid_conservative_and_marked_for_review(tmp_path: Path, proxy_deps):
    async with running_upstream() as upstream:
        code, out, err = await import_mcp(upstream.url, "--prefix", "up.")
        assert code == 0, err
        drafted = tmp_path / "drafted.yaml"
        drafted.write_text(out)
        tools = {t.name: t for t in load_file(drafted)}
        assert {"up.adjust", "up.lookup", "up.slow_write", "up.refuse", "up.crash"} <= set(tools)
        for tool in tools.values():
            assert (tool.mode, tool.risk, tool.idempotency_required) == ("write", "destructive", True)
            assert tool.backend.type == "mcp" and tool.backend.url == upstream.url
            assert tool.input_schema["additionalProperties"] is False
        assert tools["up.adjust"].backend.tool == "adjust"
        # The upstream's readOnlyHint is shown to the reviewer but not applied.
        assert "readOnlyHint=True" in out and tools["up.adjust"].mode == "write"
        assert out.count("# REVIEW mode/risk") == len(tools)
        assert "NOT REVIEWED" in out and f"drafted {len(tools)} tool(s)" in err

        # The draft is usable as is: the proxy executes the upstream tool through it — and,
        # being "destructive" until reviewed, only with a person's approval.
        approvers = Issuer(tmp_path, issuer="https://approvers.test", kid="admin-key")
        overrides = {**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(drafted)],
                     "admin_identity.jwt": {"issuer": approvers.issuer, "jwks_file": str(approvers.jwks_file)}}
        async with running_stack(overrides) as stack:
            status, env = await stack.call("up.adjust", {"counter": "c1", "delta": 4},
                                           headers={"X-Run-Id": "run-import"})
            assert env["error"]["code"] == "approval_required"
            approval_id = env["error"]["details"]["approval_id"]
            token = approvers.token("reviewer", audience="toolproxy-admin", roles=["approver"])
            assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", token))[0] == 200
            status, env = await stack.call("up.adjust", {"counter": "c1", "delta": 4},
                                           headers={"X-Approval-Id": approval_id, "X-Run-Id": "run-import"})
        assert (status, env["data"]) == (200, {"counter": "c1", "value": 4})
        assert upstream.state.count("adjust") == 1


async def test_service_form_and_unreachable_upstream(tmp_path: Path):
    async with running_upstream() as upstream:
        code, out, _ = await import_mcp(upstream.url, "--service", "tools")
        assert code == 0
        drafted = tmp_path / "svc.yaml"
        drafted.write_text(out)
        backend = load_file(drafted)[0].backend
        assert (backend.url, backend.service, backend.path) == (None, "tools", "/mcp")
        url = upstream.url
    code, out, err = await import_mcp(url, "--timeout", "5")
    assert code == 1 and out == ""
    assert "cannot list tools" in err and "Traceback" not in err


def test_strictifying_touches_schema_positions_only():
    schema = {"type": "object",
              "properties": {"properties": {"type": "object", "properties": {"x": {"type": "string"}}},
                             "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                             "mode": {"enum": [{"properties": 1}], "default": {"properties": {}}}}}
    strict, possible, changes, kept_open = _strict_schema(schema)
    assert changes == 2 and kept_open == []                                  # the root and the nested object
    assert possible is False                             # "tags" is an open map: strict: false, flagged
    assert strict["properties"]["mode"] == schema["properties"]["mode"]
    assert "additionalProperties" not in strict["properties"]  # a property named "properties" is not a schema
    text = draft([UpstreamTool("bad name!", None, schema, None, {})], url="http://u/mcp")
    assert "strict: false" in text and "name: bad_name_" in text
    entries = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "outputSchema" not in entries  # none upstream: none drafted (an empty one promises nothing)
    assert "EVERY CALL NEEDS AN APPROVAL" in text


def test_an_explicitly_open_object_stays_open_and_the_review_note_says_so():
    """``additionalProperties: true`` is the upstream saying "any keys" (a metadata map): closing it would make
    an empty closed object that refuses every value. It stays open, strict: false, and REVIEW names it."""
    schema = {"type": "object", "additionalProperties": False, "required": ["title"],
              "properties": {"title": {"type": "string"},
                             "metadata": {"type": "object", "additionalProperties": True}}}
    strict, possible, changes, kept_open = _strict_schema(schema)
    assert strict["properties"]["metadata"] == {"type": "object", "additionalProperties": True}
    assert (possible, changes, kept_open) == (False, 0, ["inputSchema.properties.metadata"])
    text = draft([UpstreamTool("create_page", "Create a page.", schema, None, {})], url="http://u/mcp")
    assert "# REVIEW inputSchema: kept open where the upstream says additionalProperties: true " \
           "(inputSchema.properties.metadata)" in text
    assert "strict: false" in text


def test_the_draft_proposes_sensitive_fields_for_review(tmp_path: Path):
    schema = {"type": "object", "properties": {"to": {"type": "string"}, "emailBody": {"type": "string"},
                                               "api_key": {"type": "string"}, "count": {"type": "integer"}}}
    text = draft([UpstreamTool("send", None, schema, None, {})], url="http://u/mcp")
    assert "# REVIEW sensitive_fields: proposed from the argument names and formats (emailBody, api_key)" in text
    path = tmp_path / "draft.yaml"
    path.write_text(text)
    [tool] = load_file(path)
    assert tool.sensitive_fields == ("emailBody", "api_key")
    _, masked = apply({"to": "a", "emailBody": "b", "api_key": "c", "count": 2}, tool.record_view, ephemeral_key())
    assert set(masked) == {("emailBody",), ("api_key",), ("to",)}  # free text is fingerprinted in records too
    nested = {"type": "object", "properties": {
        "recipient": {"type": "string", "format": "email"},
        "payment": {"type": "object", "properties": {"iban": {"type": "string"}, "amount": {"type": "integer"}}},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "securityCode": {"type": "string"}, "sku": {"type": "string"}}}},
        "login": {"type": "string", "writeOnly": True}}}
    text = draft([UpstreamTool("pay", None, nested, None, {})], url="http://u/mcp")
    path.write_text(text)
    [tool] = load_file(path)
    assert tool.sensitive_fields == ("recipient", "payment.iban", "lines.securityCode", "login")
    bare = draft([UpstreamTool("count", None, {"type": "object", "properties": {"n": {"type": "integer"}}},
                               None, {})], url="http://u/mcp")
    assert "sensitive_fields: none proposed" in bare


def test_the_draft_proposes_flow_labels_from_what_a_tool_returns_and_what_aims_it(tmp_path: Path, capsys):
    """A mail reader's output has fields others write (untrusted); a sender's arguments aim it (sink arguments).
    The draft loads as written, and check-registry warns about the same reader left unlabelled."""
    from proxy.cli import main as cli_main
    inbox_out = {"type": "object", "properties": {"emails": {"type": "array", "items": {
        "type": "object", "properties": {"id_": {"type": "string"}, "sender": {"type": "string"},
                                         "body": {"type": "string"}, "message_id": {"type": "string"}}}}}}
    send_in = {"type": "object", "properties": {"recipients": {"type": "array", "items": {"type": "string"}},
                                                "event": {"type": "object", "properties": {
                                                    "participants": {"type": "array", "items": {"type": "string"}}}},
                                                "count": {"type": "integer"}}}
    text = draft([UpstreamTool("get_received_emails", "Your inbox.", {"type": "object", "properties": {}},
                               inbox_out, {}),
                  UpstreamTool("send_email", "Send.", send_in, None, {}),
                  UpstreamTool("get_balance", "Your balance.", {"type": "object", "properties": {}},
                               {"type": "object", "properties": {"balance": {"type": "number"}}}, {})],
                 url="http://u/mcp")
    assert "# REVIEW flow.produces: untrusted proposed: the output has fields others usually write " \
           "(emails, emails.sender, emails.body)" in text
    assert "# REVIEW flow.sink_arguments: proposed from the argument names (/recipients, /event/participants)" in text
    assert "flow.produces: none proposed" in text  # the balance: nobody else writes it
    path = tmp_path / "draft.yaml"
    path.write_text(text)
    inbox, send, balance = load_file(path)
    assert inbox.flow_produces == ("untrusted",) and not inbox.flow_sink_arguments
    assert send.flow_sink_arguments == ("/recipients", "/event/participants") and send.flow_integrity == "destructive"
    assert balance.flow_produces == () and not balance.flow_sink_arguments

    unlabelled = tmp_path / "unlabelled.yaml"
    unlabelled.write_text(text.replace("flow:\n      produces:\n      - untrusted\n", ""))
    assert cli_main(["check-registry", "--dev", str(unlabelled)]) == 0
    out = capsys.readouterr().out
    assert f"warning: get_received_emails 1.0.0 ({unlabelled}): its output has fields others usually write " \
           "(emails, emails.sender, emails.body) but flow.produces does not say untrusted" in out
    assert out.count("flow.produces does not say untrusted") == 1  # not the balance, not the sender
    assert cli_main(["check-registry", "--dev", str(path)]) == 0
    assert "flow.produces does not say untrusted" not in capsys.readouterr().out
