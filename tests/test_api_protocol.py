"""Request-level failures on the agent API are envelopes with stable codes."""

from __future__ import annotations

import pytest

from tests.support.stack import assert_envelope, running_stack


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack({**proxy_deps, "listen.max_body_bytes": 4096}) as s:
        yield s


async def test_body_over_the_limit_is_payload_too_large(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_" + "x" * 8000})
    assert status == 413
    assert env["error"]["code"] == "payload_too_large"


async def test_wrong_content_type_is_unsupported_media_type(stack):
    status, env = await stack.post("/v1/tool-calls", None, raw=b"call_id=1", content_type="text/plain")
    assert status == 415
    assert env["error"]["code"] == "unsupported_media_type"


async def test_unknown_route_is_an_envelope(stack):
    async with stack.session.get(stack.proxy_url + "/v2/whatever") as response:
        body = await response.json()
    assert response.status == 404
    assert_envelope(body)
    assert body["error"]["code"] == "route_not_found"
    assert response.headers["X-Request-Id"] == body["request_id"]


async def test_wrong_method_is_an_envelope(stack):
    async with stack.session.delete(stack.proxy_url + "/v1/tool-calls") as response:
        body = await response.json()
    assert response.status == 405
    assert body["error"]["code"] == "method_not_allowed"


async def test_malformed_request_body_is_invalid_json(stack):
    status, env = await stack.post("/v1/tool-calls", None, raw=b'{"call_id": "c1", "tool": ')
    assert status == 400
    assert env["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("body", [
    {"tool": "get_order", "arguments": {}},
    {"call_id": "c1", "tool": "get_order"},
    {"call_id": "c1", "tool": "get_order", "arguments": [], "extra": 1},
    {"call_id": "c 1 with spaces", "tool": "get_order", "arguments": {}},
])
async def test_request_shape_violations_are_invalid_request(stack, body):
    status, env = await stack.post("/v1/tool-calls", body)
    assert status == 400
    assert env["error"]["code"] == "invalid_request"


async def test_caller_request_id_is_echoed_when_safe(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers={"X-Request-Id": "req-123"})
    assert env["request_id"] == "req-123"
    status, env = await stack.call("get_order", {"order_id": "ord_1001"},
                                   headers={"X-Request-Id": "bad id\twith tab"})
    assert env["request_id"] != "bad id\twith tab"


async def test_malformed_deadline_header_is_invalid_request(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers={"Request-Timeout": "soon"})
    assert status == 400
    assert env["error"]["code"] == "invalid_request"


async def test_tool_listing_shows_contracts(stack):
    async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
        body = await response.json()
    names = [t["name"] for t in body["tools"]]
    assert names == sorted(names)
    refund = next(t for t in body["tools"] if t["name"] == "refund_order")
    assert refund["mode"] == "write" and refund["risk"] == "financial"
    assert refund["inputSchema"]["additionalProperties"] is False
    assert "backend" not in refund  # internal addresses stay inside


# The error table (docs/errors.md) against the catalogue: tests/unit/test_docs.py.
