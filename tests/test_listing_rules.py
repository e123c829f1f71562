"""Listing and calling have their own rules (issue 31, part 3), through the real proxy and OPA.

``policies/listing.rego`` decides what ``GET /v1/tools`` and MCP ``tools/list`` show; the call rules
(``decision.rego``) decide every call. A tool hidden by ``settings.listing.hidden`` is not listed and
still callable; a tool the caller may not call is neither.
"""

from __future__ import annotations

import difflib
import json

from tests.support.servers import OpaServer
from tests.support.stack import REPO, running_stack


def opa_hiding(tool: str, tmp_path) -> OpaServer:
    """A real OPA with the demo policies and data, whose listing rules hide ``tool``."""
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["listing"] = {"hidden": [tool]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    return OpaServer([REPO / "policies", tmp_path / "data.json"])


async def test_a_tool_hidden_from_listings_is_still_decided_by_the_call_rules(proxy_deps, tmp_path):
    with opa_hiding("get_order", tmp_path) as opa:
        async with running_stack({**proxy_deps, **opa.settings}) as stack:
            async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
                assert response.status == 200
                listed = {tool["name"] for tool in (await response.json())["tools"]}
            assert "get_orders" in listed
            assert "get_order" not in listed
            status, env = await stack.call("get_order", {"order_id": "ord_1001"})
            assert status == 200, env  # hidden from the listing, admitted by the call rules


async def test_a_misspelled_tool_gets_did_you_mean_only_among_the_tools_listed_for_the_caller(proxy_deps, tmp_path):
    with opa_hiding("generate_report", tmp_path) as opa:
        async with running_stack({**proxy_deps, **opa.settings}) as stack:
            status, env = await stack.call("refund_ordr", {"order_id": "ord_1001"})
            assert status == 404 and env["error"]["code"] == "tool_not_found", env
            assert env["error"]["details"]["did_you_mean"] == "refund_order"
            assert env["error"]["message"].endswith('Did you mean "refund_order"?')

            # Hidden from this caller's listing: the hint does not reveal it, though it is the closest name.
            assert difflib.get_close_matches("generate_reprot", [t.name for t in stack.runtime.registry.active()],
                                             n=1) == ["generate_report"]
            status, env = await stack.call("generate_reprot", {})
            assert status == 404 and env["error"]["code"] == "tool_not_found", env
            assert env["error"]["details"].get("did_you_mean") != "generate_report"
            assert "generate_report" not in json.dumps(env["error"])

            # A known tool's unknown version names its tool already: no hint.
            status, env = await stack.call("refund_order", {"order_id": "ord_1001"}, version="9.9.9")
            assert status == 404 and "did_you_mean" not in env["error"]["details"], env


async def test_no_hint_when_the_listing_decision_fails(proxy_deps):
    with OpaServer([REPO / "policies", REPO / "examples" / "opa" / "data.json"]) as opa:
        async with running_stack({**proxy_deps, **opa.settings}) as stack:
            opa.stop()
            status, env = await stack.call("refund_ordr", {"order_id": "ord_1001"})
            assert status == 404 and env["error"]["code"] == "tool_not_found", env
            assert "did_you_mean" not in env["error"]["details"]
