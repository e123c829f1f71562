"""Listing and calling have their own rules (issue 31, part 3), through the real proxy and OPA.

``policies/listing.rego`` decides what ``GET /v1/tools`` and MCP ``tools/list`` show; the call rules
(``decision.rego``) decide every call. A tool hidden by ``settings.listing.hidden`` is not listed and
still callable; a tool the caller may not call is neither.
"""

from __future__ import annotations

import json

from tests.support.servers import OpaServer
from tests.support.stack import REPO, running_stack


async def test_a_tool_hidden_from_listings_is_still_decided_by_the_call_rules(proxy_deps, tmp_path):
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["listing"] = {"hidden": ["get_order"]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    with OpaServer([REPO / "policies", tmp_path / "data.json"]) as opa:
        async with running_stack({**proxy_deps, **opa.settings}) as stack:
            async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
                assert response.status == 200
                listed = {tool["name"] for tool in (await response.json())["tools"]}
            assert "get_orders" in listed
            assert "get_order" not in listed
            status, env = await stack.call("get_order", {"order_id": "ord_1001"})
            assert status == 200, env  # hidden from the listing, admitted by the call rules
